"""[issue 33, item 4] The README is an entry point: at most 200 lines, with the sections a new user
needs, the two set-up commands, and a link to every page of docs/."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_an_entry_point():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", text, re.M)
    for wanted in ("Quick start", "What you get", "Train on your own data / on GPUs", "Multi-node", "Documentation"):
        assert wanted in headings, (wanted, headings)
    assert "Prerequisites:" in text
    quick = text.split("## Quick start", 1)[1].split("##", 1)[0]
    assert re.findall(r"^bash scripts/\S+", quick, re.M) == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]
    linked = set(re.findall(r"\(docs/([\w-]+\.md)", text))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, sorted(pages - linked)
    assert not re.search(r"20\d\d-\d\d-\d\d \((morning|afternoon|evening|night)\)", text)   # no run log

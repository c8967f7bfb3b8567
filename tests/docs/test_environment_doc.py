"""docs/environment.md lists every environment variable the code reads: a variable name that the code
reads (`os.environ[...]`, `.get(...)`, `getenv`, `setdefault`, or a `*_ENV = "..."` constant) or sets
for its workers, and every `VERL_ARPO_*` name, must appear in the table (found by scanning the source,
not by a hand-kept list)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READ = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(\s*|environ\[\s*|getenv\(\s*|_ENV\w*\s*=\s*)["']([A-Z][A-Z0-9_]{2,})["']""")
OURS = re.compile(r"\bVERL_ARPO_[A-Z0-9_]+\b")
SOURCES = [*ROOT.glob("verl_arpo/**/*.py"), *ROOT.glob("merge_ckpt/*.py"), *ROOT.glob("scripts/*.py"),
           *ROOT.glob("scripts/*.sh"), ROOT / "tests" / "algos" / "test_against_verl.py"]


def test_every_variable_the_code_reads_is_in_the_table():
    doc = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", doc))
    read = {}
    for path in SOURCES:
        text = path.read_text()
        for name in set(READ.findall(text)) | set(OURS.findall(text)):
            read.setdefault(name, str(path.relative_to(ROOT)))
    assert len(read) >= 10, read   # the scan found the reads (a broken pattern would find none)
    missing = {name: where for name, where in read.items() if name not in documented}
    assert not missing, f"not in docs/environment.md: {missing}"

"""Generate the bundled offline search corpus: fictional towns, people and companies.

Every entity is invented (names are built from syllables, facts are drawn from a seeded RNG), so no
pretrained model can know the answers: a question about them is only answerable through the
search tool, which is what tool-use RL needs to reward. The facts link entities (a company's
founder was born in a town founded by someone else), so multi-hop questions are possible.

    python search_cache/make_corpus.py                       # writes search_cache/local_corpus.jsonl
    python search_cache/make_corpus.py --seed 3 --out /tmp/c.jsonl

From Python (e.g. to generate questions whose answers are in the corpus)::

    spec = importlib.util.spec_from_file_location("make_corpus", "search_cache/make_corpus.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    facts = mod.fictional_facts(seed=0)   # [{doc_id, entity, type, attribute, value}, ...]

The output is deterministic for a seed (same Python version or not: only ``random.Random`` with an
integer seed and stable iteration order are used). Documents are ``{"id", "title", "text"}``.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Dict, List, Tuple

DEFAULT_SEED = 0
N_COUNTRIES, N_TOWNS, N_PEOPLE, N_COMPANIES = 8, 120, 150, 100

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gl", "h", "k", "kr", "l", "m", "n", "p", "qu", "r", "s",
           "sk", "st", "t", "th", "tr", "v", "vr", "z", "zh", "y", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ia", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk", "m", "x", "v"]
_TOWN_ENDS = ["holt", "mora", "stad", "wick", "vale", "grund", "ford", "heim", "port", "mere"]
_CO_SUFFIX = ["Works", "Industries", "Instruments", "Mills", "Labs", "Foundry", "Collective", "Company"]
_OCCUPATIONS = ["engineer", "botanist", "cartographer", "chemist", "composer", "astronomer", "architect",
                "glassmaker", "clockmaker", "physician", "linguist", "shipwright"]
_INVENTIONS = ["a tidal clock", "a folding telescope", "a salt-water battery", "a spiral loom",
               "a pressure lantern", "a seed-drying kiln", "a brass calculating wheel", "a reed organ",
               "a bridge truss", "a copper still", "a signal mirror", "a paper press", "a wind pump",
               "a lens grinder", "a glass harmonica", "an ice saw"]
_PRODUCTS = ["spindle valves", "ceramic insulators", "amber varnish", "rope bridges", "barometers",
             "tin whistles", "canal locks", "felt hats", "pumice soap", "signal flags", "slate tiles",
             "quill pens", "dye vats", "sailcloth", "iron stoves", "river barges"]
_RIVERS_SUFFIX = ["River", "Water", "Brook", "Run"]


class _Names:
    """Unique invented names from syllables."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: Tuple[int, int] = (2, 3), end: str = "") -> str:
        for _ in range(1000):
            n = self.rng.randint(*syllables)
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(n - 1))
            w += self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS) + end
            w = w.capitalize()
            if w not in self.used and len(w) >= 5:
                self.used.add(w)
                return w
        raise RuntimeError("name space exhausted")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _build(seed: int) -> Tuple[List[Dict], List[Dict]]:
    """(documents, facts) for one seed."""
    rng = random.Random(seed)
    names = _Names(rng)
    countries = [names.word((2, 3), end="ia") for _ in range(N_COUNTRIES)]
    people = [{"name": f"{names.word((2, 2))} {names.word((2, 3))}"} for _ in range(N_PEOPLE)]
    towns = [{"name": names.word((1, 2), end=rng.choice(_TOWN_ENDS))} for _ in range(N_TOWNS)]
    for t in towns:
        t.update(country=rng.choice(countries), founded=rng.randint(1150, 1890),
                 population=rng.randint(8, 4000) * 250 + rng.randint(0, 249),
                 river=f"{names.word((2, 2))} {rng.choice(_RIVERS_SUFFIX)}",
                 founder=rng.choice(people)["name"], known_for=rng.choice(_PRODUCTS))
    for p in people:
        born = rng.randint(1700, 1960)
        p.update(born=born, birthplace=rng.choice(towns)["name"], occupation=rng.choice(_OCCUPATIONS),
                 invention=rng.choice(_INVENTIONS), invention_year=born + rng.randint(22, 60),
                 died=born + rng.randint(61, 99))
    companies = []
    for _ in range(N_COMPANIES):
        founder = rng.choice(people)
        companies.append({
            "name": f"{names.word((2, 3))} {rng.choice(_CO_SUFFIX)}", "founder": founder["name"],
            "founded": founder["born"] + rng.randint(20, 55), "headquarters": rng.choice(towns)["name"],
            "product": rng.choice(_PRODUCTS), "employees": rng.randint(3, 9000),
        })

    docs: List[Dict] = []
    facts: List[Dict] = []

    def add(kind: str, entity: str, text: str, attrs: Dict) -> None:
        doc_id = f"{kind}-{len(docs):04d}"
        docs.append({"id": doc_id, "title": entity, "text": text})
        facts.extend({"doc_id": doc_id, "entity": entity, "type": kind, "attribute": k, "value": v}
                     for k, v in attrs.items())

    for t in towns:
        text = (f"{t['name']} is a town in {t['country']} on the banks of the {t['river']}. "
                f"It was founded in {t['founded']} by {t['founder']}. "
                f"The town has a population of {t['population']:,} and is known for its {t['known_for']}.")
        add("town", t["name"], text, {k: t[k] for k in ("country", "river", "founded", "founder",
                                                          "population", "known_for")})
    for p in people:
        job = f"{_article(p['occupation'])} {p['occupation']}"
        text = (f"{p['name']} ({p['born']}-{p['died']}) was {job} born in {p['birthplace']}. "
                f"{p['name'].split()[0]} is best remembered for inventing {p['invention']} "
                f"in {p['invention_year']}.")
        add("person", p["name"], text, {k: p[k] for k in ("born", "died", "birthplace", "occupation",
                                                          "invention", "invention_year")})
    for c in companies:
        text = (f"{c['name']} is a maker of {c['product']} headquartered in {c['headquarters']}. "
                f"The company was founded in {c['founded']} by {c['founder']} "
                f"and today employs {c['employees']:,} people.")
        add("company", c["name"], text, {k: c[k] for k in ("product", "headquarters", "founded",
                                                           "founder", "employees")})
    # interleave kinds so the file does not read as three blocks (cosmetic, but deterministic)
    order = list(range(len(docs)))
    rng.shuffle(order)
    return [docs[i] for i in order], facts


def make_world(seed: int) -> Tuple[List[Dict], List[Dict]]:
    """(documents, facts) of one seed's world, e.g. new entities for a fresh evaluation split
    (rl_datasets/make_task.py --fresh)."""
    return _build(seed)


def make_corpus(seed: int = DEFAULT_SEED) -> List[Dict]:
    """Documents ``{"id", "title", "text"}`` for ``seed``."""
    return _build(seed)[0]


def fictional_facts(seed: int = DEFAULT_SEED) -> List[Dict]:
    """Ground truth for ``seed``: ``{"doc_id", "entity", "type", "attribute", "value"}`` per fact.

    ``type`` is town | person | company. Attributes: town: country, river, founded, founder,
    population, known_for; person: born, died, birthplace, occupation, invention, invention_year;
    company: product, headquarters, founded, founder, employees. Values are ints or strings exactly
    as written in the document (numbers are written with thousands separators there).
    """
    return _build(seed)[1]


def write_corpus(path: Path, seed: int = DEFAULT_SEED) -> int:
    docs = make_corpus(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return len(docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("local_corpus.jsonl"))
    args = ap.parse_args()
    n = write_corpus(args.out, args.seed)
    print(f"wrote {n} documents to {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()

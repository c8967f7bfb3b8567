"""Build the bundled tool-use task: RL parquet splits and a cold-start SFT set, deterministically.

    python rl_datasets/make_task.py --seed 0                 # writes the committed files below
    python rl_datasets/make_task.py --seed 0 --out /tmp/task --tools configs/tools/python_only.yaml
    python rl_datasets/make_task.py --fresh test_fresh --seed 202 --entity_seed 202   # a fresh split (below)

Outputs (in --out, default rl_datasets/):
- `train.parquet`, `valid.parquet`, `test.parquet`: verl rows (`data_source`, `prompt` = [system,
  user] messages, `ability`, `reward_model` = {ground_truth, style: "rule"}, `extra_info` =
  {split, index, kind, template, question, entity, tools});
- `sft_train.jsonl`: one `conversations` record per train question, written by a scripted solver
  that really calls the tools (sandboxed Python, BM25 search over search_cache/local_corpus.jsonl).

Three kinds of questions, each needing a tool a 135M model does not carry in its weights:
- math (`arpo_toy_math`, math scorer): 3–4-digit products, sums of 4–6 numbers, a*b+c, remainders;
  answered with `<python>print(expr)</python>`;
- search (`arpo_toy_search`, qa_f1 scorer: deep_research's without the tool bonus): facts about
  the fictional towns, people and companies of the bundled corpus (search_cache/make_corpus.py)
  -- no model can know them;
- multi (`arpo_toy_multi`, qa_f1 scorer): a fact from search, then arithmetic on it in
  Python (years between a founding and a year, population / d rounded, age at an invention, ...).
Train, valid and test use disjoint entities (70% / 10% / 20% of each type), so test facts were never
seen in SFT. A fact question is kept only if the solver's query "<entity> <keyword>" ranks the
entity's own document first, i.e. the task is solvable with the tools as configured.

Fresh splits (`--fresh NAME --seed S --entity_seed E`): NAME.parquet holds 200 questions per kind
about a *new* world of entities (make_corpus.make_world(E), names that clash with an existing
entity dropped), with new numbers for the arithmetic (S); the world's documents are appended to
search_cache/local_corpus_fresh.jsonl (the bundled corpus plus every fresh world), which the runs
that use these splits search. The committed ones: valid_fresh (S = E = 101), the split every tuning
choice is judged on, and test_fresh (S = E = 202), opened only by the confirmatory runs
(experiments/compare_algorithms.py; docs/results.md).

Every solver trajectory is checked: the tool outputs contain the answer, and `default_compute_score`
gives it full marks (math: 1.0; deep_research: F1 = 1, plus the both-tools bonus for multi).
Trajectories are short on purpose: the SFT teaches the format, RL is meant to teach the rest.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOOLS = ROOT / "configs" / "tools" / "python_search_local.yaml"
# questions per kind and split. The test split is last, so its size changes neither train, valid nor
# the SFT set. 200 per kind (600): a paired difference between two models on it has a 95% interval of
# about +-0.035 (the quickstart's per-question SD of a difference, 0.45, over sqrt(600)), small enough
# to see a 0.05 difference; 50 per kind gave +-0.07 (docs/results.md).
SPLITS = {"train": 200, "valid": 20, "test": 200}
ENTITY_SHARE = {"train": 0.7, "valid": 0.1, "test": 0.2}
DATA_SOURCES = {"math": "arpo_toy_math", "search": "arpo_toy_search", "multi": "arpo_toy_multi"}
ABILITY = {"math": "math", "search": "search", "multi": "math+search"}

# --------------------------------------------------------------------------- fact questions
# (type, attribute) -> (question template, search keyword)
SEARCH_TEMPLATES: dict[tuple[str, str], tuple[str, str]] = {
    ("town", "founded"): ("In which year was the town of {e} founded?", "founded"),
    ("town", "founder"): ("Who founded the town of {e}?", "founded"),
    ("town", "country"): ("In which country is the town of {e}?", "country"),
    ("town", "river"): ("On which river does the town of {e} lie?", "river"),
    ("town", "known_for"): ("What is the town of {e} known for?", "known for"),
    ("town", "population"): ("What is the population of {e}?", "population"),
    ("person", "born"): ("In which year was {e} born?", "born"),
    ("person", "died"): ("In which year did {e} die?", "died"),
    ("person", "birthplace"): ("In which town was {e} born?", "born"),
    ("person", "occupation"): ("What was the occupation of {e}?", "occupation"),
    ("person", "invention"): ("What is {e} best remembered for inventing?", "inventing"),
    ("company", "founder"): ("Who founded {e}?", "founded"),
    ("company", "founded"): ("In which year was {e} founded?", "founded"),
    ("company", "headquarters"): ("In which town is {e} headquartered?", "headquartered"),
    ("company", "product"): ("What does {e} make?", "maker"),
    ("company", "employees"): ("How many people does {e} employ?", "employs"),
}


def load_make_corpus():
    """search_cache/make_corpus.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "search_cache" / "make_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def entities(facts: list[dict]) -> dict[str, dict[str, Any]]:
    """entity name -> {"type", "doc_id", attribute: value, ...}."""
    out: dict[str, dict[str, Any]] = {}
    for f in facts:
        e = out.setdefault(f["entity"], {"type": f["type"], "doc_id": f["doc_id"]})
        e[f["attribute"]] = f["value"]
    return out


def split_entities(ents: dict[str, dict], rng: random.Random) -> dict[str, list[str]]:
    """Disjoint entity lists per split, ENTITY_SHARE of every entity type each."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for etype in ("town", "person", "company"):
        names = sorted(n for n, e in ents.items() if e["type"] == etype)
        rng.shuffle(names)
        a = round(len(names) * ENTITY_SHARE["train"])
        b = a + round(len(names) * ENTITY_SHARE["valid"])
        out["train"] += names[:a]
        out["valid"] += names[a:b]
        out["test"] += names[b:]
    return out


# --------------------------------------------------------------------------- question makers
# Each returns a question dict: kind, template, question, answer, and the solver's plan:
# "query" (search), "checks" (strings page 1 must contain), "note" (multi: the fact, restated),
# "code" (python).

def _math_question(rng: random.Random) -> dict:
    form = rng.choice(["mul", "mul", "sum", "muladd", "mod"])
    ask = rng.choice(["What is {x}?", "Compute {x}.", "Calculate {x}."])
    if form == "mul":
        expr = f"{rng.randint(100, 9999)} * {rng.randint(12, 999)}"
    elif form == "sum":
        expr = " + ".join(str(rng.randint(100, 9999)) for _ in range(rng.randint(4, 6)))
    elif form == "muladd":
        expr = f"{rng.randint(100, 999)} * {rng.randint(12, 99)} + {rng.randint(100, 9999)}"
    else:
        a, b = rng.randint(10000, 99999), rng.randint(13, 97)
        return {"kind": "math", "template": "math.mod", "code": f"print({a} % {b})",
                "question": f"What is the remainder when {a} is divided by {b}?", "answer": str(a % b)}
    return {"kind": "math", "template": f"math.{form}", "question": ask.format(x=expr),
            "code": f"print({expr})", "answer": str(eval(expr))}  # noqa: S307 - our own digits


def _fmt(value: Any) -> str:
    """A count as the corpus writes it (populations and head counts have thousands separators)."""
    return f"{value:,}" if isinstance(value, int) else str(value)


def _search_question(rng: random.Random, name: str, ent: dict) -> dict:
    attrs = [a for (t, a) in SEARCH_TEMPLATES if t == ent["type"]]
    attr = rng.choice(attrs)
    template, keyword = SEARCH_TEMPLATES[(ent["type"], attr)]
    value = ent[attr]
    return {"kind": "search", "template": f"search.{ent['type']}.{attr}", "entity": name,
            "doc_id": ent["doc_id"], "question": template.format(e=name), "query": f"{name} {keyword}",
            "checks": [_fmt(value) if attr in ("population", "employees") else str(value)],
            "answer": str(value)}


def _multi_question(rng: random.Random, name: str, ent: dict) -> dict:
    t, n = ent["type"], _fmt
    q = {"kind": "multi", "entity": name, "doc_id": ent["doc_id"]}
    if t == "town" and rng.random() < 0.5:
        year = rng.randint(1900, 2025)
        q.update(template="multi.town.years_since", query=f"{name} founded", checks=[str(ent["founded"])],
                 note=f"{name} was founded in {ent['founded']}.",
                 question=f"How many years passed between the founding of {name} and the year {year}?",
                 code=f"print({year} - {ent['founded']})", answer=str(year - ent["founded"]))
    elif t == "town":
        d = rng.choice([3, 7, 9, 11, 13])
        q.update(template="multi.town.population_div", query=f"{name} population", checks=[n(ent["population"])],
                 note=f"The population of {name} is {n(ent['population'])}.",
                 question=f"What is the population of {name} divided by {d}, rounded to the nearest whole number?",
                 code=f"print(round({ent['population']} / {d}))", answer=str(round(ent["population"] / d)))
    elif t == "person" and rng.random() < 0.5:
        q.update(template="multi.person.invention_age", query=f"{name} born",
                 checks=[str(ent["born"]), str(ent["invention_year"])],
                 note=f"{name} was born in {ent['born']} and invented it in {ent['invention_year']}.",
                 question=f"How old was {name} when inventing {ent['invention']}?",
                 code=f"print({ent['invention_year']} - {ent['born']})",
                 answer=str(ent["invention_year"] - ent["born"]))
    elif t == "person":
        q.update(template="multi.person.lifespan", query=f"{name} born", checks=[f"{ent['born']}-{ent['died']}"],
                 note=f"{name} lived from {ent['born']} to {ent['died']}.",
                 question=f"How many years did {name} live?", code=f"print({ent['died']} - {ent['born']})",
                 answer=str(ent["died"] - ent["born"]))
    else:
        h = rng.choice([35, 38, 40, 42])
        q.update(template="multi.company.weekly_hours", query=f"{name} employs", checks=[n(ent["employees"])],
                 note=f"{name} employs {n(ent['employees'])} people.",
                 question=f"If every employee of {name} works {h} hours a week, how many hours do they work "
                          f"in total each week?",
                 code=f"print({ent['employees']} * {h})", answer=str(ent["employees"] * h))
    return q


# --------------------------------------------------------------------------- the solver
_OPEN = {
    "math": ["This needs exact arithmetic, so I will use Python.", "I will compute this with Python.",
             "Let me calculate it with Python."],
    "search": ["I need to look this up.", "I will search the knowledge base.", "Let me search for {e}."],
    "multi": ["I need a fact about {e} first, then a calculation.", "First I search for {e}, then I compute.",
              "Let me look up {e} and then use Python."],
}


class Solver:
    """Writes one protocol trajectory per question, running the real tools through a ToolExecutor."""

    def __init__(self, executor, rng: random.Random):
        self.executor, self.rng = executor, rng

    def call(self, tag: str, content: str) -> str:
        result = self.executor.execute(tag, content)
        if not result.ok:
            raise RuntimeError(f"<{tag}> {content!r} failed: {result.text}")
        return result.text

    @staticmethod
    def block(tag: str, content: str, output: str) -> str:
        """The call and its result exactly as the rollout writes them (tool output verbatim)."""
        from verl_arpo.workers.rollout.tool_text import RESULT_TEMPLATE

        return f"<{tag}>{content}</{tag}>" + RESULT_TEMPLATE.format(text=output)

    def solve(self, q: dict) -> str | None:
        """The trajectory, or None when the tools do not give the expected answer."""
        opening = self.rng.choice(_OPEN[q["kind"]]).format(e=q.get("entity", ""))
        parts = [f"<think> {opening} </think>"]
        if q["kind"] in ("search", "multi"):
            found = self.call("search", q["query"])
            first_page = found.split("\nPage 2:")[0]
            if not first_page.startswith(f"Page 1: {q['entity']}:") or not all(c in first_page for c in q["checks"]):
                return None  # the query does not surface the fact on page 1
            parts.append(self.block("search", q["query"], found))
            if q["kind"] == "multi":
                parts.append(f"<think> {q['note']} Now I compute. </think>")
        if q["kind"] in ("math", "multi"):
            out = self.call("python", q["code"])
            if out.strip() != q["answer"]:
                return None
            parts.append(self.block("python", q["code"], out))
        parts.append(f"<answer> \\boxed{{{q['answer']}}} </answer>")
        return " ".join(parts)


# --------------------------------------------------------------------------- assembling
def make_questions(seed: int, executor) -> tuple[dict[str, list[dict]], Counter]:
    """Questions (with their solver trajectories) per split; and a counter of dropped candidates."""
    mc = load_make_corpus()
    ents = entities(mc.fictional_facts(seed=mc.DEFAULT_SEED))  # the bundled corpus is seed 0
    rng = random.Random(seed)
    pools = split_entities(ents, rng)
    solver = Solver(executor, random.Random(seed + 1))
    seen: set[str] = set()
    dropped: Counter = Counter()
    out = {split: solved_questions(rng, solver, pools[split], ents, per_kind, seen, dropped)
           for split, per_kind in SPLITS.items()}
    return out, dropped


def solved_questions(rng: random.Random, solver: "Solver", pool: list[str], ents: dict[str, dict], per_kind: int,
                     seen: set[str], dropped: Counter) -> list[dict]:
    """`per_kind` questions of each kind (lookups and two-step ones about the entities of `pool`),
    each with the solver's trajectory, none in `seen` (which they join), shuffled."""
    rows: list[dict] = []
    for kind in ("math", "search", "multi"):
        made = 0
        while made < per_kind:
            if kind == "math":
                q = _math_question(rng)
            else:
                name = rng.choice(pool)
                maker: Callable = _search_question if kind == "search" else _multi_question
                q = maker(rng, name, ents[name])
            if q["question"] in seen:
                dropped["duplicate"] += 1
                continue
            traj = solver.solve(q)
            if traj is None:
                dropped[f"unsolvable:{q['template']}"] += 1
                continue
            seen.add(q["question"])
            q["trajectory"] = traj
            rows.append(q)
            made += 1
    rng.shuffle(rows)
    return rows


def to_parquet_row(q: dict, split: str, index: int, system_prompt: str) -> dict:
    tools = {"math": ["python"], "search": ["search"], "multi": ["search", "python"]}[q["kind"]]
    return {
        "data_source": DATA_SOURCES[q["kind"]],
        "prompt": [{"role": "system", "content": system_prompt}, {"role": "user", "content": q["question"]}],
        "ability": ABILITY[q["kind"]],
        "reward_model": {"ground_truth": q["answer"], "style": "rule"},
        "extra_info": {"split": split, "index": index, "kind": q["kind"], "template": q["template"],
                       "question": q["question"], "entity": q.get("entity", ""), "tools": tools},
    }


def check_scores(rows: list[dict], trajectories: list[str]) -> None:
    """Every solver trajectory must get full marks from the reward of its data source."""
    from verl_arpo.utils.reward_score import default_compute_score

    for row, traj in zip(rows, trajectories):
        res = default_compute_score(row["data_source"], traj, row["reward_model"]["ground_truth"], row["extra_info"])
        score = res["score"] if isinstance(res, dict) else float(res)
        if abs(score - 1.0) > 1e-6:  # qa_f1 (lookups, two-step) pays no tool bonus
            raise AssertionError(f"{row['data_source']} scored {res} on its own solution:\n{traj}")


def write_outputs(splits: dict[str, list[dict]], out_dir: Path, system_prompt: str) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_arpo.trainer.sft_data import make_record

    out_dir.mkdir(parents=True, exist_ok=True)
    stats: dict[str, Any] = {}
    for split, qs in splits.items():
        rows = [to_parquet_row(q, split, i, system_prompt) for i, q in enumerate(qs)]
        check_scores(rows, [q["trajectory"] for q in qs])
        pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{split}.parquet")
        stats[split] = dict(sorted(Counter(q["kind"] for q in qs).items()))
        stats[f"{split}_templates"] = dict(sorted(Counter(q["template"] for q in qs).items()))
    with open(out_dir / "sft_train.jsonl", "w", encoding="utf-8") as f:
        for i, q in enumerate(splits["train"]):
            rec = make_record(q["question"], q["trajectory"], system=system_prompt,
                              data_source=DATA_SOURCES[q["kind"]], kind=q["kind"], index=i)
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return stats


# --------------------------------------------------------------------------- fresh splits
BASE_CORPUS = ROOT / "search_cache" / "local_corpus.jsonl"
FRESH_CORPUS = ROOT / "search_cache" / "local_corpus_fresh.jsonl"
"""The bundled corpus plus the worlds of every fresh split (the experiment's corpus, docs/results.md)."""


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def fresh_world(entity_seed: int, name: str, taken: set[str]) -> tuple[list[dict], dict[str, dict]]:
    """A new world of fictional entities (search_cache/make_corpus.make_world(entity_seed)) for the
    split `name`: its documents (ids prefixed `<name>-`) and its entities, without any entity whose
    name is already `taken` (so a question never names an entity of another world)."""
    mc = load_make_corpus()
    docs, facts = mc.make_world(entity_seed)
    clash = {f["entity"] for f in facts} & taken
    docs = [{**d, "id": f"{name}-{d['id']}"} for d in docs if d["title"] not in clash]
    facts = [{**f, "doc_id": f"{name}-{f['doc_id']}"} for f in facts if f["entity"] not in clash]
    return docs, entities(facts)


def extend_corpus(corpus: Path, docs: list[dict], name: str) -> list[dict]:
    """`corpus` (the bundled one when it does not exist yet) with `docs` appended once: a second
    call for the same split name finds its documents there and changes nothing."""
    held = read_jsonl(corpus if corpus.exists() else BASE_CORPUS)
    if not any(d["id"].startswith(f"{name}-") for d in held):
        held += docs
        tmp = corpus.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in held), encoding="utf-8")
        tmp.replace(corpus)
    return held


def make_fresh_questions(seed: int, ents: dict[str, dict], per_kind: int, executor) -> tuple[list[dict], Counter]:
    """`per_kind` questions of each kind, the lookups and two-step ones about `ents` only, each one
    solved with the tools (as make_questions does for the bundled splits)."""
    dropped: Counter = Counter()
    rows = solved_questions(random.Random(seed), Solver(executor, random.Random(seed + 1)), sorted(ents), ents,
                            per_kind, set(), dropped)
    return rows, dropped


def make_fresh_split(name: str, seed: int, entity_seed: int, per_kind: int, out_dir: Path,
                     corpus: Path = FRESH_CORPUS) -> dict[str, Any]:
    """Write `<out_dir>/<name>.parquet`: `per_kind` × 3 questions about a new world (entity_seed),
    its documents appended to `corpus`. Its math numbers come from `seed`; its lookups name only new
    entities, so no fact it asks was in the SFT data, the training prompts or another split."""
    from verl_arpo.trainer.sft_data import SYSTEM_PROMPT
    from verl_arpo.workers.rollout.tools import ToolExecutor
    from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool
    from verl_arpo.workers.rollout.tools.python_tool import PythonTool

    taken = {d["title"] for d in read_jsonl(corpus if corpus.exists() else BASE_CORPUS)
             if not d["id"].startswith(f"{name}-")}
    docs, ents = fresh_world(entity_seed, name, taken)
    extend_corpus(corpus, docs, name)
    # the solver searches the extended corpus with the bundled tool settings (the SFT data's)
    with ToolExecutor({"python": PythonTool(timeout=30), "search": LocalSearchTool(str(corpus), max_results=2,
                                                                                 result_length=200)},
                      max_workers=4, timeout=60, retry_count=2, call_limit=3) as executor:
        qs, dropped = make_fresh_questions(seed, ents, per_kind, executor)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [to_parquet_row(q, name, i, SYSTEM_PROMPT) for i, q in enumerate(qs)]
    check_scores(rows, [q["trajectory"] for q in qs])
    out_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{name}.parquet")
    return {"split": name, "seed": seed, "entity_seed": entity_seed, "entities": len(ents),
            "kinds": dict(sorted(Counter(q["kind"] for q in qs).items())),
            "templates": len({q["template"] for q in qs}), "dropped_candidates": dict(sorted(dropped.items())),
            "corpus": str(corpus), "corpus_docs": len(read_jsonl(corpus))}


def main(argv: list[str] | None = None) -> None:
    from verl_arpo.trainer.sft_data import SYSTEM_PROMPT
    from verl_arpo.workers.rollout.tools import ToolExecutor

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--tools", default=str(DEFAULT_TOOLS), help="tool YAML the solver runs (python + search)")
    p.add_argument("--fresh", metavar="NAME", default=None,
                   help="write only NAME.parquet: a fresh split about a new world of entities (--entity_seed), "
                        "its documents appended to --corpus")
    p.add_argument("--entity_seed", type=int, default=None, help="--fresh: the new world's seed")
    p.add_argument("--per_kind", type=int, default=200, help="--fresh: questions per kind")
    p.add_argument("--corpus", type=Path, default=FRESH_CORPUS, help="--fresh: the corpus the new world joins")
    args = p.parse_args(argv)
    if args.fresh:
        if args.entity_seed is None:
            p.error("--fresh needs --entity_seed (the new world's seed; make_corpus's bundled world is seed 0)")
        print(json.dumps(make_fresh_split(args.fresh, args.seed, args.entity_seed, args.per_kind, args.out,
                                          args.corpus), indent=1))
        return
    with ToolExecutor.from_config(args.tools) as executor:
        missing = {"python", "search"} - set(executor.tools)
        if missing:
            raise SystemExit(f"{args.tools}: the solver needs the tools {sorted(missing)}")
        splits, dropped = make_questions(args.seed, executor)
    stats = write_outputs(splits, args.out, SYSTEM_PROMPT)
    stats["dropped_candidates"] = dict(sorted(dropped.items()))
    print(json.dumps(stats, indent=1))
    print(f"wrote {', '.join(f'{s}.parquet' for s in SPLITS)} and sft_train.jsonl to {args.out}")


if __name__ == "__main__":
    main()

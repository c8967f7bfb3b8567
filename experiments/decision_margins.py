"""How near a tie a model's tool decisions sit, per question, and which questions a trained model flipped.

An RL run that starts from an SFT model moves a decision token a little for a whole task type; under
greedy evaluation every question whose SFT margin at that token was small then flips at once
(docs/reports/2026-11-26-quickstart-rl-gain-across-seeds.md, "Why a run flips a whole class of
questions"). This probe measures those margins
on the test split, from next-token probabilities of the model (one forward pass per question and
decision, fp32, no sampling):

- the first decision, P(search first) = the sum over `--first_choice` of P(choice | prompt +
  `--first_prefix`): the prefix is where the model's greedy openings split by tool (the SFT model of
  12 steps opens `<think> I will` and then " search" / " look" up, or " calculate" / " compute" /
  " use" Python; the one of 24 steps opens `<think> Let me` with the same verbs), the choices are
  the words that open a search;
- the decision after the first tool result, P(answer now) = P(` <answer`) / (P(` <answer`) + P(` <think`))
  after the model's own greedy text up to its first `</result>` (from `--own_eval`, the model's
  main_eval report): answer now (right for a lookup) or think on towards another call.

A choice that is several tokens long is scored as the product of its tokens' conditional
probabilities. With `--trained NAME=EVAL.json` (main_eval reports of models trained from this one),
it counts per task type and per band of the first decision's probability how many questions each
trained model opened with another tool than this model's own greedy answer did, and how many it
turned right → wrong and wrong → right.

    python experiments/decision_margins.py --model outputs/compare/sft_model \\
        --own_eval outputs/compare/eval_sft.json --trained arpo_pair0=outputs/compare/runs/arpo_pair0/eval.json

Prints the tables and writes JSON (`--out`, default experiments/results/decision_margins.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import machine_info, print_table, write_json  # noqa: E402

BANDS = (0.0, 0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95, 1.0)
RESULT_END = "</result>"


def band_of(p: float, edges: tuple[float, ...] = BANDS) -> str:
    """The band [lo, hi) holding p (the last band is closed: 1.0 falls in it)."""
    for lo, hi in zip(edges[:-1], edges[1:]):
        if lo <= p < hi or (hi == edges[-1] and p == hi):
            return f"{lo:.2f}-{hi:.2f}"
    raise ValueError(f"probability {p} outside [{edges[0]}, {edges[-1]}]")


class ChoiceScorer:
    """P(choice | prefix) for a causal LM: the product over the choice's tokens of their conditional
    probabilities, from one forward pass over prefix + choice. A token prefix shared by every prompt
    (the system prompt) is encoded once (`share`) and its KV cache copied for each pass."""

    def __init__(self, model_dir: str | Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from verl_arpo.workers.rollout.engines.hf_engine import kv_cache_arg

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.cache_arg = kv_cache_arg(self.model)
        self.shared: list[int] = []
        self.cache = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def share(self, ids: list[int]) -> None:
        """Encode `ids` once; every later prefix that starts with them reuses their KV cache."""
        self.shared, self.cache = list(ids), None
        if ids:
            with self.torch.no_grad():
                self.cache = getattr(self.model(self.torch.tensor([ids]), use_cache=True), self.cache_arg)

    def probs(self, prefix: str, choices: list[str]) -> list[float]:
        """One probability per choice. The prefix and each choice are tokenized apart, as the
        decision is taken at the token boundary where the prefix ends. The prefix runs once; a
        choice of several tokens runs its tokens but the last on a copy of the prefix's cache."""
        import copy

        torch = self.torch
        pre = self.encode(prefix)
        n = len(self.shared) if self.cache is not None and pre[:len(self.shared)] == self.shared else 0
        if n == len(pre):
            n = 0  # no token left to run after the shared ones: no cache
        with torch.no_grad():
            out = self.model(torch.tensor([pre[n:]]), use_cache=True,
                             **{self.cache_arg: copy.deepcopy(self.cache) if n else None})
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        probs = []
        for choice in choices:
            ids = self.encode(choice)
            if not ids:
                raise ValueError(f"choice {choice!r} encodes to no token")
            logp = first[ids[0]]
            if len(ids) > 1:
                with torch.no_grad():
                    past = copy.deepcopy(getattr(out, self.cache_arg))
                    rest = self.model(torch.tensor([ids[:-1]]), **{self.cache_arg: past}).logits
                logp = logp + torch.log_softmax(rest[0].float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).sum()
            probs.append(float(torch.exp(logp)))
        return probs


def common_prefix(seqs: list[list[int]]) -> list[int]:
    """The longest token prefix of all sequences, one token short of the shortest (each keeps a token to run)."""
    if not seqs:
        return []
    n = min(map(len, seqs)) - 1
    first = seqs[0]
    for s in seqs[1:]:
        n = next((i for i in range(n) if s[i] != first[i]), n)
    return first[:max(n, 0)]


def first_tool(sample: dict) -> str | None:
    tags = sample.get("tool_tags") or []
    return tags[0] if tags else None


def load_report(path: str | Path) -> dict[int, dict]:
    """A main_eval report's samples by question index (its first sample: the greedy answer)."""
    report = json.loads(Path(path).read_text())
    if "samples" not in report:
        raise ValueError(f"{path}: no 'samples' (write the report with main_eval's --output_file)")
    return {int(s["index"]): {**s["samples"][0], "data_source": s["data_source"], "question": s["question"]}
            for s in report["samples"]}


def probe(scorer: ChoiceScorer, rows: list[dict], own: dict[int, dict] | None, first_prefix: str,
          first_choices: list[str], template_kwargs: dict | None = None) -> list[dict]:
    """Per question: its task type, P(first choice) and, where its own greedy text has a tool
    result, P(answer now) after it."""
    from verl_arpo.utils.chat_template import render_chat

    prompts = [render_chat(scorer.tokenizer, row["messages"], True, template_kwargs) for row in rows]
    scorer.share(common_prefix([scorer.encode(p) for p in prompts]))
    out = []
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        rec = {"index": i, "data_source": row["data_source"],
               "p_first": sum(scorer.probs(prompt + first_prefix, first_choices)), "p_answer_now": None}
        mine = (own or {}).get(i)
        if mine is not None:
            if mine["question"] != row["question"]:
                raise ValueError(f"own_eval's question {i} is {mine['question']!r}, "
                                 f"the test split's {row['question']!r}: "
                                 "give the report of this test split")
            rec["first_tool"] = first_tool(mine)
            rec["opening"] = " ".join(mine["text"].split()[:3])  # where its greedy openings split: --first_prefix
            rec["correct"] = bool(mine["correct"])
            if RESULT_END in mine["text"]:
                head = mine["text"].split(RESULT_END)[0] + RESULT_END
                pa, pt = scorer.probs(prompt + head, [" <answer", " <think"])
                rec["p_answer_now"] = pa / (pa + pt)
        out.append(rec)
    return out


def margin_table(recs: list[dict]) -> list[dict]:
    rows = []
    for src in sorted({r["data_source"] for r in recs}):
        mine = [r for r in recs if r["data_source"] == src]
        pf = [r["p_first"] for r in mine]
        pa = [r["p_answer_now"] for r in mine if r["p_answer_now"] is not None]
        rows.append({"data_source": src, "questions": len(mine), "p_first_median": statistics.median(pf),
                     "p_first_in_0.2_0.8": sum(0.2 <= p <= 0.8 for p in pf) / len(pf),
                     "p_answer_now_median": statistics.median(pa) if pa else None,
                     "p_answer_now_in_0.2_0.8": sum(0.2 <= p <= 0.8 for p in pa) / len(pa) if pa else None,
                     "with_a_result": len(pa)})
        openings = Counter(r["opening"] for r in mine if "opening" in r)
        if openings:
            text, n = openings.most_common(1)[0]
            rows[-1]["greedy_opening"] = f"{text!r} {n / len(mine):.0%}"
    return rows


def flip_table(recs: list[dict], trained: dict[str, dict[int, dict]]) -> list[dict]:
    """Per task type × band of p_first: questions, and for each trained model how many opened with
    another tool than this model did, turned right → wrong, and wrong → right."""
    rows = []
    for src in sorted({r["data_source"] for r in recs}):
        for band in sorted({band_of(r["p_first"]) for r in recs if r["data_source"] == src}):
            cell = [r for r in recs if r["data_source"] == src and band_of(r["p_first"]) == band]
            row = {"data_source": src, "p_first_band": band, "questions": len(cell)}
            for name, rep in trained.items():
                other = [rep[r["index"]] for r in cell]
                row[f"{name}:other_first_tool"] = sum(first_tool(o) != r["first_tool"] for o, r in zip(other, cell))
                row[f"{name}:right_to_wrong"] = sum(r["correct"] and not o["correct"] for o, r in zip(other, cell))
                row[f"{name}:wrong_to_right"] = sum(o["correct"] and not r["correct"] for o, r in zip(other, cell))
            rows.append(row)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model whose margins are measured (Hugging Face directory)")
    p.add_argument("--test_file", default=str(ROOT / "rl_datasets" / "test.parquet"))
    p.add_argument("--own_eval", default=None, help="this model's main_eval report on --test_file (its greedy texts)")
    p.add_argument("--trained", action="append", default=[], metavar="NAME=EVAL.json",
                   help="a trained model's main_eval report on --test_file; repeatable")
    p.add_argument("--first_prefix", default="<think> I will")
    p.add_argument("--first_choice", action="append", default=None,
                   help="a word that opens a search after --first_prefix; repeatable (default: ' search', ' look')")
    p.add_argument("--limit", type=int, default=None, help="the first N test questions only")
    # the prompt as main_eval renders it (the same two flags): a model whose template takes arguments
    # (Qwen3's enable_thinking) would otherwise be probed on another prompt than it was evaluated on
    p.add_argument("--chat_template_kwargs", type=json.loads, default={},
                   help='JSON of extra apply_chat_template arguments, as given to main_eval')
    p.add_argument("--custom_chat_template", default=None,
                   help="a Jinja chat template, or a file with one, as given to main_eval")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "decision_margins.json"))
    a = p.parse_args(argv)
    a.first_choice = a.first_choice or [" search", " look"]
    if a.trained and not a.own_eval:
        p.error("--trained needs --own_eval: flips are counted against this model's own greedy answers")
    for spec in a.trained:
        if "=" not in spec:
            p.error(f"--trained {spec!r}: write NAME=PATH/TO/eval.json")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    from verl_arpo.trainer.main_eval import load_eval_rows

    rows = load_eval_rows(a.test_file)[: a.limit]
    own = load_report(a.own_eval) if a.own_eval else None
    trained = {}
    for spec in a.trained:
        name, path = spec.split("=", 1)
        trained[name] = load_report(path)
        missing = [i for i in range(len(rows)) if i not in trained[name]]
        if missing:
            raise SystemExit(f"--trained {name}: the report lacks {len(missing)} of the {len(rows)} questions "
                             f"(first: {missing[0]}); evaluate it on the same --test_file")
    scorer = ChoiceScorer(a.model)
    from verl_arpo.utils.chat_template import configure_chat_template

    configure_chat_template(scorer.tokenizer, a.custom_chat_template)
    recs = probe(scorer, rows, own, a.first_prefix, a.first_choice, a.chat_template_kwargs)
    margins = margin_table(recs)
    print_table(margins, list(margins[0]), f"decision margins of {a.model} ({len(recs)} questions)")
    flips = flip_table(recs, trained) if own else []
    if flips:
        print_table(flips, list(flips[0]),
                    "flips against this model's own greedy answers, by band of the first decision")
    payload = {"model": str(a.model), "test_file": a.test_file, "first_prefix": a.first_prefix,
               "first_choice": a.first_choice, "shared_prefix_tokens": len(scorer.shared),
               "own_eval": a.own_eval, "trained": a.trained, "chat_template_kwargs": a.chat_template_kwargs,
               "custom_chat_template": a.custom_chat_template,
               "machine": machine_info(), "margins": margins, "flips": flips, "questions": recs}
    write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    main()

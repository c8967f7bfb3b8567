"""Evaluate a model with multi-turn tool inference: pass@1, pass@k, accuracy, tool calls per question.

    python -m verl_arpo.trainer.main_eval --model <hf dir> --data rl_datasets/test.parquet --out eval.json
    python -m verl_arpo.trainer.main_eval --model <hf dir> --data data/gaia/test.jsonl --k 4 \\
        --tools configs/tools/python_search_local.yaml --out gaia.json
    python -m verl_arpo.trainer.main_eval ... --judge_url http://127.0.0.1:8001 --judge_model Qwen2.5-72B-Instruct \\
        --judge_api_key_env JUDGE_API_KEY

Data: our parquet files (verl schema or the flat docs schema, see utils/dataset/schema.py) or JSONL
benchmark files as the reference keeps them, `data/<benchmark>/test.jsonl`, one object per line
with a question (`question`, GAIA's `Question`, `problem`, `query`) and an answer (`answer`,
GAIA's `Final answer`, `final_answer`, `answers`, `golden_answers`, `ground_truth`; a list means
"any of these"). A JSONL row's data source is its `data_source` field, else `--data_source`, else
the benchmark folder name (`data/gaia/test.jsonl` → `gaia`), else the file stem. JSONL questions get
the bundled task's system prompt (`--system_prompt` replaces it, `--system_prompt ''` drops it).

Inference: `AgentLoop` (docs/algorithms.md, "ARPO: entropy-based adaptive rollout") on the HF engine (default) or vLLM (`--engine vllm`,
imported only then), with the tools of `--tools` (`none` for plain generation). k = 1 is greedy
(the loop's validation mode); k > 1 draws k independent samples per question at `--temperature`,
seeded by `--seed` (no ARPO branching at evaluation).

Scoring: `default_compute_score` for the row's data source, or `--reward_fn path.py:name`. A sample
is correct by rule when its F1 (deep_research) or else its score reaches `--correct_threshold`
(default 1.0: exact match after normalisation). With `--judge_url`, every sample the rule calls
wrong is also shown to an LLM judge (OpenAI-compatible `POST /v1/chat/completions`, asked for a
yes/no equivalence verdict); correct = rule OR judge. The API key is read from the environment
variable named by `--judge_api_key_env` and is never logged or written.

Metrics per data source and overall, over questions:
- pass@1 = mean over questions of c/n (n samples, c correct);
- pass@k = mean over questions of the unbiased estimator 1 − C(n−c, k)/C(n, k) (Chen et al., 2021);
- accuracy = pass@1 with a 95% Wilson interval, taking the number of questions as the trial count
  (exact for k = 1; for k > 1 it treats each question's mean as one trial, a slight under-statement
  of the spread across samples);
- tool calls per question (mean over samples) and per tag; mean reward score; finish reasons.

Not covered: the reference's separate "summarisation model" for web pages and its per-benchmark
prompt templates; multimodal GAIA attachments (the question text is used as is).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np

from verl_arpo.utils.stats import pass_at_k, wilson_interval  # noqa: F401  (re-exported: main_eval's names)
from verl_arpo.utils.chat_template import configure_chat_template, render_chat
from verl_arpo.config import ROLLOUT_MODES
from verl_arpo.trainer.eval_workers import call_starts, generate_in_workers, parse_shard, write_shard

logger = logging.getLogger("verl_arpo.eval")

QUESTION_KEYS = ("question", "Question", "problem", "query", "input")
ANSWER_KEYS = ("answer", "Final answer", "final_answer", "answers", "golden_answers", "ground_truth",
               "gold", "target")


# --------------------------------------------------------------------------- data
def _first(record: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in record and record[key] is not None:
            return record[key]
    return None


def _benchmark_name(path: Path) -> str:
    return path.parent.name if path.stem in ("test", "dev", "valid", "validation", "train") else path.stem


def _jsonl_rows(path: Path, system_prompt: str | None, data_source: str | None) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    records = json.loads(text) if path.suffix == ".json" else [json.loads(l) for l in text.splitlines() if l.strip()]
    rows = []
    for i, rec in enumerate(records):
        question = _first(rec, QUESTION_KEYS)
        answer = _first(rec, ANSWER_KEYS)
        if not isinstance(question, str) or not question.strip() or answer is None:
            raise ValueError(f"{path}: record {i} needs a question ({'/'.join(QUESTION_KEYS)}) and an answer "
                             f"({'/'.join(ANSWER_KEYS)}); keys are {sorted(rec)}")
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
            [{"role": "user", "content": question}]
        rows.append({"messages": messages, "question": question,
                     "data_source": rec.get("data_source") or data_source or _benchmark_name(path),
                     "ground_truth": answer, "extra_info": {"index": i, "source_file": str(path)}})
    return rows


def _parquet_rows(path: Path, system_prompt_override: str | None, data_source: str | None) -> list[dict]:
    import pyarrow.parquet as pq

    from verl_arpo.utils.dataset.schema import apply_system_prompt, normalize_row, repair_backspace

    rows = []
    for i, raw in enumerate(pq.read_table(path).to_pylist()):
        row, err = normalize_row(raw)
        if err is not None:
            raise ValueError(f"{path}: row {i}: field {err[0]!r} {err[1]}")
        messages = row["messages"]
        if system_prompt_override is not None:
            messages = apply_system_prompt(messages, system_prompt_override) if system_prompt_override else \
                [m for m in messages if m["role"] != "system"]
        messages = [dict(m, content=repair_backspace(m["content"])[0]) for m in messages]
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        rows.append({"messages": messages, "question": question,
                     "data_source": data_source or row["data_source"],
                     "ground_truth": row["reward_model"]["ground_truth"],
                     "extra_info": dict(row["extra_info"], index=row["extra_info"].get("index", i))})
    return rows


def load_eval_rows(path: str | Path, system_prompt: str | None = None, data_source: str | None = None) -> list[dict]:
    """Rows {messages, question, data_source, ground_truth, extra_info} from parquet or JSON(L).

    system_prompt: None = keep a parquet's own system message (JSONL: use the bundled task's);
    "" = no system message; other text = replace / insert it."""
    from verl_arpo.trainer.sft_data import SYSTEM_PROMPT

    path = Path(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path, system_prompt, data_source)
    return _jsonl_rows(path, SYSTEM_PROMPT if system_prompt is None else system_prompt, data_source)


# --------------------------------------------------------------------------- LLM judge
JUDGE_SYSTEM = ("You grade answers. Given a question, a reference answer and a predicted answer, decide "
                "whether the predicted answer means the same as the reference. Reply with one word: yes or no.")


class LLMJudge:
    """Yes/no equivalence verdicts from an OpenAI-compatible chat-completions server."""

    def __init__(self, base_url: str, model: str, api_key_env: str | None = None, timeout: float = 60.0,
                 retries: int = 2, max_tokens: int = 8):
        url = base_url.rstrip("/")
        if not url.endswith("/chat/completions"):
            url = (url if url.endswith("/v1") else url + "/v1") + "/chat/completions"
        self.url, self.model, self.timeout, self.retries, self.max_tokens = url, model, timeout, retries, max_tokens
        self._key = os.environ.get(api_key_env, "") if api_key_env else ""
        self.stats = Counter()

    def __repr__(self) -> str:  # never shows the key
        return f"LLMJudge(url={self.url!r}, model={self.model!r}, key={'set' if self._key else 'none'})"

    def verdict(self, question: str, reference: Any, prediction: str) -> bool | None:
        """True / False, or None when the server fails or answers neither yes nor no."""
        import requests

        refs = reference if isinstance(reference, list) else [reference]
        user = (f"Question: {question}\nReference answer: {' | '.join(map(str, refs))}\n"
                f"Predicted answer: {prediction}\nDoes the predicted answer match the reference? yes or no.")
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]}
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        self.stats["calls"] += 1
        for attempt in range(self.retries + 1):
            try:
                resp = requests.post(self.url, json=body, headers=headers, timeout=self.timeout)
                if resp.status_code in (429, 500, 502, 503, 504) and attempt < self.retries:
                    time.sleep(0.5 * 2 ** attempt)
                    continue
                if resp.status_code != 200:
                    logger.warning("judge: HTTP %d from %s", resp.status_code, self.url)
                    break
                text = str(resp.json()["choices"][0]["message"]["content"]).strip().lower()
            except Exception as exc:  # noqa: BLE001 - the message never contains the headers
                if attempt < self.retries:
                    time.sleep(0.5 * 2 ** attempt)
                    continue
                logger.warning("judge: %s calling %s", type(exc).__name__, self.url)
                break
            word = text.lstrip("*\"' ").split()[0].strip(".,!*\"'") if text.split() else ""
            if word in ("yes", "no"):
                self.stats[word] += 1
                return word == "yes"
            self.stats["unparsed"] += 1
            return None
        self.stats["errors"] += 1
        return None


# --------------------------------------------------------------------------- scoring
def load_reward_fn(spec: str | None) -> Callable[..., Any]:
    """`path.py:name` → that function; None → default_compute_score."""
    if not spec:
        from verl_arpo.utils.reward_score import default_compute_score

        return default_compute_score
    from verl_arpo.utils.reward_score.custom import load_custom_reward_function

    path, _, name = spec.rpartition(":") if ":" in spec else (spec, "", "compute_score")
    return load_custom_reward_function(path, name or "compute_score")


def rule_result(result: Any, threshold: float) -> tuple[float, bool, str | None]:
    """(score, correct, extracted answer) from a scorer's dict or float."""
    if isinstance(result, dict):
        score = float(result.get("score", 0.0))
        value = float(result["f1"]) if "f1" in result else score
        answer = result.get("answer")
        return score, value >= threshold - 1e-9, (str(answer) if answer not in (None, "") else None)
    score = float(result)
    return score, score >= threshold - 1e-9, None


# --------------------------------------------------------------------------- inference
def _prompt_batch(tokenizer, rows: list[dict], uid_offset: int, template_kwargs: dict | None = None,
                  tools: list[dict] | None = None):
    import torch

    from verl_arpo.protocol import DataProto, as_object_array

    encoded = [render_chat(tokenizer, r["messages"], True, template_kwargs, tools=tools) for r in rows]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in encoded]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=torch.long)
    uids = as_object_array([f"q{uid_offset + i}" for i in range(len(rows))])
    non_tensors = {"uid": uids}
    if tools:   # the hermes format's sanity check renders the messages again
        non_tensors["raw_prompt"] = as_object_array([[dict(m) for m in r["messages"]] for r in rows])
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask}, non_tensors=non_tensors)


def generate(loop, tokenizer, rows: list[dict], k: int, batch_size: int,
             template_kwargs: dict | None = None, starts: list[int] | None = None) -> list[list[dict]]:
    """k trajectories per row: [{text, num_tool_calls, tool_tags, finish_reason}] per row. In the
    hermes format `text` is the final assistant turn (what is scored, as in training) and
    `tool_tags` the function names. `starts`: only the calls of `batch_size` questions that begin
    there (an evaluation worker's share, trainer/eval_workers.py); their rows' samples, in order."""
    from verl_arpo.workers.reward_manager import final_turn_start

    hermes = getattr(getattr(loop, "format", None), "name", "tags") == "hermes"
    tools = loop.format.schemas if hermes else None
    out: list[list[dict]] = []
    for start in (range(0, len(rows), batch_size) if starts is None else starts):
        chunk = rows[start:start + batch_size]
        prompts = _prompt_batch(tokenizer, chunk, start, template_kwargs, tools)
        prompts.meta_info = {"validate": True} if k == 1 else {"validate": False, "n": k, "do_sample": True}
        prompts.meta_info["global_steps"] = start // batch_size  # a fresh, reproducible seed per chunk
        res = loop.generate_sequences(prompts)
        R = res.batch["responses"].shape[-1]
        lengths = res.batch["attention_mask"][:, -R:].sum(-1).tolist()
        first = [final_turn_start(res.batch["response_mask"][j, :L].tolist()) if hermes else 0
                 for j, L in enumerate(lengths)]
        texts = [tokenizer.decode(res.batch["responses"][j, first[j]:L].tolist(), skip_special_tokens=True)
                 for j, L in enumerate(lengths)]
        nt = res.non_tensor_batch
        for i in range(len(chunk)):
            samples = []
            for j in range(i * k, (i + 1) * k):
                calls = list(nt["tool_calls"][j])
                samples.append({"text": texts[j], "num_tool_calls": int(nt["num_tool_calls"][j]),
                                "tool_tags": [c.get("name", c["tag"]) for c in calls], "finish_reason": str(nt["finish_reason"][j]),
                                "response_tokens": int(lengths[j])})
            out.append(samples)
        logger.info("generated %d/%d questions", min(start + batch_size, len(rows)), len(rows))
    return out


def score_samples(rows: list[dict], generations: list[list[dict]], reward_fn, threshold: float,
                  judge: LLMJudge | None = None, score_timeout: float | None = 600.0) -> None:
    """Add score / rule_correct / judge / correct to every sample (in place).

    Scoring runs in the reward manager's worker processes (workers/reward_manager.py): a scorer stuck
    past `score_timeout` seconds, even in C code, is killed and the evaluation ends naming the
    sample. A scorer's exception scores that sample 0; a NaN or infinite score too, counted."""
    from verl_arpo.workers.reward_manager import NaiveRewardManager
    from verl_arpo.utils.reward_score.custom import TolerantScore

    pairs = [(row, s) for row, samples in zip(rows, generations) for s in samples]
    items = [(i, row["data_source"], s["text"], row["ground_truth"], row["extra_info"])
             for i, (row, s) in enumerate(pairs)]
    manager = NaiveRewardManager(None, compute_score=TolerantScore(reward_fn), score_timeout=score_timeout)
    try:
        results = manager.score_all(items)
    finally:
        manager.close()
    non_finite = 0
    for (_, s), result in zip(pairs, results):
        raw = result.get("score", 0.0) if isinstance(result, dict) else result
        if not math.isfinite(float(raw)):
            non_finite += 1
            result = {"score": 0.0, "reason": "non-finite score"}
        s["score"], s["rule_correct"], s["answer"] = rule_result(result, threshold)
    if non_finite:
        logger.warning("%d sample(s) scored NaN or infinite: counted as score 0", non_finite)
    for row, samples in zip(rows, generations):
        for s in samples:
            s["judge"] = None
            if judge is not None and not s["rule_correct"]:
                prediction = s["answer"] if s["answer"] is not None else s["text"][-500:]
                s["judge"] = judge.verdict(row["question"], row["ground_truth"], prediction)
            s["correct"] = bool(s["rule_correct"] or s["judge"])


def _metrics(rows: list[dict], generations: list[list[dict]], k: int) -> dict[str, Any]:
    n_q = len(rows)
    if n_q == 0:
        return {"n_questions": 0}
    per_q_c = [sum(s["correct"] for s in g) for g in generations]
    per_q_rule = [sum(s["rule_correct"] for s in g) for g in generations]
    pass1 = float(np.mean([c / len(g) for c, g in zip(per_q_c, generations)]))
    samples = [s for g in generations for s in g]
    tags = Counter(t for s in samples for t in s["tool_tags"])
    m: dict[str, Any] = {
        "n_questions": n_q, "samples_per_question": k,
        "pass@1": pass1,
        f"pass@{k}": float(np.mean([pass_at_k(len(g), c, k) for c, g in zip(per_q_c, generations)])),
        "rule_pass@1": float(np.mean([c / len(g) for c, g in zip(per_q_rule, generations)])),
        "accuracy": pass1, "accuracy_ci95": list(wilson_interval(pass1, n_q)),
        "mean_score": float(np.mean([s["score"] for s in samples])),
        "tool_calls_per_question": float(np.mean([s["num_tool_calls"] for s in samples])),
        "tool_calls_per_question_by_tag": {t: c / len(samples) for t, c in sorted(tags.items())},
        "with_answer": float(np.mean([s["answer"] is not None for s in samples])),
        "response_tokens_mean": float(np.mean([s["response_tokens"] for s in samples])),
        "finish_reasons": dict(Counter(s["finish_reason"] for s in samples)),
    }
    if any(s["judge"] is not None for s in samples):
        m["judge_yes_on_rule_wrong"] = sum(bool(s["judge"]) for s in samples)
    return m


def summarize(rows: list[dict], generations: list[list[dict]], k: int) -> dict[str, Any]:
    """{"overall": metrics, "per_data_source": {source: metrics}}."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[str(row["data_source"])].append(i)
    per = {ds: _metrics([rows[i] for i in idx], [generations[i] for i in idx], k) for ds, idx in sorted(groups.items())}
    return {"overall": _metrics(rows, generations, k), "per_data_source": per}


# --------------------------------------------------------------------------- entry point
def _resolve(path: str) -> str:
    from verl_arpo.utils.resources import resolve_bundled

    return str(resolve_bundled(path))


def build_loop(args, tokenizer, engine=None):
    """AgentLoop over the engine of `--engine` (or the one given) and the tools of `--tools`."""
    import dataclasses

    from verl_arpo.config import MultiTurnConfig, RolloutSection
    from verl_arpo.workers.rollout import build_agent_loop
    from verl_arpo.workers.rollout.engines import build_engine
    from verl_arpo.workers.rollout.tools import ToolExecutor

    if engine is None:   # before the tools: bm25s loads numba, which breaks a vLLM 0.32 engine started after it
        kwargs = {"dtype": args.dtype, "seed": args.seed}
        if args.engine == "hf":
            kwargs["max_batch_size"] = args.max_batch_size
        engine = build_engine(args.engine, os.path.expanduser(args.model), tokenizer, **kwargs)
    executor = None if str(args.tools).lower() in ("none", "") else ToolExecutor.from_config(_resolve(args.tools))
    call_limit = args.call_limit if args.call_limit is not None else (executor.call_limit if executor else 0)
    # the YAML's rollout section with this command's sampling (the initial_rollouts default: no branching)
    fmt = getattr(args, "format", "tags")
    cfg = dataclasses.replace(RolloutSection(), n=args.k, response_length=args.max_response_length,
                              temperature=args.temperature, top_p=args.top_p, entropy_topk=1,
                              multi_turn=MultiTurnConfig(format=fmt))
    return build_agent_loop(args.rollout_mode, engine, tokenizer, executor, cfg, call_limit=call_limit,
                            seed=args.seed, chat_template_kwargs=getattr(args, "chat_template_kwargs", None)), executor


def run_eval(args, engine=None, tokenizer=None) -> dict[str, Any]:
    """Load data, generate, score, summarise; write `args.out` when set; return the report."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.model))
    configure_chat_template(tokenizer, getattr(args, "custom_chat_template", None))
    rows = load_eval_rows(_resolve(args.data), args.system_prompt, args.data_source)
    if args.limit:
        rows = rows[:args.limit]
    reward_fn = load_reward_fn(args.reward_fn)
    if not args.reward_fn:  # fail before generating when a data source has no built-in scorer
        from verl_arpo.utils.reward_score import get_scorer

        for ds in sorted({str(r["data_source"]) for r in rows}):
            get_scorer(ds)
    judge = LLMJudge(args.judge_url, args.judge_model, args.judge_api_key_env) if args.judge_url else None
    shard = parse_shard(args.shard) if getattr(args, "shard", None) else None
    workers = min(getattr(args, "workers", 1), len(call_starts(len(rows), args.batch_size)))
    t0 = time.time()
    if shard is None and workers > 1:   # the calls spread over worker processes (eval_workers.py)
        if engine is not None or getattr(args, "argv", None) is None:
            raise SystemExit("--workers > 1 starts worker processes from the command line's arguments: "
                             "run main_eval's main(argv), not run_eval with an engine")
        generations = generate_in_workers(args.argv, len(rows), args.batch_size, workers, args.engine)
    else:
        starts = call_starts(len(rows), args.batch_size, *shard) if shard else None
        loop, executor = build_loop(args, tokenizer, engine)
        try:
            generations = generate(loop, tokenizer, rows, args.k, args.batch_size,
                                   getattr(args, "chat_template_kwargs", None), starts)
        finally:
            if executor is not None:
                executor.close()
        if shard is not None:   # a worker: its calls' samples go to the parent, which scores them all
            write_shard(args.generations_out, starts, generations, args.batch_size)
            return {"shard": args.shard, "questions": len(generations)}
    seconds = time.time() - t0
    score_samples(rows, generations, reward_fn, args.correct_threshold, judge, score_timeout=args.score_timeout)
    report = {"model": args.model, "data": args.data, "k": args.k, "engine": args.engine, "tools": args.tools,
              "format": getattr(args, "format", "tags"),
              "sampling": {"greedy": args.k == 1, "temperature": None if args.k == 1 else args.temperature,
                           "top_p": None if args.k == 1 else args.top_p, "seed": args.seed,
                           "max_response_length": args.max_response_length},
              "reward_fn": args.reward_fn or "default_compute_score", "correct_threshold": args.correct_threshold,
              "generation_seconds": round(seconds, 2), **summarize(rows, generations, args.k)}
    if judge is not None:
        report["judge"] = {"url": judge.url, "model": judge.model, **dict(judge.stats)}
    if args.save_samples:
        report["samples"] = [{"index": r["extra_info"].get("index", i), "data_source": r["data_source"],
                              "question": r["question"], "ground_truth": r["ground_truth"], "samples": g}
                             for i, (r, g) in enumerate(zip(rows, generations))]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False, default=str) + "\n")
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--data", required=True, help="parquet, or JSON(L) such as data/<benchmark>/test.jsonl")
    p.add_argument("--out", default=None, help="report JSON path")
    p.add_argument("--k", type=int, default=1, help="samples per question (1 = greedy)")
    p.add_argument("--tools", default="configs/tools/python_search_local.yaml", help="tool YAML, or 'none'")
    p.add_argument("--format", choices=["tags", "hermes"], default="tags",
                   help="tool-call format (actor_rollout_ref.rollout.multi_turn.format): the reference's tags, or "
                        "the chat template's function calling (prompts rendered with the tools' schemas)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--rollout_mode", choices=ROLLOUT_MODES, default="sync_with_tool",
                   help="rounds with barriers, or none (tools overlap generation): rollout.mode")
    p.add_argument("--dtype", default="float32", help="engine dtype: float32 | bfloat16 (vllm: also auto)")
    p.add_argument("--max_response_length", type=int, default=1024, help="generated + tool-result tokens")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature when k > 1")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--call_limit", type=int, default=None, help="tool calls per trajectory (default: the tool YAML's)")
    p.add_argument("--batch_size", type=int, default=8, help="questions per generation call")
    p.add_argument("--max_batch_size", type=int, default=64, help="HF engine: rows decoded together")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N questions")
    p.add_argument("--workers", type=int, default=1,
                   help="processes generating at once, each on whole calls of --batch_size questions, the CPU "
                        "cores (or GPUs) split between them (docs/performance.md, 'The evaluation in two processes')")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)            # i/N: set for a worker by --workers
    p.add_argument("--generations_out", default=None, help=argparse.SUPPRESS)  # where that worker writes
    p.add_argument("--data_source", default=None, help="override every row's data source (scorer choice)")
    p.add_argument("--system_prompt", default=None, help="replace the system prompt ('' = none)")
    p.add_argument("--chat_template_kwargs", type=json.loads, default={},
                   help='JSON of extra apply_chat_template arguments (data.apply_chat_template_kwargs), '
                        'e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--custom_chat_template", default=None,
                   help="a Jinja chat template, or a file with one (data.custom_chat_template)")
    p.add_argument("--reward_fn", default=None, help="path.py:function with verl's compute_score signature")
    p.add_argument("--correct_threshold", type=float, default=1.0, help="F1 (or score) counted as correct")
    p.add_argument("--score_timeout", type=float, default=600.0,
                   help="seconds the scoring may take (reward_model.score_timeout; 0 = no limit)")
    p.add_argument("--judge_url", default=None, help="OpenAI-compatible base URL of an LLM judge")
    p.add_argument("--judge_model", default="judge", help="model name sent to the judge")
    p.add_argument("--judge_api_key_env", default=None, help="environment variable holding the judge's API key")
    p.add_argument("--no_samples", dest="save_samples", action="store_false", help="omit per-sample texts")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from verl_arpo.utils.threads import cpu_process_env

    # before torch loads: how threads wait, MKL's code path (utils/threads.py)
    os.environ.update(cpu_process_env())
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # what --workers starts its workers with
    if args.k < 1:
        raise SystemExit("--k must be >= 1")
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers}: must be >= 1")
    if bool(args.shard) != bool(args.generations_out):
        raise SystemExit("--shard and --generations_out go together (set by --workers for its worker processes)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = run_eval(args)
    if args.shard:
        return report
    for ds, m in [*report["per_data_source"].items(), ("overall", report["overall"])]:
        ci = m["accuracy_ci95"]
        passk = f" pass@{args.k}={m[f'pass@{args.k}']:.3f}" if args.k > 1 else ""
        print(f"{ds:28s} n={m['n_questions']:4d} pass@1={m['pass@1']:.3f}{passk} "
              f"acc95=[{ci[0]:.3f}, {ci[1]:.3f}] tools/q={m['tool_calls_per_question']:.2f}")
    return report


if __name__ == "__main__":
    main()

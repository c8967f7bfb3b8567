"""ARPO vs GRPO vs AEPO at equal n: tool executions per trajectory, generated tokens per trajectory
token, rollout seconds, reward — same prompts, same model, same tools, one run.

Branches share their prefix (tokens and the tool calls in it), so ARPO needs fewer tool executions
and generates fewer tokens per trajectory token than GRPO's n independent samples (the ARPO paper
reports about half the tool calls). GRPO is the baseline measured in the same run.

    python benchmarks/bench_branching.py                      # tool-calling tiny model (built on the fly)
    python benchmarks/bench_branching.py --model <hf dir> --data rl_datasets/test.parquet --prompts 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verl_arpo.protocol import DataProto, as_object_array  # noqa: E402
from verl_arpo.utils.reward_score import default_compute_score  # noqa: E402
from verl_arpo.config import RolloutSection, from_mapping  # noqa: E402
from verl_arpo.workers.rollout.agent_loop import AgentLoop  # noqa: E402
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine  # noqa: E402
from verl_arpo.workers.rollout.tools.registry import ToolExecutor  # noqa: E402

SETTINGS = {
    "GRPO (baseline)": dict(initial_rollouts=None),
    "ARPO": dict(initial_rollouts=None, beam_size=2, branch_probability=0.5, entropy_weight=0.2, arpo=True),
    "AEPO (dynamic)": dict(initial_rollouts=None, beam_size=2, branch_probability=0.5, entropy_weight=0.2,
                           branch_rule="aepo", enable_dynamic_rollouts=True, arpo=True),
}


def load_prompts(tokenizer, data: str | None, k: int):
    """(chat-templated prompt ids, data_source, ground truth) for k prompts."""
    if data is None:
        from verl_arpo.utils.tiny_model import TOOL_PROMPT_USER

        rows = [([{"role": "user", "content": TOOL_PROMPT_USER}], "arpo_toy_math", "408")] * k
    else:
        import pandas as pd

        df = pd.read_parquet(data).head(k)
        rows = [(list(r["prompt"]), r["data_source"], r["reward_model"]["ground_truth"]) for _, r in df.iterrows()]
    ids = [tokenizer.apply_chat_template([dict(m) for m in msgs], add_generation_prompt=True, tokenize=True)
           for msgs, _, _ in rows]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    return ids, [r[1] for r in rows], [r[2] for r in rows]


def batch_of(tokenizer, ids):
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    t = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    m = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return DataProto.from_dict(tensors={"input_ids": t, "attention_mask": m},
                               non_tensors={"uid": as_object_array([f"u{i}" for i in range(len(ids))])},
                               meta_info={"global_steps": 1})


def run(model_dir: str, data: str | None, prompts: int, n: int, m0: int, response_length: int, seeds: int,
        tools_yaml: str) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids, sources, truths = load_prompts(tok, data, prompts)
    rows = []
    for name, s in SETTINGS.items():
        s = dict(s)
        arpo = s.pop("arpo", False)
        if arpo:
            s["initial_rollouts"] = m0
        agg = {"executions": 0, "trajs": 0, "generated": 0, "in_traj": 0, "seconds": 0.0, "reward": [], "branches": 0}
        for seed in range(seeds):
            engine = HFEngine(model_dir, tok, dtype="float32", seed=seed)
            executor = ToolExecutor.from_config(tools_yaml)
            cfg = from_mapping(RolloutSection, dict(n=n, response_length=response_length, **s), "rollout")
            t0 = time.perf_counter()
            out = AgentLoop(engine, tok, executor, cfg, call_limit=executor.call_limit,
                            seed=seed).generate_sequences(batch_of(tok, ids))
            agg["seconds"] += time.perf_counter() - t0
            m = out.meta_info["metrics"]
            # executions actually run (shared prefixes count once), incl. AEPO pre-monitoring
            agg["executions"] += m.get("tools/calls", 0.0)
            agg["trajs"] += len(out)
            agg["generated"] += m["rollout/tokens_generated"]
            agg["in_traj"] += m["rollout/tokens_in_trajectories"]
            agg["branches"] += m.get("rollout/branches", 0.0)
            R = out.batch["responses"].shape[-1]
            for k in range(len(out)):
                L = int(out.batch["attention_mask"][k, -R:].sum())
                text = tok.decode(out.batch["responses"][k, :L], skip_special_tokens=True)
                p = k // n
                r = default_compute_score(sources[p], text, truths[p])
                agg["reward"].append(float(r["score"] if isinstance(r, dict) else r))
            executor.close()
        rows.append({"setting": name, "tool_exec_per_traj": agg["executions"] / agg["trajs"],
                     "gen_per_traj_token": agg["generated"] / max(1, agg["in_traj"]),
                     "rollout_s": agg["seconds"] / seeds, "reward_mean": float(np.mean(agg["reward"])),
                     "branches_per_prompt": agg["branches"] / (seeds * prompts)})
    base = rows[0]
    for r in rows:
        r["tool_exec_ratio_vs_grpo"] = r["tool_exec_per_traj"] / max(1e-9, base["tool_exec_per_traj"])
        r["gen_token_ratio_vs_grpo"] = r["gen_per_traj_token"] / max(1e-9, base["gen_per_traj_token"])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: a tool-calling tiny model built now)")
    p.add_argument("--data", default=None, help="verl parquet with prompts (default: the tiny model's prompt)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--initial_rollouts", type=int, default=4)
    p.add_argument("--response_length", type=int, default=96)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--tools", default=str(ROOT / "configs" / "tools" / "python_search_local.yaml"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "branching.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    model = a.model
    if model is None:
        from verl_arpo.utils.tiny_model import make_tiny_model, make_tool_model

        tmp = tempfile.mkdtemp()
        model = make_tool_model(make_tiny_model(Path(tmp) / "base"), Path(tmp) / "tool")
    rows = run(model, a.data, a.prompts, a.n, a.initial_rollouts, a.response_length, a.seeds, a.tools)
    head = f"{'setting':<18}{'tool exec/traj':>15}{'vs GRPO':>9}{'gen tok/traj tok':>18}{'vs GRPO':>9}" \
           f"{'rollout s':>11}{'reward':>8}{'branches/prompt':>17}"
    print(f"n={a.n}, m0={a.initial_rollouts}, prompts={a.prompts}, seeds={a.seeds}, model={a.model or 'tiny tool model'}")
    print(head)
    for r in rows:
        print(f"{r['setting']:<18}{r['tool_exec_per_traj']:>15.3f}{r['tool_exec_ratio_vs_grpo']:>9.2f}"
              f"{r['gen_per_traj_token']:>18.3f}{r['gen_token_ratio_vs_grpo']:>9.2f}{r['rollout_s']:>11.2f}"
              f"{r['reward_mean']:>8.3f}{r['branches_per_prompt']:>17.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()

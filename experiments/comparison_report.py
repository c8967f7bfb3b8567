"""The algorithm comparison's report (experiments/compare_algorithms.py writes it): from the stored
runs, the pairs every arm finished, each arm's accuracy and budgets, its difference from the
baseline with the primary interval (a t-interval over seed pairs) and both bootstraps beside it, a
one-sentence verdict, the markdown tables and the picture. Pure functions of the records
(docs/results.md, "How the comparison runs"); the intervals are verl_arpo/utils/stats.py's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from verl_arpo.quickstart import ALGO_OVERRIDES
from verl_arpo.utils.stats import cluster_bootstrap, mean_interval, paired_bootstrap, seed_t_interval

BASELINE = "grpo"
KINDS = {"arpo_toy_math": "arithmetic", "arpo_toy_search": "lookup", "arpo_toy_multi": "two-step"}


def complete_pairs(runs: dict[tuple[str, int], dict], algos: tuple[str, ...]) -> list[int]:
    """Seed pairs for which every algorithm has finished: only these enter the comparison."""
    pairs = sorted({p for _, p in runs})
    return [p for p in pairs if all((a, p) in runs for a in algos)]


BUDGETS = ("tokens_generated", "executed_tool_calls", "tool_calls_in_traj_per_traj", "tokens_trained", "step_s")
"""What an arm spends, per step and per prompt: generated tokens (the engine's, tool results
excluded), executed tool calls (pre-monitoring's included), tool calls inside each trajectory (a
branch counts the calls it shares with its parent), trained tokens and wall seconds."""


CONTRASTS = (("arpo", "arpo_w0", "does the entropy steer usefully: ARPO against the same branching at p = 0.5"),
             ("arpo", "arpo_before_call", "the paper's entropy timing against the reference code's"))
"""Differences between two non-baseline arms that the experiment is built to answer (issue 46), given
with the same intervals as the differences from the baseline when both arms ran."""


PROMPTS_PER_STEP = 6
"""configs/quickstart.yaml's data.train_batch_size (tests/benchmarks checks it)."""


def budgets(run: dict) -> dict[str, dict[str, float | None]]:
    """A run's budgets (BUDGETS), per step and per prompt (a step trains `prompts` prompts)."""
    m = run["train"]["mean"]
    traj = run["train"].get("trajectories_per_step") or 0
    prompts = m.get("prompts") or PROMPTS_PER_STEP   # runs stored before the dumps' prompts were counted
    per_step = {"tokens_generated": m.get("tokens_generated"), "tokens_trained": m.get("tokens_trained"),
                "step_s": m.get("step_s"), "tool_calls_in_traj_per_traj": m.get("tool_calls_in_traj_per_traj"),
                "executed_tool_calls": (m["executed_tool_calls_per_traj"] * traj
                                        if m.get("executed_tool_calls_per_traj") is not None and traj else None)}
    per_prompt = {k: (v / prompts if v is not None and prompts and k != "tool_calls_in_traj_per_traj" else None)
                  for k, v in per_step.items()}
    per_prompt["tool_calls_in_traj_per_traj"] = per_step["tool_calls_in_traj_per_traj"]
    return {"per_step": per_step, "per_prompt": per_prompt}


def _mean_of(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(kept)) if kept else None


def verdict(delta: tuple[float, float, float], name: str, base: str) -> str:
    """What the primary interval shows, in one sentence."""
    m, lo, hi = delta
    if math.isnan(lo):
        return f"{name} − {base}: one seed pair, no interval yet."
    if lo > 0:
        return f"{name} is more accurate than {base} (the seed-pair interval excludes 0)."
    if hi < 0:
        return f"{name} is less accurate than {base} (the seed-pair interval excludes 0)."
    return (f"{name} is not shown to differ from {base}: the seed-pair interval [{lo:+.3f}, {hi:+.3f}] includes 0 "
            f"(a difference larger than {max(abs(lo), abs(hi)):.3f} either way is unlikely).")


def cpu_kind(flags: list[str] | None) -> str:
    """A run's CPU as the kind that decides its fp32 kernels (ATen's dispatch and MKL's branch)."""
    if not flags:
        return "?"
    if "amx_bf16" in flags:
        return "AVX-512 + AMX"
    return "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "other")


def other_start_runs(runs: dict[tuple[str, int], dict], sft_sha: str) -> list[dict]:
    """The runs that started from another SFT model than the store's `sft_sha` (the same recipe retrained
    where it cannot be bit-identical, e.g. on another CPU kind: docs/results.md), with their CPU kind."""
    return [{"algo": a, "pair": p, "sft_sha256": r["sft_sha256"], "cpu": cpu_kind(r.get("cpu_flags"))}
            for (a, p), r in sorted(runs.items()) if r.get("sft_sha256", sft_sha) != sft_sha]


def build_report(sft: dict, runs: dict[tuple[str, int], dict], algos: tuple[str, ...],
                 sft_sha: str | None = None) -> dict[str, Any]:
    """The comparison over the pairs every arm finished; `sft` is the SFT model's eval_record.

    Intervals (verl_arpo.utils.stats): `*_delta` / `gain_over_sft` are the primary t-intervals over seed
    pairs; `*_bootstrap` resample pairs × questions; `*_cluster` pairs × templates. Given the store's
    `sft_sha`, a pair with a run from another SFT model stays in the primary interval, and
    `accuracy_delta_one_sft` repeats it over the pairs whose every run started from the store's model
    (the sensitivity analysis; `one_sft_pairs` names them)."""
    pairs = complete_pairs(runs, algos)
    report: dict[str, Any] = {"pairs": pairs, "n_questions": len(sft["correct"]), "sft": {
        "accuracy": sft["accuracy"], "per_kind": sft["per_kind"],
        "tool_calls_per_question": sft["tool_calls_per_question"]},
        "intervals": {"primary": "t-interval over seed pairs of the per-pair mean difference (95%)",
                      "bootstrap": "paired bootstrap over seed pairs x questions (95%)",
                      "cluster": "paired bootstrap over seed pairs x question templates (95%)"},
        "algos": {}, "vs_baseline": {}}
    if not pairs:
        return report
    sft_c = np.asarray(sft["correct"])
    templates = sft.get("templates")
    scores: dict[str, np.ndarray] = {}

    def intervals(diff: np.ndarray, key: str) -> dict[str, Any]:
        out = {key: seed_t_interval(diff), f"{key}_bootstrap": paired_bootstrap(diff)}
        if templates:
            out[f"{key}_cluster"] = cluster_bootstrap(diff, templates)
        return out

    for a in algos:
        rs = [runs[(a, p)] for p in pairs]
        for r in rs:
            if r["eval"]["questions"] != sft["questions"]:
                raise ValueError(f"{a} pair {r['pair']} was evaluated on other questions than the SFT model "
                                 "(the test split changed): delete its run folder and run it again")
        scores[a] = np.asarray([r["eval"]["correct"] for r in rs])  # K x Q
        train = {k: mean_interval([r["train"]["mean"][k] for r in rs if r["train"]["mean"].get(k) is not None])
                 for k in rs[0]["train"]["mean"] if any(r["train"]["mean"].get(k) is not None for r in rs)}
        spent = [budgets(r) for r in rs]
        report["algos"][a] = {
            "overrides": rs[0].get("overrides", ALGO_OVERRIDES.get(a, [])), "accuracy": paired_bootstrap(scores[a]),
            **intervals(scores[a] - sft_c[None, :], "gain_over_sft"),
            "gain_over_sft_per_pair": {str(r["pair"]): paired_bootstrap(scores[a][i:i + 1] - sft_c[None, :])
                                       for i, r in enumerate(rs)},
            "per_kind": {k: float(np.mean([r["eval"]["per_kind"][k] for r in rs])) for k in rs[0]["eval"]["per_kind"]},
            "eval_tool_calls_per_question": mean_interval([r["eval"]["tool_calls_per_question"] for r in rs]),
            "budgets": {unit: {k: _mean_of([b[unit][k] for b in spent]) for k in BUDGETS}
                        for unit in ("per_step", "per_prompt")},
            "train": train, "rl_s": mean_interval([r["wall_s"]["rl"] for r in rs]),
            "reward_curves": {str(r["pair"]): r["train"]["per_step"]["reward"] for r in rs}}
    one_sft = None
    if sft_sha is not None:
        report["other_start_runs"] = other_start_runs(runs, sft_sha)
        other = {r["pair"] for r in report["other_start_runs"] if r["algo"] in algos} & set(pairs)
        if other:
            report["one_sft_pairs"] = [p for p in pairs if p not in other]
            one_sft = [i for i, p in enumerate(pairs) if p not in other]
    if BASELINE in scores:
        base_calls = [runs[(BASELINE, p)]["train"]["mean"]["executed_tool_calls_per_traj"] for p in pairs]
        base_spent = report["algos"][BASELINE]["budgets"]["per_prompt"]
        for a in algos:
            if a == BASELINE:
                continue
            calls = [runs[(a, p)]["train"]["mean"]["executed_tool_calls_per_traj"] for p in pairs]
            diff = scores[a] - scores[BASELINE]
            spent = report["algos"][a]["budgets"]["per_prompt"]
            report["vs_baseline"][a] = {
                **intervals(diff, "accuracy_delta"),
                "accuracy_delta_per_pair": [float(x) for x in diff.mean(axis=1)],
                "budget_ratio": {k: (spent[k] / base_spent[k] if spent[k] is not None and base_spent[k] else None)
                                 for k in BUDGETS},
                "executed_tool_calls_ratio": float(np.mean(calls) / max(np.mean(base_calls), 1e-9)),
                "executed_tool_calls_ratio_per_pair": [c / max(b, 1e-9) for c, b in zip(calls, base_calls)]}
            if one_sft is not None:
                report["vs_baseline"][a]["accuracy_delta_one_sft"] = seed_t_interval(diff[one_sft])
            report["vs_baseline"][a]["verdict"] = verdict(report["vs_baseline"][a]["accuracy_delta"], a.upper(),
                                                         BASELINE.upper())
    report["contrasts"] = {}
    for a, b, what in CONTRASTS:
        if a in scores and b in scores:
            diff = scores[a] - scores[b]
            report["contrasts"][f"{a}-{b}"] = {
                "what": what, **intervals(diff, "accuracy_delta"),
                "accuracy_delta_per_pair": [float(x) for x in diff.mean(axis=1)],
                **({"accuracy_delta_one_sft": seed_t_interval(diff[one_sft])} if one_sft is not None else {})}
    return report


def _ci(t: tuple[float, float, float] | list[float], signed: bool = True) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(t[0])} [{f.format(t[1])}, {f.format(t[2])}]"


def _ratio(x: float | None) -> str:
    return f"{x:.2f}×" if x is not None else "—"


def markdown(report: dict) -> str:
    pairs, algos = report["pairs"], report["algos"]
    lines = [f"Seed pairs: {len(pairs)} ({', '.join(map(str, pairs)) or 'none finished'}); questions: "
             f"{report['n_questions']}. Primary interval: {report['intervals']['primary']}; beside it the "
             f"{report['intervals']['bootstrap']} and the {report['intervals']['cluster']}. Counts: mean [min, max] "
             "over pairs.", ""]
    if not algos:
        return "\n".join(lines) + "\n"
    base = BASELINE.upper()
    lines += [f"| arm | accuracy | Δ vs {base} [t, seed pairs] | Δ [bootstrap] | Δ [template-clustered] | generated "
              f"tokens / prompt (× {base}) | executed tool calls / prompt (× {base}) | calls inside a trajectory "
              "(× GRPO) | trained tokens / step | s / step | clip fraction (lower) |",
              "|---|---|---|---|---|---|---|---|---:|---:|---|"]
    lines.append(f"| SFT (start) | {report['sft']['accuracy']:.3f} | — | — | — | — | — | — | — | — | — |")
    for a, r in algos.items():
        vs, bp, t = report["vs_baseline"].get(a), r["budgets"]["per_prompt"], r["train"]
        br = vs["budget_ratio"] if vs else {}

        def num(x, f="{:,.0f}"):
            return f.format(x) if x is not None else "—"
        clip = (f"{t['pg_clipfrac'][0]:.4f} ({t['pg_clipfrac_lower'][0]:.4f})" if "pg_clipfrac" in t else "—")
        lines.append(
            f"| {a.upper()} | {_ci(r['accuracy'], signed=False)} | {_ci(vs['accuracy_delta']) if vs else '—'} | "
            f"{_ci(vs['accuracy_delta_bootstrap']) if vs else '—'} | "
            f"{_ci(vs['accuracy_delta_cluster']) if vs and 'accuracy_delta_cluster' in vs else '—'} | "
            f"{num(bp['tokens_generated'])} ({_ratio(br.get('tokens_generated'))}) | "
            f"{num(bp['executed_tool_calls'], '{:.2f}')} ({_ratio(br.get('executed_tool_calls'))}) | "
            f"{num(bp['tool_calls_in_traj_per_traj'], '{:.2f}')} ({_ratio(br.get('tool_calls_in_traj_per_traj'))}) | "
            f"{num(r['budgets']['per_step']['tokens_trained'])} | {num(r['budgets']['per_step']['step_s'])} | {clip} |")
    lines += [""] + [f"- {vs['verdict']}" for vs in report["vs_baseline"].values()]
    others = report.get("other_start_runs", [])
    if others:
        shas = sorted({r["sft_sha256"][:12] for r in others})
        one = report.get("one_sft_pairs", [])
        lines += ["", "Started from another SFT model than the store's (`" + report.get("sft_sha256", "?")[:12]
                  + "`), the same recipe retrained where it is not bit-identical ("
                  + ", ".join(f"`{s}`" for s in shas) + "): "
                  + ", ".join(f"{r['algo']} pair {r['pair']} ({r['cpu']})" for r in others) + "."
                  + (" Their pairs stay in the primary interval above. Sensitivity, over the "
                     f"{len(one)} pair(s) whose every run started from the store's model ({', '.join(map(str, one))}): "
                     + "; ".join(f"{a.upper()} − {base} {_ci(vs['accuracy_delta_one_sft'])}"
                                 for a, vs in report["vs_baseline"].items() if "accuracy_delta_one_sft" in vs)
                     + " (t, seed pairs). Their gain over SFT is measured against the store's SFT model."
                     if "one_sft_pairs" in report else " Their pair is not complete: no table holds them yet.")]
    contrasts = report.get("contrasts", {})
    lines += [""] if contrasts else []
    for key, c in contrasts.items():
        a, b = (x.upper() for x in key.split("-"))
        lines += [f"- {a} − {b} ({c['what']}): {_ci(c['accuracy_delta'])} (t, seed pairs), "
                  f"{_ci(c['accuracy_delta_bootstrap'])} (bootstrap)"
                  + (f", {_ci(c['accuracy_delta_cluster'])} (clustered)" if "accuracy_delta_cluster" in c else "")
                  + "; per pair " + ", ".join(f"{x:+.3f}" for x in c["accuracy_delta_per_pair"])
                  + (f"; one SFT model's pairs {_ci(c['accuracy_delta_one_sft'])}" if "accuracy_delta_one_sft" in c
                     else "") + "."]
    lines += ["", "Gain over SFT: " + "; ".join(
        f"{a.upper()} {_ci(r['gain_over_sft'])} (t), {_ci(r['gain_over_sft_bootstrap'])} (bootstrap)"
        + (f", {_ci(r['gain_over_sft_cluster'])} (clustered)" if "gain_over_sft_cluster" in r else "")
        for a, r in algos.items()) + ".", ""]
    lines += ["| arm | arithmetic / lookup / two-step | tool calls / question (eval) | branches / step | draws / step | "
              "fire rate | mean p of a draw | draws at ΔH = 0 / step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for a, r in algos.items():
        t = r["train"]

        def g(k, f="{:.2f}"):
            return f.format(t[k][0]) if k in t else "—"
        rate = (f"{t['branches'][0] / t['branch_draws'][0]:.2f}" if t.get("branch_draws", (0,))[0] else "—")
        lines.append(f"| {a.upper()} | " + " / ".join(f"{r['per_kind'].get(k, float('nan')):.2f}" for k in KINDS.values())
                     + f" | {r['eval_tool_calls_per_question'][0]:.2f} | {g('branches', '{:.1f}')} | "
                     f"{g('branch_draws', '{:.1f}')} | {rate} | {g('branch_p_mean', '{:.3f}')} | "
                     f"{g('branch_draws_zero_dh', '{:.1f}')} |")
    lines += ["", f"Δ vs {base} per seed pair:", "", "| arm | " + " | ".join(f"pair {p}" for p in pairs) + " |",
              "|---|" + "---|" * len(pairs)]
    for a, vs in report["vs_baseline"].items():
        lines.append(f"| {a.upper()} | " + " | ".join(f"{x:+.3f}" for x in vs["accuracy_delta_per_pair"]) + " |")
    lines += ["", "Config switches (on configs/quickstart.yaml, which is ARPO; seeds excluded):", ""]
    lines += [f"- {a.upper()}: " + (", ".join(f"`{o}`" for o in r["overrides"] if not o.startswith(("data.seed=",
              "actor_rollout_ref.rollout.seed="))) or "none") for a, r in algos.items()]
    if report.get("config_sha256"):
        lines += ["", f"Frozen config sha256: `{report['config_sha256']}`."]
    for am in report.get("amendments", []):
        ran = [f"{r['algo']} pair {r['pair']}" for r in report.get("runs_by_config", {}).get(am["config_sha256"], [])]
        lines += [f"Amended {am['time'][:10]} (commit {am['commit']}, now `{am['config_sha256'][:12]}`; "
                  f"{', '.join(am['files_changed'])}): {am['why']}" + (f" Runs under it: {', '.join(ran)}." if ran else "")]
    resumed = report.get("resumed_runs", [])
    if resumed:
        lines += ["", "Resumed after a stop, from their RL checkpoint (training continues as the uninterrupted run "
                  "would; their RL seconds are the resumed part plus the earlier steps' logged times, without the "
                  "first part's start-up): " + ", ".join(f"{r['algo']} pair {r['pair']} (from step {r['step']})"
                                                         for r in resumed) + "."]
    return "\n".join(lines) + "\n"


def picture(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"grpo": "tab:gray", "arpo": "tab:blue", "aepo": "tab:orange"}
    for a, r in report["algos"].items():
        acc, calls = r["accuracy"], r["train"]["executed_tool_calls_per_traj"]
        ax1.errorbar(calls[0], acc[0], yerr=[[acc[0] - acc[1]], [acc[2] - acc[0]]],
                     xerr=[[calls[0] - calls[1]], [calls[2] - calls[0]]], fmt="o", capsize=4, color=colors.get(a),
                     label=a.upper())
        curves = np.asarray(list(r["reward_curves"].values()))
        steps = np.arange(1, curves.shape[1] + 1)
        for c in curves:
            ax2.plot(steps, c, color=colors.get(a), alpha=0.2)
        ax2.plot(steps, curves.mean(0), color=colors.get(a), marker="o", label=a.upper())
    ax1.axhline(report["sft"]["accuracy"], color="black", ls="--", lw=1, label="SFT")
    ax1.set_xlabel("executed tool calls per trajectory (training; range over seed pairs)")
    ax1.set_ylabel("test accuracy (95% interval)")
    ax1.set_title(f"accuracy vs tool calls, {len(report['pairs'])} seed pair(s)")
    ax2.set_xlabel("RL step")
    ax2.set_ylabel("mean training reward")
    ax2.set_title("reward per step (thin: seed pairs; thick: mean)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def resumed_runs(runs: dict[tuple[str, int], dict]) -> list[dict]:
    """The runs that continued from an RL checkpoint after a stop, and from which step."""
    return [{"algo": algo, "pair": pair, "step": r["resumed_from_step"]}
            for (algo, pair), r in sorted(runs.items()) if r.get("resumed_from_step")]


def runs_by_config(runs: dict[tuple[str, int], dict]) -> dict[str, list[dict]]:
    """Which runs ran under which config_sha256 (a frozen store's original or an amendment)."""
    out: dict[str, list[dict]] = {}
    for (algo, pair), r in sorted(runs.items()):
        out.setdefault(r.get("config_sha256") or "?", []).append({"algo": algo, "pair": pair})
    return out

"""Where a training step of ours spends its time, next to TRL's: cProfile of steady-state steps in
one process, no Ray.

Ours: the real driver (`RayPPOTrainer.train_step`) with the real `ActorRolloutRefWorker` called
in-process (world size 1, FSDP2 on a 1-rank gloo group, 1 torch thread like a Ray worker). So the
profile covers rollout, scoring, old log-probs, the update and the weight sync, but not Ray's
transfer of DataProtos between driver and workers (the benchmark's step time includes it).
TRL: `GRPOTrainer.train()` with the same settings as bench_trainer_vs_trl.py, 1 torch thread, in
its own process.

    python benchmarks/profile_step.py [--model DIR] [--steps 3] [--top 25] [--trl]

Prints the top functions by cumulative time (after the first, warm-up step) and a per-phase table;
writes benchmarks/results/profile_step.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import shutil
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (RESULTS, grpo_spec, ours_overrides, tmpdir)  # noqa: E402


class LocalGroup:
    """Stands in for a RayWorkerGroup of one: calls the worker's methods directly."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def execute_all(self, name, *a, **k):
        return [getattr(self.worker, name)(*a, **k)]


def _stats_text(prof: cProfile.Profile, top: int, sort: str) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(sort).print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:start + top + 1])


def profile_ours(spec: dict, top: int) -> str:
    import socket

    import torch
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl_arpo.utils.dataset.rl_dataset import RLHFDataset
    from verl_arpo.workers.reward_manager import load_reward_manager
    from verl_arpo.workers.fsdp_workers import ActorRolloutRefWorker

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base=None):
        cfg = compose(config_name="cpu_tiny", overrides=ours_overrides(dict(spec, workers=1)))
    cfg = validate_config(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    ds = RLHFDataset(cfg.data.train_files, tok, cfg.data)
    trainer = RayPPOTrainer(cfg, tok, ds, None, load_reward_manager(cfg, tok, num_examine=0), None)
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, cfg.derived, role="actor_rollout_ref")
    worker.init_model(trainer.total_training_steps, False, 0)
    trainer.actor_rollout_wg = LocalGroup(worker)
    trainer.n_workers = 1
    trainer.train_step(1)   # warm-up
    prof, phases = cProfile.Profile(), []
    for step in range(2, spec["steps"] + 1):
        prof.enable()
        m = trainer.train_step(step)
        prof.disable()
        phases.append({k[len("timing_s/"):]: v for k, v in m.items() if k.startswith("timing_s/")})
    keys = list(phases[0])
    mean = {k: sum(p[k] for p in phases) / len(phases) for k in keys}
    table = "\n".join(f"  {k:<14}{v:8.3f} s  {100 * v / mean['step']:5.1f} %" for k, v in mean.items())
    return (f"ours, per step (mean of {len(phases)} steady steps, 1 process, 1 thread):\n{table}\n\n"
            f"ours, top {top} by cumulative time:\n{_stats_text(prof, top, 'cumulative')}\n\n"
            f"ours, top {top} by own time:\n{_stats_text(prof, top, 'tottime')}\n")


def profile_trl(spec: dict, top: int) -> str:
    import bench_trainer_vs_trl as b

    Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
    out = Path(spec["out_dir"]) / "trl_out.json"
    prof = cProfile.Profile()
    (Path(spec["out_dir"]) / "spec.json").write_text(json.dumps(dict(spec, trl_threads=1)))
    b._child_trl(str(Path(spec["out_dir"]) / "spec.json"), str(out), profiler=prof)
    steps = json.loads(out.read_text())["steps"][1:]
    gen = sum(s["gen_s"] for s in steps) / len(steps)
    step = sum(s["step_s"] for s in steps) / len(steps)
    return (f"TRL, per step (mean of {len(steps)} steps after the first): step {step:.3f} s, generate {gen:.3f} s, "
            f"rest {step - gen:.3f} s\n(profile: trainer.train() only, warm-up step included)\n\n"
            f"TRL, top {top} by cumulative time:\n{_stats_text(prof, top, 'cumulative')}\n\n"
            f"TRL, top {top} by own time:\n{_stats_text(prof, top, 'tottime')}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response_length", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trl", action="store_true", help="also profile TRL's GRPOTrainer (in a subprocess)")
    p.add_argument("--_trl_only", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "profile_step.txt"))
    a = p.parse_args(argv)
    if a._trl_only:   # child: TRL alone (in the same process as ours, accelerate would see our gloo group)
        spec = json.loads(Path(a._trl_only[0]).read_text())
        Path(a._trl_only[1]).write_text(profile_trl(spec, a.top))
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tmp = tmpdir("profile_step_")
    spec = dict(grpo_spec(tmp, a.model, a.prompts, a.n, a.response_length, a.steps), out_dir=str(tmp / "run"))
    t0 = time.time()
    text = (f"profile_step: model={a.model or 'tiny'} P={a.prompts} n={a.n} response={a.response_length} "
            f"load average {os.getloadavg()[0]:.1f}\n\n" + profile_ours(spec, a.top))
    if a.trl:
        import subprocess

        (tmp / "trl_spec.json").write_text(json.dumps(dict(spec, out_dir=str(tmp / "trl"))))
        r = subprocess.run([sys.executable, __file__, "--top", str(a.top), "--_trl_only", str(tmp / "trl_spec.json"),
                            str(tmp / "trl.txt")], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items()   # not our 1-rank group's variables:
                                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                             "MASTER_ADDR", "MASTER_PORT")})   # accelerate would go distributed
        if r.returncode != 0:
            raise RuntimeError(f"TRL profile failed:\n{r.stderr[-3000:]}")
        text += "\n" + (tmp / "trl.txt").read_text()
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(f"wrote {a.out} ({time.time() - t0:.0f} s)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

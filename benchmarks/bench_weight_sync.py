"""Weight-sync memory: the extra host memory an engine's `update_weights` needs (docs/gpu.md, "Weight sync").

The trainer streams the new weights: each parameter is gathered (a fresh full tensor), cast to the
engine's dtype, handed over and dropped before the next. The baseline, measured in the same run, is
the old way: collect every full tensor first (`list(...)`), then hand the list over. Both feed the
same engine the same values; each measurement is a fresh subprocess:

    peak RSS growth = VmHWM during the sync - RSS just before it     (peak reset via clear_refs)

glibc is told to return freed blocks above 64 KiB at once (MALLOC_MMAP_THRESHOLD_), so RSS shows
live memory rather than malloc's free lists. On a GPU the same bound holds for device memory (the
gather happens there); `scripts/gpu_check.sh` measures it with torch.cuda.max_memory_allocated.

    python benchmarks/bench_weight_sync.py [--model DIR] [--engines hf,vllm] [--out JSON]
    python benchmarks/bench_weight_sync.py child ENGINE MODEL_DIR MODE    # one measurement (JSON line)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("stream", "collect")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child(engine: str, model_dir: str, mode: str) -> dict:
    """Build the engine, hold a copy of the weights as the 'trainer' (its shards), sync once."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from verl_arpo.workers.rollout.engines import build_engine

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if engine == "vllm":
        eng = build_engine("vllm", model_dir, tok, gpu_memory_utilization=0.3, dtype="float32",
                           max_model_len=512, seed=0)
    else:
        eng = build_engine("hf", model_dir, tok, dtype="float32", device="cpu", seed=0)
    trainer = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        trainer.update({k: v.clone() for k, v in load_file(str(f)).items()})
    with torch.no_grad():  # a first sync, unmeasured: the engine's own weights become resident (a
        eng.update_weights(trainer.items())  # fresh load may still be a lazily paged file mapping)
    largest = max(v.numel() * v.element_size() for v in trainer.values())
    total = sum(v.numel() * v.element_size() for v in trainer.values())

    def gathered():  # what FSDP's full_tensor() does: a fresh full tensor per parameter
        for name, shard in trainer.items():
            yield name, shard * 1.0009765625  # a new tensor with new values

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss()
    with torch.no_grad():
        eng.update_weights(gathered() if mode == "stream" else list(gathered()))
    peak = _peak()
    return dict(engine=engine, mode=mode, growth_mib=(peak - before) / 2**20, largest_param_mib=largest / 2**20,
                model_mib=total / 2**20)


def measure(engine: str, model_dir: str, mode: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, __file__, "child", engine, model_dir, mode], capture_output=True,
                         text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{engine}/{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(*sys.argv[2:5])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weight_sync.json"))
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_common import smollm2_dir

        model = smollm2_dir()
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("(vllm not installed: the vLLM rows are skipped)")
            engines.remove("vllm")
    rows = [measure(e, model, m) for e in engines for m in MODES]
    print(f"weight sync, model {Path(model).name} ({rows[0]['model_mib']:.0f} MiB fp32, largest parameter "
          f"{rows[0]['largest_param_mib']:.0f} MiB)")
    print(f"{'engine':<8}{'mode':<10}{'peak growth MiB':>17}{'÷ largest param':>17}{'÷ model':>10}")
    for r in rows:
        print(f"{r['engine']:<8}{r['mode']:<10}{r['growth_mib']:>17.0f}{r['growth_mib'] / r['largest_param_mib']:>17.2f}"
              f"{r['growth_mib'] / r['model_mib']:>10.2f}")
    for e in engines:
        s, c = (next(r for r in rows if r["engine"] == e and r["mode"] == m) for m in MODES)
        print(f"{e}: streamed / collected peak growth = {s['growth_mib'] / max(c['growth_mib'], 1e-9):.2f}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_common import summary_entry

    summary = []
    for e in engines:
        s, c = (next(r for r in rows if r["engine"] == e and r["mode"] == m) for m in MODES)
        summary.append(summary_entry(f"weight-sync extra peak memory MiB, {e}: collected first / streamed "
                                     f"(largest parameter {s['largest_param_mib']:.0f} MiB)", s["growth_mib"],
                                     c["growth_mib"], c["growth_mib"] / max(s["growth_mib"], 1e-9), None))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(benchmark="weight_sync", model=model, rows=rows, summary=summary), indent=2))


if __name__ == "__main__":
    main()

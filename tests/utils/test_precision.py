"""The compute precision follows the CPU: bf16 only where the CPU multiplies bf16 natively, since an
emulated bf16 matmul is far slower than fp32 (docs/performance.md, "Precision on the CPU")."""
import pytest

from verl_arpo.quickstart import FP32_RL_OVERRIDES, eval_args, resolve_precision, rl_command, sft_command
from verl_arpo.utils.device import cpu_has_fast_bf16

AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: sysret_ss_attrs\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert cpu_has_fast_bf16(AMX) and cpu_has_fast_bf16(ZEN4)
    assert not cpu_has_fast_bf16(ZEN3) and not cpu_has_fast_bf16("")
    # a flag must be a whole word: avx512_bf16 inside another name does not count
    assert not cpu_has_fast_bf16("flags\t: avx512_bf16x\n")


def test_auto_picks_what_this_cpu_has_and_explicit_choices_win():
    assert resolve_precision("auto") == ("bf16" if cpu_has_fast_bf16() else "fp32")
    assert resolve_precision("bf16") == "bf16" and resolve_precision("fp32") == "fp32"
    with pytest.raises(ValueError, match="choose one of"):
        resolve_precision("fp16")


def test_the_precision_reaches_every_stage(tmp_path):
    sft = sft_command(tmp_path / "base", tmp_path / "sft", 12, precision="fp32")
    assert not any("autocast_dtype" in a for a in sft)
    assert "model.autocast_dtype=bfloat16" in sft_command(tmp_path / "base", tmp_path / "sft", 12, precision="bf16")
    rl = rl_command(tmp_path / "sft", tmp_path / "rl", 13, "arpo", tmp_path / "c.sqlite", precision="fp32",
                    overrides=["actor_rollout_ref.rollout.dtype=bfloat16"])
    assert all(o in rl for o in FP32_RL_OVERRIDES)
    assert rl.index(FP32_RL_OVERRIDES[0]) < rl.index("actor_rollout_ref.rollout.dtype=bfloat16")  # the user's wins
    assert not any(o in rl_command(tmp_path, tmp_path, 13, "arpo", tmp_path, precision="bf16") for o in FP32_RL_OVERRIDES)
    args = eval_args(None, "fp32")
    assert args[args.index("--dtype") + 1] == "float32"
    args = eval_args(30, "bf16")
    assert args[args.index("--dtype") + 1] == "bfloat16" and args[args.index("--limit") + 1] == "30"



def _job(*overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from verl_arpo.config import JobConfig

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base=None):
        cfg = compose(config_name="quickstart", overrides=["actor_rollout_ref.model.path=/m", "trainer.device=cpu",
                                                           *overrides])
    return JobConfig.from_mapping(OmegaConf.to_container(cfg, resolve=True))


def test_the_trainer_names_the_bf16_keys_a_cpu_without_native_bf16_runs_slowly():
    from verl_arpo.trainer.ppo.ray_trainer import slow_bf16_keys

    job = _job()  # configs/quickstart.yaml: bf16 rollout and bf16 mixed precision
    lines = slow_bf16_keys(job, fast_bf16=False)
    assert [line.split("=", 1)[0] for line in lines] == [
        "actor_rollout_ref.rollout.dtype", "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"]
    assert all("~50x slower than fp32" in line and line.endswith("=float32") for line in lines)
    assert slow_bf16_keys(job, fast_bf16=True) == []
    assert slow_bf16_keys(_job(*FP32_RL_OVERRIDES), fast_bf16=False) == []  # what the quickstart passes there


def test_gpu_workers_train_with_expandable_segments_unless_the_user_chose(monkeypatch):
    from verl_arpo.utils.device import cuda_worker_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert cuda_worker_env(None) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert cuda_worker_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}) == {}  # ray_init env_vars
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
    assert cuda_worker_env({}) == {}  # the driver's environment

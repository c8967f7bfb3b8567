"""[issue 31, item 4] The reference model's weights: bf16 on the GPU as verl loads them (half the
memory and half the init broadcast of fp32), fp32 on the CPU; `fsdp_config.model_dtype` chooses."""
import pytest
import torch

from verl_arpo.protocol import DataProto
from worker_configs import log_probs
from verl_arpo.workers.sharded_model import load_causal_lm, model_dtype


def test_model_dtype_defaults_follow_verl_on_the_gpu_and_stay_fp32_on_the_cpu():
    assert model_dtype(None, trained=True, device_type="cuda") == torch.float32  # the optimizer's master weights
    assert model_dtype(None, trained=False, device_type="cuda") == torch.bfloat16  # the frozen reference
    assert model_dtype(None, trained=False, device_type="cpu") == torch.float32  # bf16 is emulated on most CPUs
    assert model_dtype("bf16", trained=True, device_type="cpu") == torch.bfloat16
    assert model_dtype("float32", trained=False, device_type="cuda") == torch.float32
    with pytest.raises(ValueError, match="model_dtype='fp16'"):
        model_dtype("fp16", trained=False, device_type="cuda")


def _batch(vocab: int, B: int = 4, P: int = 6, R: int = 8) -> DataProto:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (B, P + R), generator=g)
    attn = torch.ones(B, P + R, dtype=torch.long)
    attn[1, :2] = 0  # a left-padded prompt
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors=dict(input_ids=input_ids, attention_mask=attn, position_ids=pos,
                                            responses=input_ids[:, P:], response_mask=torch.ones(B, R)))


def test_a_bf16_reference_matches_the_fp32_one_within_bf16_tolerance(tiny_model_dir):
    from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

    logps = {}
    for dtype in (torch.float32, torch.bfloat16):
        module = load_causal_lm(tiny_model_dir, dtype=dtype, attn="sdpa").eval()
        assert next(module.parameters()).dtype == dtype
        data = _batch(module.config.vocab_size)
        logps[dtype], _ = DataParallelPPOActor(None, module).compute_log_prob(data, log_probs(2), calculate_entropy=False)
    diff = (logps[torch.bfloat16].float() - logps[torch.float32]).abs()
    assert logps[torch.float32].dtype == torch.float32
    assert 0 < diff.mean() < 0.02 and diff.max() < 0.1  # bf16 keeps 8 bits of mantissa: ~0.4% of each logit


def test_an_unknown_model_dtype_is_refused_naming_the_key(tiny_model_dir):
    from hydra import compose, initialize_config_dir

    from verl_arpo.trainer.config import ConfigError, validate_config

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base=None):
        cfg = compose(config_name="cpu_tiny", overrides=[f"actor_rollout_ref.model.path={tiny_model_dir}",
                                                         "actor_rollout_ref.ref.fsdp_config.model_dtype=fp16"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert [k for k, _ in err.value.problems] == ["actor_rollout_ref.ref.fsdp_config.model_dtype"]

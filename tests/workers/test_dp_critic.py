"""DataParallelPPOCritic against per-row HF forwards and a per-token value-loss loop."""
import pytest
import torch

from verl_arpo.protocol import DataProto
from verl_arpo.utils.torch_functional import compute_position_id_with_mask
from verl_arpo.workers.critic import dp_critic
from verl_arpo.workers.critic.dp_critic import DataParallelPPOCritic
from verl_arpo.workers.sharded_model import enable_activation_checkpointing
from worker_configs import critic_kwargs

P, R = 5, 7


def load_critic(model_dir):
    from transformers import AutoConfig, AutoModelForTokenClassification

    cfg = AutoConfig.from_pretrained(model_dir, num_labels=1)
    cfg.classifier_dropout = 0.0  # the head's dropout (0.1 by default) would make values noisy in train mode
    torch.manual_seed(0)  # the value head is freshly initialised
    return AutoModelForTokenClassification.from_pretrained(model_dir, config=cfg, attn_implementation="sdpa",
                                                           dtype=torch.float32)


@pytest.fixture(scope="module")
def critic(tiny_model_dir):
    return load_critic(tiny_model_dir)


def make_batch(vocab, B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, P + 1, (B,), generator=g)
    rlen = torch.randint(2, R + 1, (B,), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        attn[b, P - plen[b]:P + rlen[b]] = 1
    ids = torch.randint(3, vocab, (B, P + R), generator=g) * attn
    mask = attn[:, P:].clone()
    mask[1, 1] = 0  # tool result
    values = 0.3 * torch.randn(B, R, generator=g) * mask
    returns = torch.randn(B, R, generator=g) * mask
    return DataProto.from_dict(tensors=dict(input_ids=ids, attention_mask=attn, responses=ids[:, P:],
                                            position_ids=compute_position_id_with_mask(attn), response_mask=mask,
                                            values=values, returns=returns))


def per_row_values(model, data):
    out = {}
    attn = data.batch["attention_mask"]
    for b in range(attn.shape[0]):
        ids = data.batch["input_ids"][b][attn[b].bool()]
        n = int(attn[b, P:].sum())
        logits = model(input_ids=ids[None]).logits[0, :, 0]
        for t in range(n):
            out[(b, t)] = logits[len(ids) - n + t - 1]
    return out


def reference_objective(model, data, mode, c):
    m = data.batch["response_mask"]
    terms = {}
    for (b, t), v in per_row_values(model, data).items():
        if m[b, t]:
            old, ret = data.batch["values"][b, t], data.batch["returns"][b, t]
            clipped = torch.clamp(v, old - c, old + c)
            terms[(b, t)] = 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    if mode == "token-mean":
        return sum(terms.values()) / len(terms)
    seqs = {}
    for (b, _), v in terms.items():
        seqs.setdefault(b, []).append(v)
    return sum(sum(v) / len(v) for v in seqs.values()) / len(seqs)


class RecordingOptimizer:
    def __init__(self, model):
        self.model, self.grads = model, []

    def step(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def critic_grad(model, data, **cfg):
    opt = RecordingOptimizer(model)
    base = dict(ppo_mini_batch_size=len(data), ppo_micro_batch_size_per_gpu=len(data), cliprange_value=0.2,
                grad_clip=None)
    if cfg.pop("use_remove_padding", False):
        cfg["model"] = {"use_remove_padding": True}
    metrics = DataParallelPPOCritic(critic_module=model, critic_optimizer=opt,
                                    **critic_kwargs(**{**base, **cfg})).update_critic(data)
    return opt.grads[0], metrics


def assert_grads_close(a, b, rtol=1e-4):
    assert a.keys() == b.keys()
    scale = max(v.abs().max().item() for v in b.values())
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=rtol * scale, rtol=rtol, msg=k)


def test_compute_values_matches_plain_forward(critic):
    data = make_batch(critic.config.vocab_size, seed=1)
    rows = per_row_values(critic, data)
    values = DataParallelPPOCritic(critic_module=critic, **critic_kwargs(ppo_micro_batch_size_per_gpu=4)).compute_values(data)
    m = data.batch["response_mask"]
    for b in range(values.shape[0]):
        for t in range(R):
            expected = rows[(b, t)].item() if m[b, t] else 0.0
            assert values[b, t].item() == pytest.approx(expected, abs=1e-5)
    dynamic = dict(use_dynamic_bsz=True, forward_max_token_len_per_gpu=16)
    torch.testing.assert_close(DataParallelPPOCritic(critic_module=critic, **critic_kwargs(**dynamic)).compute_values(data),
                               values, atol=1e-5, rtol=1e-5)
    packed = DataParallelPPOCritic(critic_module=critic, **critic_kwargs(model={"use_remove_padding": True}, **dynamic))
    assert packed.use_remove_padding
    torch.testing.assert_close(packed.compute_values(data), values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_update_gradient_is_the_minibatch_objective(critic, mode):
    data = make_batch(critic.config.vocab_size, seed=2)
    critic.zero_grad(set_to_none=True)
    objective = reference_objective(critic, data, mode, 0.2)
    objective.backward()
    ref = {n: p.grad.detach().clone() for n, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)
    whole, metrics = critic_grad(critic, data, loss_agg_mode=mode)
    assert_grads_close(whole, ref)
    assert metrics["critic/vf_loss"][0] == pytest.approx(objective.item(), rel=1e-4)
    assert {"critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"} <= metrics.keys()
    one, _ = critic_grad(critic, data, loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1)
    assert_grads_close(one, ref)
    dyn, metrics_dyn = critic_grad(critic, data, loss_agg_mode=mode, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=15,
                                   use_remove_padding=True)
    assert_grads_close(dyn, ref)
    assert metrics_dyn["critic/vf_clipfrac"][0] == pytest.approx(metrics["critic/vf_clipfrac"][0], abs=1e-6)


def test_data_parallel_scaling(critic, monkeypatch):
    """Two 'ranks' with the full mini-batch's counts and dp_size=2: FSDP's average of their
    gradients equals the single-process gradient (uneven token counts per half)."""
    data = make_batch(critic.config.vocab_size, B=6, seed=3)
    full, _ = critic_grad(critic, data)
    mask = data.batch["response_mask"]
    counts = dict(dp_size=2, batch_num_tokens=mask.sum().item(), global_batch_size=(mask.sum(-1) > 0).sum().item())
    monkeypatch.setattr(dp_critic, "global_loss_counts", lambda *a, **k: counts)
    halves = [critic_grad(critic, data.slice(i * 3, i * 3 + 3), ppo_micro_batch_size_per_gpu=2)[0] for i in (0, 1)]
    assert_grads_close({k: (halves[0][k] + halves[1][k]) / 2 for k in full}, full)


def test_token_classification_heads_exist():
    """Qwen2 and Llama both provide AutoModelForTokenClassification with a 1-unit value head."""
    from transformers import AutoModelForTokenClassification, LlamaConfig, Qwen2Config

    for cfg_cls in (Qwen2Config, LlamaConfig):
        cfg = cfg_cls(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1)
        model = AutoModelForTokenClassification.from_config(cfg)
        out = model(input_ids=torch.tensor([[1, 2, 3]]))
        assert out.logits.shape == (1, 3, 1)


def test_critic_forwards_and_their_rerun_in_backward_run_without_cudnn_attention_on_cuda(critic, monkeypatch):
    """As the actor's (tests/workers/test_dp_actor.py): compute_values, the update's forward and the
    forward activation checkpointing re-runs inside backward all see cuDNN attention off on CUDA."""
    import copy

    from verl_arpo.workers import training_core

    real = training_core.without_cudnn_attention
    for mod in (training_core, dp_critic):
        monkeypatch.setattr(mod, "without_cudnn_attention", lambda device: real(torch.device("cuda")))
    m = copy.deepcopy(critic)
    enable_activation_checkpointing(m)
    seen = []
    m.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    data = make_batch(m.config.vocab_size, seed=2)
    DataParallelPPOCritic(critic_module=m, **critic_kwargs(ppo_micro_batch_size_per_gpu=3)).compute_values(data)
    assert len(seen) == 2
    critic_grad(m, data, ppo_micro_batch_size_per_gpu=3)
    assert len(seen) == 2 + 2 * 2   # two micro-batches, each forward once and once more in backward
    assert not any(seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()

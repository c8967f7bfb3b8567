"""`enable_activation_checkpointing`: the model loaders' one switch for non-reentrant activation
checkpointing. Checked against the same model without it: identical loss and gradients, fewer
activations kept alive between forward and backward, and no deprecation warning from transformers
(5.24 renamed `gradient_checkpointing_enable`; v6 removes the old name)."""
from __future__ import annotations

import warnings

import torch

from verl_arpo.workers.sharded_model import enable_activation_checkpointing, load_causal_lm


def _loss_and_grads(model, ids):
    model.train()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    # Every tensor autograd keeps for backward passes through pack: checkpointing keeps fewer.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved)


def test_checkpointing_keeps_the_gradients_and_fewer_activations(tiny_model_dir):
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = load_causal_lm(tiny_model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)   # the deprecated name warns with FutureWarning
        checkpointed = load_causal_lm(tiny_model_dir, dtype=torch.float32, gradient_checkpointing=True)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.modules())
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.modules())

    loss0, grads0, kept0 = _loss_and_grads(plain, ids)
    loss1, grads1, kept1 = _loss_and_grads(checkpointed, ids)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-6)
    assert grads1.keys() == grads0.keys() and grads0
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert kept1 < kept0


def test_checkpointing_a_model_built_after_loading(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_activation_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

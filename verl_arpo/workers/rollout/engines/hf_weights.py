"""The HF engine's weights: sleep and wake, discard and refill, the weight sync (docs/gpu.md,
"Weight sync" and "Host memory").

The hybrid engine's weights are overwritten by the sync that follows every actor update, so while
the actor updates they need no memory at all: `discard_weights` frees every parameter's storage
(vLLM's sleep level 2) and the next `update_weights` allocates and fills them again. The Parameter
objects stay, so tied weights (embedding and LM head) stay one tensor.
"""

from __future__ import annotations

import torch

from verl_arpo.workers.rollout.engines import fused_projections


class EngineWeights:
    """Mixin for HFEngine (needs `model`, `device`, `release()`, and the flags `_asleep`,
    `_discarded`, `_owns_weights` set in its __init__)."""

    def sleep(self) -> None:
        """Drop the KV store; on an accelerator also move the weights to CPU."""
        self.release()
        if self.device.type != "cpu" and not self._asleep:
            self.model.to("cpu")
            self._asleep = True
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the freed blocks back, as vLLM's sleep does

    def wake(self) -> None:
        if self._asleep:
            self.model.to(self.device)
            self._asleep = False

    def discard_weights(self) -> bool:
        """Free every parameter's storage (buffers stay: the sync does not carry them). Each
        Parameter object stays, so tied weights stay tied when `update_weights` refills them."""
        if not self._owns_weights:
            return False
        self.release()
        fused_projections.release(self.model)   # the stacked q/k/v and gate/up buffers go with the weights
        for p in self.model.parameters():   # unique parameters: a tied weight once
            if p not in self._discarded:
                self._discarded[p] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return True

    @property
    def weights_discarded(self) -> bool:
        return bool(self._discarded)

    def _check_weights(self) -> None:
        if self._discarded:
            raise RuntimeError("HFEngine: the weights were discarded (discard_weights) and not refilled; "
                               "call update_weights with every parameter before generating")

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the engine computes in: a sync casts each gathered parameter to it first."""
        return next(self.model.parameters()).dtype

    def check_weight_names(self, names) -> None:
        state = self.model.state_dict(keep_vars=True)
        unknown = [n for n in names if n not in state]
        if unknown:
            raise KeyError(f"update_weights: {len(unknown)} unknown parameter name(s), e.g. "
                           f"{unknown[:5]}; expected HF names such as {list(state)[:3]}")

    @torch.no_grad()
    def update_weights(self, named_tensors) -> None:
        """Copy (HF name, tensor) pairs into the model in place, one at a time, then drop all cached KV.

        Every name must be one of the model's `state_dict()` keys and shapes must match; a wrong
        pair raises before it is copied (`check_weight_names` first keeps a wrong sync from
        copying anything). The weights are woken onto the device first, so the copy runs there."""
        self.wake()
        state = self.model.state_dict(keep_vars=True)
        for n, t in named_tensors:
            if n not in state:
                self.check_weight_names([n])
            param = state[n]
            shape = self._discarded.pop(param, None) if isinstance(param, torch.nn.Parameter) else None
            if shape is not None:   # discarded: a fresh storage on the engine's device, filled next
                param.data = torch.empty(shape, dtype=param.dtype, device=self.device)
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"update_weights: shape mismatch for {n}: given {tuple(t.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(t.detach())   # copy_ converts dtype and device
            del t
        self.release()
        if self._discarded:
            names = [n for n, p in self.model.named_parameters() if p in self._discarded]
            raise ValueError(f"update_weights after discard_weights must carry every parameter; missing "
                             f"{len(names)}, e.g. {names[:3]}")

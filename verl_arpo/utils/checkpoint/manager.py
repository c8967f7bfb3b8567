"""`FSDPCheckpointManager`: sharded save and load of one FSDP2 (or plain) module with its optimizer,
LR schedule and RNG states, in the layout of this package's docstring."""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from verl_arpo.utils.checkpoint.hf_files import save_hf_safetensors, tied_duplicate_keys
from verl_arpo.utils.checkpoint.layout import (FORMAT, META_FILE, CheckpointSaveError, atomic_write_text,
                                               save_failure_message)
from verl_arpo.utils.checkpoint.offline import quiet_single_process, read_checkpoint_meta
from verl_arpo.utils.checkpoint.safe_load import safe_dcp_load, safe_torch_load

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- model helpers
def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a peft wrapper (FSDP2 keeps the module itself)."""
    return model.get_base_model() if _is_peft(model) else model


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _reshard(model: torch.nn.Module) -> None:
    """Put FSDP2 modules back to sharded state (a no_grad forward leaves the root unsharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _agree(error: str | None) -> list[str]:
    """Collective: every rank learns every rank's local error (also serves as a barrier)."""
    if not _dist_on():
        return [error] if error else []
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return [f"rank {r}: {e}" for r, e in enumerate(gathered) if e]


# --------------------------------------------------------------------------- the manager
class FSDPCheckpointManager:
    """Save/load one model (+ optimizer, lr scheduler, RNG) as a sharded DCP checkpoint directory.

    Works with FSDP2 (`fully_shard`) modules on any number of ranks, and with plain modules when
    there is no process group. `checkpoint_contents` selects what is saved and loaded: "model",
    "optimizer", "extra" (lr scheduler + RNG), and optionally "hf_model" (also write full HF
    safetensors into `huggingface/`; gathers the full state dict, so costly for big models).
    All ranks must call `save_checkpoint`/`load_checkpoint` together.
    """

    def __init__(self, model, optimizer=None, lr_scheduler=None, processing_class=None,
                 checkpoint_contents: Iterable[str] = ("model", "optimizer", "extra"), hf_config=None):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        self.checkpoint_contents = tuple(checkpoint_contents)
        unknown = set(self.checkpoint_contents) - {"model", "optimizer", "extra", "hf_model"}
        if unknown:
            raise ValueError(f"unknown checkpoint contents {sorted(unknown)}")
        self.hf_config = hf_config if hf_config is not None else getattr(unwrap_model(model), "config", None)

    # ---- save
    def save_checkpoint(self, local_path: str, global_step: int | None = None) -> None:
        """Write this model's checkpoint into `local_path` (a fresh directory, usually in staging).

        Raises `CheckpointSaveError` on every rank when any rank fails to write (e.g. disk full);
        the message names the path and the previous checkpoint, which stays intact.
        """
        contents = self.checkpoint_contents
        rank = _rank()
        try:
            os.makedirs(local_path, exist_ok=True)
            with quiet_single_process():
                for sub, sd in self._dcp_state_dicts():
                    dcp.save(sd, checkpoint_id=os.path.join(local_path, sub), no_dist=not _dist_on())
            full_sd = None
            if "hf_model" in contents and not _is_peft(self.model):
                opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
                full_sd = get_model_state_dict(self.model, options=opts)
        except (OSError, CheckpointException) as e:  # collective steps fail on every rank alike
            raise CheckpointSaveError(save_failure_message(local_path, e)) from e

        local_error = None
        try:
            if "extra" in contents:
                torch.save(self._extra_state(), os.path.join(local_path, f"extra_state_rank_{rank}.pt"))
            if rank == 0:
                self._save_hf_folder(os.path.join(local_path, "huggingface"), full_sd)
                self._save_lora_config(local_path)
        except OSError as e:
            local_error = save_failure_message(local_path, e)
        errors = _agree(local_error)
        if not errors and rank == 0:
            try:
                meta = self._meta(global_step, contents)
                atomic_write_text(os.path.join(local_path, META_FILE), json.dumps(meta, indent=1))
            except OSError as e:
                local_error = save_failure_message(local_path, e)
        errors = errors or _agree(local_error)
        if errors:
            raise CheckpointSaveError(errors[0] if len(errors) == 1 else "; ".join(errors))

    def _dcp_state_dicts(self) -> list[tuple[str, dict]]:
        """(DCP sub-directory, state dict) pairs named by the contents (FSDP2 modules resharded)."""
        _reshard(self.model)
        if self.optimizer is not None and "optimizer" in self.checkpoint_contents:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return [("model", model_sd)] * ("model" in self.checkpoint_contents) + [("optim", optim_sd)]
        return [("model", get_model_state_dict(self.model))] * ("model" in self.checkpoint_contents)

    def _extra_state(self) -> dict:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        # tensors and plain values only: the file loads with torch.load(weights_only=True)
        rng = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                       int(has_gauss), float(cached)),
               "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        sched = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return {"lr_scheduler": sched, "rng": rng, "world_size": _world()}

    def _save_hf_folder(self, hf_dir: str, full_sd: dict | None) -> None:
        os.makedirs(hf_dir, exist_ok=True)
        if self.hf_config is not None:
            self.hf_config.save_pretrained(hf_dir)
        gen = getattr(unwrap_model(self.model), "generation_config", None)
        if gen is not None:
            gen.save_pretrained(hf_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(hf_dir)
        if full_sd is not None:
            for k in tied_duplicate_keys(full_sd, self.hf_config):
                del full_sd[k]
            save_hf_safetensors(full_sd, hf_dir)

    def _adapter(self):
        """(adapter name, peft config) of a peft model, else None."""
        if not _is_peft(self.model):
            return None
        name = getattr(self.model, "active_adapter", "default")
        return name, self.model.peft_config[name]

    def _save_lora_config(self, local_path: str) -> None:
        if self._adapter():
            self._adapter()[1].save_pretrained(os.path.join(local_path, "lora_adapter"))

    def _meta(self, global_step, contents) -> dict:
        lora = None
        if self._adapter():
            name, cfg = self._adapter()
            lora = {"adapter_name": name, "peft_type": str(getattr(cfg, "peft_type", "LORA")),
                    "config_dir": "lora_adapter", "base_model_name_or_path": cfg.base_model_name_or_path}
        return {"format": FORMAT, "global_step": global_step, "world_size": _world(),
                "contents": list(contents), "model_class": type(unwrap_model(self.model)).__name__,
                "lora": lora, "torch_version": torch.__version__, "saved_at": time.time()}

    # ---- load
    def load_checkpoint(self, local_path: str | None) -> None:
        """Load what `checkpoint_contents` names from `local_path` (None: do nothing).

        The number of ranks may differ from the one that saved (DCP reshards); RNG states are then
        not restored (there is no matching rank), with a warning.
        """
        if local_path is None:
            return
        meta = read_checkpoint_meta(local_path)
        contents = self.checkpoint_contents
        for part in ("model", "optimizer"):
            if part in contents and part not in meta["contents"] and (part == "model" or self.optimizer):
                raise FileNotFoundError(f"{local_path} holds no {part} state (saved: {meta['contents']}); "
                                        f"drop '{part}' from the checkpoint contents to load the rest")
        sds = dict(self._dcp_state_dicts())
        with quiet_single_process():
            for sub, sd in sds.items():
                safe_dcp_load(sd, os.path.join(local_path, sub), no_dist=not _dist_on())
        if "optim" in sds:
            model_sd = sds.get("model") or get_model_state_dict(self.model)
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd,
                           optim_state_dict=sds["optim"])
        elif "model" in sds:
            set_model_state_dict(self.model, sds["model"])
        if "extra" in contents and "extra" in meta.get("contents", []):
            self._load_extra(local_path, meta)
        if _dist_on():
            dist.barrier()

    def _load_extra(self, local_path: str, meta: dict) -> None:
        rank = _rank()
        path = os.path.join(local_path, f"extra_state_rank_{rank}.pt")
        same_world = meta.get("world_size") == _world()
        if not os.path.isfile(path):
            path = os.path.join(local_path, "extra_state_rank_0.pt")
        state = safe_torch_load(path)
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if not same_world:
            logger.warning(f"checkpoint saved with {meta.get('world_size')} ranks, loading with "
                          f"{_world()}: RNG states are not restored")
            return
        rng = state["rng"]
        random.setstate(rng["python"])
        name, keys, *rest = rng["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)  # older files: an array
        np.random.set_state((name, keys.astype(np.uint32), *rest))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

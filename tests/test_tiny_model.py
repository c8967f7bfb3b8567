import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_arpo.utils.tiny_model import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, make_tiny_model


def test_tiny_model_folder_loads_with_auto_classes(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size == len(tok)
    ids = tok("print(1+1)", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))


def test_chat_template_is_chatml(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        add_generation_prompt=True, tokenize=False)
    assert text == f"{BOS_TOKEN}system\nS{EOS_TOKEN}\n{BOS_TOKEN}user\nQ{EOS_TOKEN}\n{BOS_TOKEN}assistant\n"


def test_tool_tags_are_ordinary_text(tiny_tokenizer):
    special = set(tiny_tokenizer.all_special_ids)
    for tag in ["<python>", "</python>", "<search>", "</search>", "<result>", "</result>", "<answer>"]:
        ids = tiny_tokenizer.encode(tag, add_special_tokens=False)
        assert not special & set(ids)
        assert tiny_tokenizer.decode(ids) == tag


def test_same_seed_same_weights(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "c", seed=4))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)

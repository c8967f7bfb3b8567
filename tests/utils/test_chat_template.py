"""data.custom_chat_template and data.apply_chat_template_kwargs reach every place a prompt is
rendered: the RL dataset, the SFT data and the evaluation, with the same text."""
import pandas as pd
import pytest

NOTHINK = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}"
TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<assistant>" + NOTHINK + "{{ m.content }}</assistant>"
            "{% else %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>" + NOTHINK + "{% endif %}")


@pytest.fixture
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_rl_dataset_sft_and_eval_render_with_the_configured_template(tok, tiny_model_dir, tmp_path):
    from verl_arpo.trainer.main_eval import _prompt_batch
    from verl_arpo.trainer.sft_data import tokenize_conversation
    from verl_arpo.utils.chat_template import configure_chat_template
    from verl_arpo.utils.dataset.rl_dataset import RLHFDataset
    from verl_arpo.config import DataConfig

    msgs = [{"role": "user", "content": "What is 2+2?"}]
    want = "<user>What is 2+2?</user><assistant>NOTHINK"
    pd.DataFrame([{"data_source": "arpo_toy_math", "prompt": msgs, "ability": "math",
                   "reward_model": {"ground_truth": "4", "style": "rule"}}]).to_parquet(tmp_path / "t.parquet")
    cfg = DataConfig(custom_chat_template=TEMPLATE, apply_chat_template_kwargs={"enable_thinking": False},
                     max_prompt_length=512)
    ds = RLHFDataset(str(tmp_path / "t.parquet"), tok, cfg)
    ids = ds[0]["input_ids"]
    ids = ids[ds[0]["attention_mask"].bool()] if hasattr(ids, "shape") else ids
    assert tok.decode(ids) == want
    # SFT: the assistant turn follows the same rendered prefix
    sft = tokenize_conversation(tok, msgs + [{"role": "assistant", "content": "4"}], template_kwargs={"enable_thinking": False})
    assert tok.decode(sft["input_ids"]).startswith(want)
    # evaluation: a fresh tokenizer configured from the same keys renders the same prompt
    from transformers import AutoTokenizer

    fresh = configure_chat_template(AutoTokenizer.from_pretrained(tiny_model_dir), TEMPLATE)
    batch = _prompt_batch(fresh, [{"messages": msgs}], 0, {"enable_thinking": False})
    row = batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()]
    assert tok.decode(row) == want


def test_a_template_file_and_a_bad_value(tmp_path):
    from verl_arpo.utils.chat_template import load_chat_template

    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a Jinja template nor an existing file"):
        load_chat_template(str(tmp_path / "missing.jinja"))

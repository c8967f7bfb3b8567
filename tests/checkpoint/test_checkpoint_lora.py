"""peft LoRA checkpoints (plain module, no process group): resume, merge, adapter export."""
import copy
import json
import os

import pytest
import torch

from merge_ckpt import convert_verl_to_hf as conv
from verl_arpo.utils import checkpoint as ck

IDS = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 64]])


def _peft_model(tiny_model_dir, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                     task_type="CAUSAL_LM")
    return get_peft_model(base, cfg)


@pytest.fixture(scope="module")
def lora_ckpt(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    model = _peft_model(tiny_model_dir, seed=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 500, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    root = str(tmp_path_factory.mktemp("lora") / "ckpts")
    staging = ck.begin_checkpoint(root, 1)
    ck.FSDPCheckpointManager(model, opt, processing_class=tiny_tokenizer).save_checkpoint(
        os.path.join(staging, "actor"), global_step=1)
    step_dir = ck.publish_checkpoint(root, 1, staging)
    return step_dir, model.eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_lora_checkpoint_records_peft_names(lora_ckpt):
    step_dir, _ = lora_ckpt
    actor = os.path.join(step_dir, "actor")
    meta = ck.read_checkpoint_meta(actor)
    assert meta["lora"]["adapter_name"] == "default"
    assert os.path.isfile(os.path.join(actor, "lora_adapter", "adapter_config.json"))
    keys = ck.load_model_state_offline(actor)
    assert any(".lora_A.default." in k for k in keys) and any(".base_layer." in k for k in keys)


def test_lora_resume(lora_ckpt, tiny_model_dir):
    step_dir, model = lora_ckpt
    fresh = _peft_model(tiny_model_dir, seed=1)
    opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    ck.FSDPCheckpointManager(fresh, opt).load_checkpoint(os.path.join(step_dir, "actor"))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_lora_merge_equals_merge_and_unload(lora_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    step_dir, model = lora_ckpt
    out = str(tmp_path / "merged")
    assert conv.main(["--verl_checkpoint", step_dir, "--output_dir", out, "--model_type", "qwen2"]) == 0
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    written = conv.load_hf_weights(out)
    assert not any("lora" in k or "base_layer" in k for k in written)
    for k, v in written.items():
        assert torch.allclose(v, expected[k], atol=1e-6, rtol=0), k
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.allclose(_logits(merged), _logits(model), atol=1e-5, rtol=0)


def test_lora_adapter_mode(lora_ckpt, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    step_dir, model = lora_ckpt
    out = str(tmp_path / "adapter")
    assert conv.main(["--verl_checkpoint", step_dir, "--output_dir", out, "--lora", "adapter",
                      "--base_model", tiny_model_dir]) == 0
    assert os.path.isfile(os.path.join(out, "adapter_config.json"))
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == tiny_model_dir
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out).eval()
    assert torch.allclose(_logits(loaded), _logits(model), atol=1e-6, rtol=0)


def test_adapter_mode_refuses_a_full_checkpoint(lora_ckpt, tmp_path, capsys, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    root = str(tmp_path / "ckpts")
    staging = ck.begin_checkpoint(root, 1)
    ck.FSDPCheckpointManager(model, checkpoint_contents=("model",)).save_checkpoint(
        os.path.join(staging, "actor"), global_step=1)
    ck.publish_checkpoint(root, 1, staging)
    rc = conv.main(["--verl_checkpoint", ck.checkpoint_dir(root, 1), "--output_dir", str(tmp_path / "a"),
                    "--lora", "adapter"])
    assert rc == 2 and "not a LoRA checkpoint" in capsys.readouterr().err

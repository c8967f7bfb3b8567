"""Cold-start SFT on the tiny model: loss goes down, the saved folder loads and holds the trained weights;
FSDP2 under torchrun (2 CPU processes, gloo) trains the same model as a single process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_arpo.trainer import main_sft
from verl_arpo.trainer.sft_data import read_records

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    """8 bundled conversations (math and search), in the seeds' conversations format."""
    recs = read_records(ROOT / "rl_datasets" / "sft_train.jsonl")
    picked = [r for r in recs if r["kind"] == "math"][:4] + [r for r in recs if r["kind"] == "search"][:4]
    path = tmp_path_factory.mktemp("sft_data") / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return str(path)


def _overrides(model_dir, data, out, **extra):
    base = {"model.partial_pretrain": model_dir, "data.train_files": data, "trainer.default_local_dir": out,
            "data.train_batch_size": 4, "data.micro_batch_size_per_gpu": 2, "data.max_length": 2048,
            "optim.lr": 3e-3, "optim.warmup_steps_ratio": 0.0, "optim.lr_scheduler": "constant",
            "trainer.total_epochs": 5, "trainer.device": "cpu", "data.shuffle": True}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _dataset_loss(model_dir, data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = main_sft.SFTDataset(data, tok, 2048)
    return main_sft.evaluate_loss(model, ds, 4, tok.pad_token_id, torch.device("cpu"))


def test_sft_reduces_loss_and_saves_hf_folder(tiny_model_dir, sft_file, tmp_path):
    out = str(tmp_path / "sft_out")
    summary = main_sft.run_sft(main_sft.load_config(_overrides(tiny_model_dir, sft_file, out)))
    losses = [h["loss"] for h in summary["history"] if "loss" in h]
    assert summary["steps"] == 10 and len(losses) == 10
    assert max(losses[-2:]) < 0.8 * losses[0], losses
    assert (Path(out) / "model.safetensors").is_file() and (Path(out) / "tokenizer.json").is_file()
    assert json.loads((Path(out) / "sft_meta.json").read_text())["steps"] == 10
    # the folder loads with the Auto classes and holds the trained weights (lower loss than the start)
    assert _dataset_loss(out, sft_file) < 0.8 * _dataset_loss(tiny_model_dir, sft_file)


def test_flex_attention_sft_on_the_cpu_is_refused_by_name(tiny_model_dir, sft_file, tmp_path):
    """FlexAttention has no CPU backward: without the check, the first training step raised from inside
    torch; now the run stops before it, naming the key and the fix."""
    cfg = main_sft.load_config(_overrides(tiny_model_dir, sft_file, str(tmp_path / "out"),
                                          **{"model.attn_implementation": "flex_attention"}))
    with pytest.raises(ValueError, match=r"model\.attn_implementation=flex_attention trains only on CUDA.*=sdpa"):
        main_sft.run_sft(cfg)


def test_config_rejects_unknown_keys_and_requires_model():
    with pytest.raises(SystemExit, match="bad override"):
        main_sft.load_config(["model.partial_pretrain=x", "optim.learning_rate=1"])
    with pytest.raises(SystemExit, match="partial_pretrain"):
        main_sft.load_config([])
    assert main_sft.load_config(["model.path=/m"]).model.partial_pretrain == "/m"


def test_fsdp2_torchrun_matches_single_process(tiny_model_dir, sft_file, tmp_path):
    from safetensors.torch import load_file

    extra = {"trainer.total_epochs": 1}
    single, dist_out = str(tmp_path / "single"), str(tmp_path / "fsdp")
    main_sft.run_sft(main_sft.load_config(_overrides(tiny_model_dir, sft_file, single, **extra)))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "verl_arpo.trainer.main_sft", *_overrides(tiny_model_dir, sft_file, dist_out, **extra)]
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((Path(dist_out) / "sft_meta.json").read_text())
    assert meta["world_size"] == 2 and meta["steps"] == 2
    a, b = load_file(str(Path(single) / "model.safetensors")), load_file(str(Path(dist_out) / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-4), (k, (a[k] - b[k]).abs().max())


def test_bf16_autocast_trains(tiny_model_dir, sft_file, tmp_path):
    cfg = main_sft.load_config(_overrides(tiny_model_dir, sft_file, str(tmp_path / "bf16"), **{
        "model.autocast_dtype": "bfloat16", "trainer.total_training_steps": 2, "data.val_files": sft_file}))
    summary = main_sft.run_sft(cfg)
    losses = [h["loss"] for h in summary["history"] if "loss" in h]
    assert summary["steps"] == 2 and all(0 < x < 10 for x in losses)
    assert [h["step"] for h in summary["history"] if "val_loss" in h] == [2]  # one epoch, then stop
    with pytest.raises(SystemExit, match="autocast_dtype"):
        main_sft.load_config(["model.path=/m", "model.autocast_dtype=float16"])
    with pytest.raises(SystemExit, match="larger than"):
        main_sft.run_sft(main_sft.load_config(_overrides(tiny_model_dir, sft_file, str(tmp_path / "x"),
                                                         **{"data.train_batch_size": 64})))


def test_length_sorted_micro_batches_keep_the_step_loss(tiny_model_dir, sft_file, tmp_path):
    """Micro-batches are grouped by length (less padding); the first step's loss must still be the
    token mean over exactly the step's conversations, computed here one conversation at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = main_sft.load_config(_overrides(tiny_model_dir, sft_file, str(tmp_path / "sorted"), **{
        "data.shuffle": False, "trainer.total_training_steps": 1, "data.train_batch_size": 8}))
    first = main_sft.run_sft(cfg)["history"][0]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ds = main_sft.SFTDataset(sft_file, tok, 2048)
    assert len({ds.length(i) for i in range(8)}) > 1  # the sort has something to reorder
    nll, targets = 0.0, 0
    with torch.no_grad():
        for i in range(8):  # a plain loop: no padding, no grouping
            ids = torch.tensor([ds[i]["input_ids"]])
            mask = torch.tensor(ds[i]["loss_mask"][1:], dtype=torch.bool)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            tok_nll = -logp.gather(-1, ids[0, 1:, None])[:, 0]
            nll += float(tok_nll[mask].sum())
            targets += int(mask.sum())
    assert first["targets"] == targets
    assert abs(first["loss"] - nll / targets) < 1e-4, (first["loss"], nll / targets)


def test_every_sft_forward_runs_without_cudnn_attention_on_cuda(tiny_model_dir, sft_file, tmp_path, monkeypatch):
    """cuDNN attention plans every new shape (docs/gpu.md): the SFT step's forward + backward and the
    validation loss run with cuDNN's kernel off on CUDA, the guard asked about the compute device
    (run here as on CUDA: it only sets flags, which a CPU build has), and the flag is back after."""
    real, devices, seen = main_sft.without_cudnn_attention, [], []

    def as_on_cuda(device):
        devices.append(torch.device(device))
        return real(torch.device("cuda"))

    nll = main_sft.token_nll_sum
    monkeypatch.setattr(main_sft, "without_cudnn_attention", as_on_cuda)
    monkeypatch.setattr(main_sft, "token_nll_sum",
                        lambda model, batch: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or nll(model, batch))
    out = str(tmp_path / "sft_out")
    summary = main_sft.run_sft(main_sft.load_config(_overrides(tiny_model_dir, sft_file, out, **{"trainer.total_epochs": 1})))
    assert summary["steps"] == 2 and len(seen) == 2 * 2   # 2 steps x 2 micro-batches of 2 conversations
    _dataset_loss(out, sft_file)                          # evaluate_loss: 8 conversations in micro-batches of 4
    assert len(seen) == 4 + 2 and not any(seen), seen
    assert devices and set(devices) == {torch.device("cpu")}
    assert torch.backends.cuda.cudnn_sdp_enabled()

"""Model init of the FSDP workers (docs/gpu.md, "Model init"): rank 0 reads the checkpoint, every rank
builds on the meta device and receives only its shard.

Two gloo ranks in fresh processes. Checked against the checkpoint loaded plainly with transformers:
every parameter (gathered) and every buffer — the rotary `inv_freq` is a non-persistent buffer that
`to_empty` leaves as garbage, and a wrong one changes the logits — and the logits of a fixed input.
Memory: peak host RSS per rank during init, against the model's fp32 size.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from test_dp_actor import _free_port


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _init_rank(rank, world, port, model_dir, out_dir, lora_rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from verl_arpo.workers.sharded_model import init_sharded_model, load_causal_lm, shard_fsdp2

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        kw = dict(lora_rank=lora_rank, lora_alpha=16)
        import peft  # noqa: F401  (imports are not the init's memory)
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        _reset_peak_rss()
        before = _rss_bytes()
        torch.manual_seed(123)  # rank 0's LoRA init is the one every rank must end with
        model = init_sharded_model(lambda: load_causal_lm(model_dir, **kw), lambda: load_causal_lm(model_dir, empty=True, **kw),
                                   lambda m: shard_fsdp2(m, mesh), torch.device("cpu"))
        peak = _peak_rss_bytes()
        params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                  for k, v in model.named_parameters()}
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 64]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        if rank == 0:
            torch.save(dict(params=params, buffers=buffers, logits=logits), os.path.join(out_dir, "rank0.pt"))
        with open(os.path.join(out_dir, f"mem{rank}.json"), "w") as f:
            json.dump(dict(before=before, peak=peak), f)
        dist.barrier()  # no rank tears gloo down while the other still talks to it (a rare abort at exit)
    finally:
        dist.destroy_process_group()


def _run(model_dir, out_dir, lora_rank=0):
    import torch.multiprocessing as mp

    mp.start_processes(_init_rank, args=(2, _free_port(), str(model_dir), str(out_dir), lora_rank), nprocs=2,
                       join=True, start_method="spawn")
    return torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_sharded_init_equals_the_checkpoint(tiny_model_dir, tmp_path, lora_rank):
    from transformers import AutoModelForCausalLM

    got = _run(tiny_model_dir, tmp_path, lora_rank)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref_params = dict(ref.named_parameters())
    for name, value in got["params"].items():
        if "lora_" in name:
            continue
        hf = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
        torch.testing.assert_close(value, ref_params[hf].detach(), rtol=0, atol=0, msg=name)
    if lora_rank:  # B = 0 at init, so the adapted model is the base model; A came from rank 0
        lora_b = [v for k, v in got["params"].items() if "lora_B" in k]
        assert lora_b and all(float(v.abs().max()) == 0.0 for v in lora_b)
    for name, value in dict(ref.named_buffers()).items():
        key = name if not lora_rank else "base_model.model." + name
        torch.testing.assert_close(got["buffers"][key], value, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor([[5, 17, 42, 99, 7, 300, 12, 64]])).logits
    torch.testing.assert_close(got["logits"], expected, rtol=1e-5, atol=1e-5)


def test_only_rank_zero_holds_the_full_model_in_host_memory(tmp_path, monkeypatch):
    """A 4-layer model of ~240 MB fp32. Rank 1 must stay far below the model's size (it holds half the
    parameters); rank 0 holds the checkpoint once plus its half."""
    from verl_arpo.utils.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", seed=0, hidden_size=1024, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2, intermediate_size=4096)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(cfg).parameters())
    size = 4 * n_params
    out = tmp_path / "out"
    out.mkdir()
    # glibc returns freed blocks above this size to the OS at once, so RSS shows live memory rather
    # than malloc's retained free lists (the GPU has its caching allocator instead)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    _run(model_dir, out)
    mem = [json.loads((out / f"mem{r}.json").read_text()) for r in range(2)]
    growth = [m["peak"] - m["before"] for m in mem]
    print(f"model {size / 2**20:.0f} MiB fp32; peak RSS growth at init: rank0 {growth[0] / 2**20:.0f} MiB, "
          f"rank1 {growth[1] / 2**20:.0f} MiB")
    assert growth[1] < 0.75 * size, (growth, size)
    assert growth[0] < 2.0 * size, (growth, size)

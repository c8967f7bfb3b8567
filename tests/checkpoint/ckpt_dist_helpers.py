"""Worker bodies for the 2-process FSDP2 checkpoint tests (importable by spawned children).

Each run writes its observations to `out_dir` (rank-0 files: full state dicts, logits; per-rank
JSON: losses, errors) for the test process to check.
"""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import torch

from verl_arpo.single_controller.base import find_free_port

FIXED_INPUT = [[5, 17, 42, 99, 7, 300, 12, 64, 8, 33]]


def free_port() -> int:
    return find_free_port("127.0.0.1")


_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
            "transformers.models.qwen2.modeling_qwen2", "verl_arpo.utils.checkpoint", "ckpt_dist_helpers"]


def run_spawned(fn, args: tuple, world: int, timeout: float = 120.0) -> None:
    """Start `world` fresh processes of fn(rank, world, *args); fail (killing them) on error/timeout.

    Uses the "forkserver" start method with the heavy imports preloaded once in the server: each
    worker is still a new process (no state shared with pytest or a previous run), but does not pay
    the ~4 s of importing torch + transformers again on this loaded 2-core machine.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="forkserver")
    deadline = time.time() + timeout
    while not ctx.join(timeout=1.0):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"spawned workers did not finish within {timeout} s")


def _setup(rank: int, world: int, port: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _build(tiny_dir: str, mesh):
    """FSDP2 tiny Qwen2 (one unit per decoder layer + root), AdamW and a decaying LR schedule."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    return model, opt, sched, AutoTokenizer.from_pretrained(tiny_dir)


def _train_step(model, opt, sched, rank: int, world: int) -> float:
    """One step on a batch drawn from the global RNGs (so resume must restore them)."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (world, 2, 12))[rank]
    ids[:, -1] = random.randrange(3, vocab)  # python RNG matters too
    ids[:, 0] = int(np.random.randint(3, vocab))  # and numpy's
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model.reshard()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=opts).items()}


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(FIXED_INPUT)).logits.clone()
    model.train()
    model.reshard()
    return out


def train_save_continue(rank: int, world: int, port: int, tiny_dir: str, root: str, out_dir: str):
    """Run 1: step 1, export (weights + logits), save + publish step 1, then step 2 (recorded)."""
    import torch.distributed as dist

    from verl_arpo.utils import checkpoint as ck

    mesh = _setup(rank, world, port)
    model, opt, sched, tok = _build(tiny_dir, mesh)
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    loss1 = _train_step(model, opt, sched, rank, world)
    full1, logits1 = _full_state(model), _logits(model)
    if rank == 0:
        torch.save({"state": full1, "logits": logits1}, os.path.join(out_dir, "step1.pt"))
        ck.begin_checkpoint(root, 1)
    dist.barrier()
    staging = ck.staging_dir(root, 1)
    manager = ck.FSDPCheckpointManager(model, opt, sched, processing_class=tok)
    manager.save_checkpoint(os.path.join(staging, "actor"), global_step=1)
    if rank == 0:
        ck.save_dataloader_state(staging, {"epoch": 0, "consumed": 1})
        ck.publish_checkpoint(root, 1, staging)
    dist.barrier()
    loss2 = _train_step(model, opt, sched, rank, world)
    full2 = _full_state(model)
    if rank == 0:
        torch.save(full2, os.path.join(out_dir, "run1_step2.pt"))
    with open(os.path.join(out_dir, f"run1_rank{rank}.json"), "w") as f:
        json.dump({"loss1": loss1, "loss2": loss2, "lr": sched.get_last_lr()}, f)
    dist.destroy_process_group()


def resume_and_step(rank: int, world: int, port: int, tiny_dir: str, root: str, out_dir: str,
                    full_root: str):
    """Run 2: fresh processes resume from the latest checkpoint and take step 2 again.

    Then try to save into `full_root` (a tiny tmpfs): every rank must raise CheckpointSaveError
    (recorded), none may hang.
    """
    import torch.distributed as dist

    from verl_arpo.utils import checkpoint as ck

    mesh = _setup(rank, world, port)
    model, opt, sched, tok = _build(tiny_dir, mesh)
    torch.manual_seed(999)  # different RNG state: the checkpoint must restore the saved one
    random.seed(999)
    np.random.seed(999)
    latest = ck.find_latest_ckpt_path(root)
    manager = ck.FSDPCheckpointManager(model, opt, sched, processing_class=tok)
    manager.load_checkpoint(os.path.join(latest, "actor"))
    data = ck.load_dataloader_state(latest)
    loss2 = _train_step(model, opt, sched, rank, world)
    full2 = _full_state(model)
    if rank == 0:
        torch.save(full2, os.path.join(out_dir, "run2_step2.pt"))
    error = None
    if full_root:
        if rank == 0:
            ck.begin_checkpoint(full_root, 2)
        dist.barrier()
        try:
            manager.save_checkpoint(os.path.join(ck.staging_dir(full_root, 2), "actor"), global_step=2)
        except ck.CheckpointSaveError as e:
            error = str(e)
    with open(os.path.join(out_dir, f"run2_rank{rank}.json"), "w") as f:
        json.dump({"latest": latest, "loss2": loss2, "lr": sched.get_last_lr(), "data": data,
                   "full_error": error}, f)
    dist.destroy_process_group()


def mount_tmpfs(path: str, size: str) -> bool:
    """Mount a tmpfs of `size` at `path` (created); False when that is not possible (not root)."""
    import subprocess

    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                         capture_output=True, text=True)
    return res.returncode == 0


def umount(path: str) -> None:
    import subprocess

    subprocess.run(["umount", "-l", path], check=False, capture_output=True)

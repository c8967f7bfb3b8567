"""Cold-start SFT on multi-turn tool conversations: ``python -m verl_arpo.trainer.main_sft key=value ...``

    python -m verl_arpo.trainer.main_sft model.partial_pretrain=~/.cache/verl_arpo/models/smollm2-135m-instruct \\
        data.train_files=rl_datasets/sft_train.jsonl trainer.default_local_dir=checkpoints/sft
    torchrun --nproc_per_node=2 -m verl_arpo.trainer.main_sft ...      # FSDP2 over 2 processes
    python -m verl_arpo.trainer.main_sft --help                         # print every key and its default

Keys are verl's SFT trainer names (`data.train_files`, `data.micro_batch_size_per_gpu`,
`data.max_length`, `model.partial_pretrain`, `optim.lr`, `trainer.total_epochs`,
`trainer.default_local_dir`, ...), given as OmegaConf dot-list overrides; an unknown key is an
error. `model.path` is accepted as an alias of `model.partial_pretrain`.

Story of one run: read the `conversations` records (sft_data.py) → tokenise every conversation with
the chat template, loss mask 1 on assistant-written tokens only (tool results inside assistant
turns and non-assistant turns are 0) → for each global batch of `data.train_batch_size`
conversations, every rank takes its share, runs micro-batches of `data.micro_batch_size_per_gpu`
and accumulates gradients of

    loss = Σ_{tokens t with mask 1} −log p(x_t | x_<t)  /  (number of mask-1 tokens in the global batch)

(token-mean over the whole global batch, the same whatever the micro-batch split or world size) →
clip the gradient norm, AdamW step (skipped on a non-finite norm), warmup + cosine schedule — the
RL trainer's own mechanics, from verl_arpo/workers/ (sharded_model, optim_step, training_core) → at the end save a plain HF folder
(safetensors, config, generation config, tokenizer) in `trainer.default_local_dir`.

Distribution: a single process trains the plain module. Under torchrun (WORLD_SIZE > 1) the process
group is gloo on CPU / nccl on GPU, every decoder layer and then the root are wrapped with FSDP2
`fully_shard`, and the full state dict is gathered to rank 0 for the save.

Not done: sequence packing, LoRA, resuming from a mid-run checkpoint (runs are minutes long here),
tensor/sequence parallelism.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # before torch loads (libgomp reads it then): how this process's CPU threads wait, and MKL's code
    # path for its fp32 products (utils/threads.py)
    from verl_arpo.utils.threads import cpu_process_env

    os.environ.update(cpu_process_env())

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from verl_arpo.trainer.sft_data import read_records, record_tools, to_messages, tokenize_conversation
from verl_arpo.utils.chat_template import configure_chat_template
from verl_arpo.utils.device import without_cudnn_attention
from verl_arpo.config import OptimConfig
from verl_arpo.workers.optim_step import build_adamw, build_lr_scheduler, clip_grad_and_step
from verl_arpo.workers.sharded_model import load_causal_lm, shard_fsdp2
from verl_arpo.workers.training_core import check_trainable_attention

logger = logging.getLogger("verl_arpo.sft")

DEFAULTS: dict[str, Any] = {
    "data": {
        "train_files": "rl_datasets/sft_train.jsonl",  # .jsonl/.json/.parquet with conversations/messages
        "val_files": None,               # optional: same format; loss reported after every epoch
        "train_batch_size": 16,          # conversations per optimizer step (all ranks together)
        "micro_batch_size_per_gpu": 2,   # conversations per forward/backward on one rank
        "max_length": 1024,              # tokens per conversation after the chat template
        "truncation": "error",           # longer conversations: error | right (cut) | skip (drop)
        "shuffle": True,                 # reshuffle the conversations every epoch
        "apply_chat_template_kwargs": {},  # extra arguments of apply_chat_template (Qwen3: {enable_thinking: false})
        "custom_chat_template": None,    # a Jinja template (or a file with one) replacing the tokenizer's
    },
    "model": {
        "partial_pretrain": None,        # HF model folder to start from (required)
        "path": None,                    # alias of partial_pretrain
        "dtype": "float32",              # float32 | bfloat16 (training parameters)
        "autocast_dtype": None,          # null | bfloat16: compute dtype of forward/backward
                                         # (torch.autocast; parameters and AdamW stay model.dtype)
        "attn_implementation": None,     # null = flash_attention_2 on CUDA when installed, else sdpa
        "enable_gradient_checkpointing": False,
        "trust_remote_code": False,
    },
    "optim": {
        "lr": 1e-5,                      # peak learning rate
        "betas": [0.9, 0.95],
        "weight_decay": 0.01,
        "warmup_steps_ratio": 0.1,       # linear warmup over this fraction of the steps
        "lr_scheduler": "cosine",        # cosine | constant (after warmup)
        "min_lr_ratio": 0.1,             # cosine floor as a fraction of lr
        "clip_grad": 1.0,                # max global gradient norm
    },
    "trainer": {
        "default_local_dir": "checkpoints/sft",  # the final HF folder is written here
        "total_epochs": 1,
        "total_training_steps": None,    # stop early after this many optimizer steps
        "seed": 42,
        "device": "auto",                # auto (cuda if available) | cpu | cuda
        "log_freq": 1,                   # log every N steps (rank 0)
        "project_name": "verl_arpo_sft",  # recorded in sft_meta.json
        "experiment_name": "sft",
    },
}


# --------------------------------------------------------------------------- config
def load_config(overrides: list[str]) -> DictConfig:
    """DEFAULTS merged with `key=value` overrides; unknown keys raise."""
    base = OmegaConf.create(DEFAULTS)
    OmegaConf.set_struct(base, True)
    OmegaConf.set_struct(base.data.apply_chat_template_kwargs, False)  # free-form: the template's own arguments
    try:
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
    except Exception as exc:  # omegaconf's ConfigKeyError / ValidationError
        raise SystemExit(f"main_sft: bad override ({exc}); run with --help for the keys") from None
    if cfg.model.partial_pretrain is None:
        cfg.model.partial_pretrain = cfg.model.path
    if not cfg.model.partial_pretrain:
        raise SystemExit("main_sft: set model.partial_pretrain=<HF model folder> (or model.path=...)")
    if cfg.model.autocast_dtype not in (None, "bfloat16") or cfg.model.dtype not in ("float32", "bfloat16"):
        raise SystemExit("main_sft: model.dtype must be float32|bfloat16 and model.autocast_dtype null|bfloat16")
    if cfg.data.truncation not in ("error", "right", "skip"):
        raise SystemExit(f"main_sft: data.truncation must be error|right|skip, got {cfg.data.truncation!r}")
    return cfg


# --------------------------------------------------------------------------- data
def _resolve(path: Any) -> str:
    """A relative path is taken from the working directory, else from the bundled files."""
    from verl_arpo.utils.resources import resolve_bundled

    return str(resolve_bundled(path))


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised conversations: items {"input_ids", "loss_mask"} (lists of ints)."""

    def __init__(self, files: Any, tokenizer, max_length: int, truncation: str = "error",
                 template_kwargs: dict | None = None):
        files = [_resolve(f) for f in ([files] if isinstance(files, (str, Path)) else list(files))]
        self.items: list[dict[str, list[int]]] = []
        self.skipped = 0
        for rec in read_records(files):
            item = tokenize_conversation(tokenizer, to_messages(rec), max_length, truncation, template_kwargs,
                                         tools=record_tools(rec))
            if item is None or not any(item["loss_mask"][1:]):
                self.skipped += 1
                continue
            self.items.append(item)
        if not self.items:
            raise ValueError(f"no usable conversation in {files}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.items[i]

    def length(self, i: int) -> int:
        """Tokens in conversation i (its micro-batch pads to the longest)."""
        return len(self.items[i]["input_ids"])

    def targets(self, i: int) -> int:
        """Tokens trained on (the first token is never a target)."""
        return sum(self.items[i]["loss_mask"][1:])


def collate(items: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (-100 where no loss)."""
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        ids[r, :n] = torch.tensor(it["input_ids"])
        attn[r, :n] = 1
        m = torch.tensor(it["loss_mask"], dtype=torch.bool)
        labels[r, :n] = torch.where(m, ids[r, :n], torch.full_like(ids[r, :n], -100))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def token_nll_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Σ −log p over tokens whose label is not -100 (labels[t] is predicted from positions < t).

    Only the positions that predict a target go through the output layer (`logits_to_keep` with
    the union of those positions over the batch): with a 49k vocabulary and ~10% of the tokens
    trained, this skips most of the largest matmul and of the logits' memory."""
    labels = batch["labels"][:, 1:]
    keep = (labels != -100).any(0).nonzero().squeeze(-1)  # positions t whose logits predict t + 1
    kwargs = {"logits_to_keep": keep} if _accepts_logits_to_keep(model) else {}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs).logits
    if kwargs:
        labels = labels[:, keep]
    else:
        logits = logits[:, :-1]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def _accepts_logits_to_keep(model) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


# --------------------------------------------------------------------------- distribution
def init_distributed(device_pref: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); starts a process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo")  # CPU sums go over gloo
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def shard_model(model, world: int, device: torch.device):
    """FSDP2 over `world` ranks (training_core.shard_fsdp2: each decoder layer, then the root); a single
    process trains the plain module. Precision stays `model.dtype` / `model.autocast_dtype`."""
    if world == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh

    return shard_fsdp2(model, init_device_mesh(device.type, (world,)))


def _all_reduce_sum(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def full_state_dict(model, world: int) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict (on CPU) on rank 0; None on other ranks."""
    if world == 1:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.get_rank() == 0 else None


# --------------------------------------------------------------------------- training
def optim_config(optim: DictConfig) -> OptimConfig:
    """The SFT `optim` keys (verl's SFT names) as the trainers' OptimConfig, for build_adamw / build_lr_scheduler."""
    return OptimConfig(lr=float(optim.lr), lr_warmup_steps=-1, lr_warmup_steps_ratio=float(optim.warmup_steps_ratio),
                       warmup_style=str(optim.lr_scheduler), min_lr_ratio=float(optim.min_lr_ratio),
                       weight_decay=float(optim.weight_decay), betas=tuple(optim.betas))


def evaluate_loss(model, dataset: SFTDataset, micro: int, pad_id: int, device) -> float:
    """Token-mean loss over a whole dataset (each rank scores its share)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    idx = list(range(rank, len(dataset), world))
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), without_cudnn_attention(device):   # every micro-batch is a new shape
        for s in range(0, len(idx), micro):
            batch = {k: v.to(device) for k, v in collate([dataset[i] for i in idx[s:s + micro]], pad_id).items()}
            total += float(token_nll_sum(model, batch))
            count += int((batch["labels"][:, 1:] != -100).sum())
    model.train()
    return _all_reduce_sum(total, device) / max(1.0, _all_reduce_sum(count, device))


def run_sft(cfg: DictConfig) -> dict[str, Any]:
    """Train and save; returns a summary (also written to <default_local_dir>/sft_meta.json)."""
    from transformers import AutoTokenizer

    rank, world, device = init_distributed(cfg.trainer.device)
    torch.manual_seed(cfg.trainer.seed)
    model_path = os.path.expanduser(str(cfg.model.partial_pretrain))
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    def files(key: str):
        value = cfg.data[key]
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    configure_chat_template(tok, cfg.data.custom_chat_template)  # saved with the model: evaluation renders alike
    kwargs = dict(cfg.data.apply_chat_template_kwargs or {})
    train = SFTDataset(files("train_files"), tok, cfg.data.max_length, cfg.data.truncation, kwargs)
    val = SFTDataset(files("val_files"), tok, cfg.data.max_length, cfg.data.truncation, kwargs) if cfg.data.val_files else None

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(cfg.model.dtype)]
    model = load_causal_lm(model_path, dtype=dtype, attn=cfg.model.attn_implementation,
                           trust_remote_code=cfg.model.trust_remote_code,
                           gradient_checkpointing=cfg.model.enable_gradient_checkpointing).to(device)
    check_trainable_attention(model, device, "model")   # flex_attention has no CPU backward: refuse it by name
    model.config.use_cache = False
    model = shard_model(model, world, device)
    model.train()

    B, micro = int(cfg.data.train_batch_size), int(cfg.data.micro_batch_size_per_gpu)
    if B % world:
        raise SystemExit(f"data.train_batch_size={B} must be divisible by the world size {world}")
    if len(train) < B:
        raise SystemExit(f"data.train_batch_size={B} is larger than the {len(train)} training conversations")
    steps_per_epoch = len(train) // B  # full global batches only: every rank gets the same share
    total = steps_per_epoch * int(cfg.trainer.total_epochs)
    if cfg.trainer.total_training_steps:
        total = min(total, int(cfg.trainer.total_training_steps))
    optim = build_adamw(model.parameters(), optim_config(cfg.optim))
    sched = build_lr_scheduler(optim, optim_config(cfg.optim), total)
    out_dir = Path(os.path.expanduser(str(cfg.trainer.default_local_dir)))
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        logger.info("SFT: %d conversations (%d skipped), %d steps of %d, world %d, device %s",
                    len(train), train.skipped, total, B, world, device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.model.autocast_dtype == "bfloat16"
                else contextlib.nullcontext())
    history: list[dict[str, float]] = []
    step, t_start = 0, time.time()
    order_rng = random.Random(cfg.trainer.seed)
    for epoch in range(int(cfg.trainer.total_epochs)):
        order = list(range(len(train)))
        if cfg.data.shuffle:
            order_rng.shuffle(order)
        for s in range(steps_per_epoch):
            if step >= total:
                break
            t0 = time.time()
            global_batch = order[s * B:(s + 1) * B]
            n_targets = sum(train.targets(i) for i in global_batch)  # every rank knows the whole batch
            # micro-batches of similar lengths pad less (13% fewer tokens on the quickstart's data); the
            # step's gradient is the same: the loss is a sum over the whole batch divided by n_targets
            mine = sorted(global_batch[rank::world], key=train.length)
            nll_sum = 0.0
            for m in range(0, len(mine), micro):
                batch = {k: v.to(device) for k, v in collate([train[i] for i in mine[m:m + micro]], pad_id).items()}
                # cuDNN attention would plan every micro-batch's new shape (docs/gpu.md)
                with without_cudnn_attention(device):
                    with autocast:
                        nll = token_nll_sum(model, batch)
                    # FSDP2 averages gradients over ranks: × world turns that back into the global sum
                    (nll * world / max(1, n_targets)).backward()
                nll_sum += float(nll.detach())
            used_lr = optim.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves on below)
            grad_norm = clip_grad_and_step(model, optim, float(cfg.optim.clip_grad), "sft")
            sched.step()
            step += 1
            rec = {"step": step, "epoch": epoch, "loss": _all_reduce_sum(nll_sum, device) / max(1, n_targets),
                   "grad_norm": grad_norm, "lr": used_lr, "targets": n_targets,
                   "seconds": time.time() - t0}
            history.append(rec)
            if rank == 0 and (step % int(cfg.trainer.log_freq) == 0 or step == total):
                logger.info("step %d/%d epoch %d loss %.4f grad_norm %.3f lr %.2e (%.1fs)", step, total, epoch,
                            rec["loss"], grad_norm, rec["lr"], rec["seconds"])
        if val is not None:
            vloss = evaluate_loss(model, val, micro, pad_id, device)
            history.append({"step": step, "epoch": epoch, "val_loss": vloss})
            if rank == 0:
                logger.info("epoch %d val_loss %.4f", epoch, vloss)
        if step >= total:
            break

    state = full_state_dict(model, world)
    summary = {"steps": step, "train_conversations": len(train), "world_size": world,
               "seconds": round(time.time() - t_start, 1), "history": history,
               "config": OmegaConf.to_container(cfg, resolve=True)}
    if rank == 0:
        save_hf_folder(model_path, state, tok, out_dir, cfg)
        (out_dir / "sft_meta.json").write_text(json.dumps(summary, indent=1) + "\n")
        logger.info("saved %s", out_dir)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


def save_hf_folder(model_path: str, state: dict[str, torch.Tensor], tok, out_dir: Path, cfg: DictConfig) -> None:
    """A plain HF folder: a fresh (unsharded) model with the trained weights, saved as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    config.use_cache = True
    plain = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code,
                                             dtype=next(iter(state.values())).dtype)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"trained state dict does not fit the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if tied:
        plain.tie_weights()
    try:
        plain.generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:
        pass
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print(OmegaConf.to_yaml(OmegaConf.create(DEFAULTS)))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run_sft(load_config(argv))


if __name__ == "__main__":
    main()

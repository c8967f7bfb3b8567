"""The one helper for tests that build an actor, a critic or an agent loop by hand (no trainer): the
typed section from keyword overrides, plus what a worker passes beside it — for the actor and critic
the per-worker batching a run derives (`JobConfig.derived`) for one worker and rollout.n = 1, so that
the section's batch sizes are the worker's own; for the agent loop its call limit and seed."""
from __future__ import annotations

from contextlib import contextmanager

from verl_arpo.config import (ActorConfig, Batching, CriticConfig, RolloutSection, from_mapping,
                              kl_term_active)


def actor_kwargs(**keys) -> dict:
    """`DataParallelPPOActor(**actor_kwargs(...), actor_module=..., ...)`: config, update, use_kl_loss."""
    cfg = from_mapping(ActorConfig, keys, "actor_rollout_ref.actor")
    return dict(config=cfg, update=Batching.for_update(cfg, 1, 1),
                use_kl_loss=kl_term_active(cfg.use_kl_loss, cfg.kl_loss_coef))


def critic_kwargs(**keys) -> dict:
    """`DataParallelPPOCritic(**critic_kwargs(...), critic_module=..., ...)`: config, update, values."""
    cfg = from_mapping(CriticConfig, keys, "critic")
    return dict(config=cfg, update=Batching.for_update(cfg, 1, 1), values=Batching.for_values(cfg, 1))


def log_probs(micro_batch: int = 8, use_dynamic_bsz: bool = False, max_token_len: int = 16384) -> Batching:
    """A log-prob pass's micro-batching (the YAML's log_prob_* defaults)."""
    return Batching(micro_batch=micro_batch, use_dynamic_bsz=use_dynamic_bsz, max_token_len=max_token_len)


def rollout(call_limit: int | None = None, seed: int | None = None, **keys) -> tuple[RolloutSection, dict]:
    """The agent loop's arguments: the typed rollout section from keyword overrides, and the
    `call_limit` and `seed` keywords a worker passes (default: the section's tools.call_limit and seed).
    `AgentLoop(engine, tok, executor, cfg, **kw)` / `build_agent_loop(mode, ..., cfg, **kw)`."""
    cfg = from_mapping(RolloutSection, keys, "actor_rollout_ref.rollout")
    return cfg, dict(call_limit=cfg.tools.call_limit if call_limit is None else call_limit,
                     seed=cfg.seed if seed is None else seed)


@contextmanager
def gloo_rank_counting(rank: int, world: int, port: int, owner, name: str):
    """A spawned rank of a multi-process FSDP test: one torch thread, a gloo process group on 127.0.0.1:port,
    and `owner.name` (e.g. FSDP2's foreach_all_gather) wrapped to count its calls. Yields {"n": calls};
    restores the function and destroys the group on exit."""
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls = {"n": 0}
    real = getattr(owner, name)

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    setattr(owner, name, counted)
    try:
        yield calls
        # both ranks finish before either tears its group down: gloo aborted a rank whose peer had already
        # left (SIGABRT, "terminate called without an active exception", ~1 run in 6 on 2 cores)
        dist.barrier()
    finally:
        setattr(owner, name, real)
        dist.destroy_process_group()


def rank_share(data_path, rank: int, world: int):
    """A multi-process FSDP test's share: (the CPU device mesh over `world` gloo ranks, rank's contiguous
    slice of the batch saved at `data_path`, the slice's row count)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    full = torch.load(data_path, weights_only=False)
    half = len(full) // world
    return init_device_mesh("cpu", (world,)), full.slice(rank * half, (rank + 1) * half), half

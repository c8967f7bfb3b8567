"""Ulysses sequence parallelism: the process groups and the differentiable collectives
(docs/sequence_parallel.md).

    SequenceParallel          one rank's place in the (dp, sp) mesh: its sp group and its dp group
    build_sequence_parallel   the mesh for `ulysses_sequence_parallel_size` = S (every rank calls it)
    seq_all_to_all            scatter one dimension and gather another across the sp group (autograd)
    gather_slots              each rank's values at its own slots → the values at every slot (autograd)

The mesh is (dp, sp), row-major like verl's: ranks r = d·S + s, so the S ranks of a data-parallel
replica are neighbours (on one node their all-to-all stays inside the node). FSDP keeps sharding the
parameters over the whole world; only the data and the loss counts see the (dp, sp) split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SequenceParallel", "build_sequence_parallel", "seq_all_to_all", "gather_slots"]


@dataclass(frozen=True)
class SequenceParallel:
    """One rank's view of the (dp, sp) mesh.

    size: S, the ranks that split one sequence; rank: this rank's place among them (0..S−1);
    group: their process group. dp_size / dp_group: the data-parallel replicas (ranks with the same
    sp rank): loss counts and micro-batch counts are reduced over these, so each sp group's data
    counts once. With S = 1 both groups are None (the default group is the data-parallel one).
    """

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1


def build_sequence_parallel(size: int, device_type: str = "cpu") -> SequenceParallel:
    """The (dp, sp) mesh with sp = `size`; a collective call: every rank of the world makes it.
    Without torch.distributed, or with size 1, the trivial layout (no groups)."""
    size = int(size)
    if size < 1:
        raise ValueError(f"ulysses_sequence_parallel_size must be >= 1, got {size}")
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    if world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the {world} ranks "
                         "(trainer.nnodes × trainer.n_gpus_per_node)")
    if size == 1:
        return SequenceParallel(dp_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "sp"))
    return SequenceParallel(size=size, rank=mesh.get_local_rank("sp"), group=mesh.get_group("sp"),
                            dp_size=world // size, dp_group=mesh.get_group("dp"))


# --------------------------------------------------------------------------------------------
# all-to-all: heads ↔ sequence
# --------------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, sp: SequenceParallel, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x in S chunks along `scatter_dim`, send chunk j to sp rank j, and concatenate what
    arrives (in sp-rank order) along `gather_dim`."""
    inp = torch.stack([c.contiguous() for c in x.chunk(sp.size, dim=scatter_dim)])
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=sp.group)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp, scatter_dim, gather_dim):
        ctx.sp, ctx.dims = sp, (scatter_dim, gather_dim)
        return _all_to_all(x, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims  # the inverse exchange routes each gradient to its owner
        return _all_to_all(grad, ctx.sp, gather_dim, scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, sp: SequenceParallel, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Ulysses' exchange, differentiable: with x [.., H, n, ..] holding all heads of this rank's n
    tokens, scatter_dim = heads and gather_dim = sequence give H/S heads of all S·n tokens (before
    attention); the reverse dims undo it (after attention). `scatter_dim`'s size must divide by S."""
    if x.shape[scatter_dim] % sp.size:
        raise ValueError(f"seq_all_to_all: dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split "
                         f"over {sp.size} ranks")
    return _SeqAllToAll.apply(x, sp, scatter_dim, gather_dim)


# --------------------------------------------------------------------------------------------
# per-slot outputs back on every rank
# --------------------------------------------------------------------------------------------
class _GatherSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, owner, sp):
        counts = torch.bincount(owner, minlength=sp.size).tolist()
        width = max(counts)
        buf = local.new_zeros((width, *local.shape[1:]))
        buf[: local.shape[0]] = local
        parts = [torch.empty_like(buf) for _ in range(sp.size)]
        dist.all_gather(parts, buf, group=sp.group)
        out = local.new_empty((owner.numel(), *local.shape[1:]))
        for r, part in enumerate(parts):
            out[owner == r] = part[: counts[r]]
        ctx.sp = sp
        ctx.save_for_backward(owner)
        return out

    @staticmethod
    def backward(ctx, grad):
        (owner,) = ctx.saved_tensors
        # Every rank of the group computes the same loss from the gathered values, so each keeps
        # the gradient of its own slots only; ×S because FSDP averages gradients over all dp·S
        # ranks while the group's S ranks hold one replica's objective between them
        # (docs/sequence_parallel.md, "Gradients").
        return grad[owner == ctx.sp.rank] * ctx.sp.size, None, None


def gather_slots(local: torch.Tensor, owner: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The values at all K slots, on every rank of the sp group, from each rank's values at its own.

    owner [K]: which sp rank computed slot k (every rank passes the same owner); local [K_r, ...]:
    this rank's values at the slots it owns, in slot order. Returns [K, ...] in slot order.
    Differentiable: the backward keeps this rank's slots (scaled by S, see `_GatherSlots.backward`)."""
    if not sp.enabled:
        return local
    return _GatherSlots.apply(local, owner, sp)

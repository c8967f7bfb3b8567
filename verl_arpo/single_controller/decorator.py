"""``@register`` and the dispatch modes: how one driver call becomes one call per rank, and back.

A worker method decorated with ``@register(dispatch_mode=...)`` is bound onto the worker group by
name (``wg.generate_sequences(batch)``). The group asks :func:`plan_call` for a :class:`CallPlan`
(which ranks to call, with which arguments, and how to collect the answers), runs it, and returns
``plan.collect(outputs)``. This module knows nothing of Ray, so dispatching is unit-testable.

=============================  ================================================  ==========================
mode                           each rank gets                                    the driver gets
=============================  ================================================  ==========================
``ONE_TO_ALL``                 the same arguments                                list, one result per rank
``ALL_TO_ALL``                 ``args[j][rank]``: every argument is a list with  list, one result per rank
                               one entry per rank
``RANK_ZERO``                  the arguments; only rank 0 is called              rank 0's result
``DP_COMPUTE_PROTO``           its chunk of every ``DataProto`` argument         the chunks' outputs
                               (padded to a multiple of the world size)          concatenated, padding
                                                                                 removed (see below)
``DP_COMPUTE_PROTO_WITH_FUNC`` the first argument (a function) as is, the rest   as ``DP_COMPUTE_PROTO``
                               like ``DP_COMPUTE_PROTO``
=============================  ================================================  ==========================

Padding, and outputs with more rows than inputs. ``pad_dataproto_to_divisor`` appends copies of the
first rows, so the padding sits at the end of the last chunk(s). For each rank we know how many of
its ``m`` input rows are padding (``p``); if its output has ``k * m`` rows (``k`` = 1 for log-probs,
``n`` for a rollout returning ``n`` trajectories per prompt, 0 for a metrics-only answer), the last
``p * k`` output rows are dropped. This needs each input row's outputs to be contiguous and in input
order (``DataProto.repeat(n, interleave=True)`` order); a rank with padding whose output row count is
not a multiple of ``m`` is an error, because we could not tell which rows to drop.

How this differs from verl:

- Non-``DataProto`` arguments of the DP modes are sent unchanged to every rank (verl requires all
  arguments to be ``DataProto``); all ``DataProto`` arguments must have the same number of rows.
- Padding is always on (verl only pads when ``auto_padding`` is set in ``meta_info``) and is removed
  per rank, so the ``k``-rows-per-input case and padding spanning several chunks come out right.
- If no rank returns a ``DataProto`` the DP modes return the list of outputs; mixing ``DataProto``
  and other outputs is an error.
- ``register`` does not wrap the function: it only tags it, so calling it inside the worker is a
  plain method call. A subclass that overrides a registered method must register it again.
- Not provided: the Megatron modes (``MEGATRON_*``), ``DP_COMPUTE`` / ``DP_COMPUTE_METRIC``,
  ``DIRECT_ROLLOUT_METHOD``, custom dispatch dicts, ``execute_mode`` and ``materialize_futures``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

# verl_arpo.protocol (torch, tensordict) is imported where DataProto is needed, not here: a worker
# process unpickling a registered method's tag then does not pay for it.

__all__ = ["CallPlan", "Dispatch", "DISPATCH_ATTR", "MethodSpec", "bind_group_methods", "get_method_spec", "plan_call",
           "register"]

DISPATCH_ATTR = "__verl_arpo_dispatch__"


class Dispatch(Enum):
    """How a registered method's arguments go to the ranks and its results come back."""

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` stored on a method."""

    dispatch_mode: Dispatch
    blocking: bool = True


def _as_dispatch(mode: Any) -> Dispatch:
    if isinstance(mode, Dispatch):
        return mode
    if isinstance(mode, str):
        for member in Dispatch:
            if mode.upper() == member.name or mode.lower() == member.value:
                return member
    valid = ", ".join(f"Dispatch.{m.name}" for m in Dispatch)
    raise ValueError(f"unknown dispatch mode {mode!r}; valid modes: {valid}")


def register(dispatch_mode: Dispatch | str | Callable = Dispatch.ALL_TO_ALL, blocking: bool = True):
    """Tag a worker method so worker groups bind it with the given dispatch mode.

    ``dispatch_mode`` is a :class:`Dispatch` member or its name (``"DP_COMPUTE_PROTO"``); anything
    else raises ``ValueError`` listing the valid modes. ``blocking=False`` makes the group method
    return a pending call whose ``.get()`` waits and collects. ``@register`` without parentheses
    uses the default mode (``ALL_TO_ALL``, as in verl).
    """
    if callable(dispatch_mode) and not isinstance(dispatch_mode, (Dispatch, str)):
        return register()(dispatch_mode)  # bare @register
    spec = MethodSpec(_as_dispatch(dispatch_mode), bool(blocking))

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"@register must decorate a function, got {type(fn).__name__}")
        setattr(fn, DISPATCH_ATTR, spec)
        return fn

    return decorate


def get_method_spec(obj: Any) -> MethodSpec | None:
    """The :class:`MethodSpec` stored by ``@register`` on ``obj`` (a function or method), or ``None``."""
    spec = getattr(obj, DISPATCH_ATTR, None)
    return spec if isinstance(spec, MethodSpec) else None


def bind_group_methods(group: Any, worker_cls: type, run: Callable[[str, MethodSpec, CallPlan], Any]) -> None:
    """Make every ``@register``-ed method of ``worker_cls`` a method of ``group``: ``group.name(*args)``
    plans the call at ``group.world_size`` (:func:`plan_call`) and returns ``run(name, spec, plan)``,
    which runs and collects it (Ray actors, or the worker in this process). A name the group itself
    already has is an error: the group's own method would be shadowed."""
    for name in dir(worker_cls):
        spec = get_method_spec(getattr(worker_cls, name, None))
        if spec is None:
            continue
        if name in vars(group) or hasattr(type(group), name):
            raise ValueError(f"{worker_cls.__name__}.{name}: a registered method cannot shadow "
                             f"{type(group).__name__}.{name}")
        setattr(group, name, _group_method(group, worker_cls, name, spec, run))


def _group_method(group: Any, worker_cls: type, name: str, spec: MethodSpec, run: Callable) -> Callable:
    def group_method(*args: Any, **kwargs: Any) -> Any:
        return run(name, spec, plan_call(spec.dispatch_mode, group.world_size, args, kwargs))

    group_method.__name__ = name
    group_method.__qualname__ = f"{type(group).__name__}.{name}"
    group_method.__doc__ = f"[{spec.dispatch_mode.name}] {getattr(worker_cls, name).__doc__ or ''}"
    return group_method


# ------------------------------------------------------------------------------------------------
# call plans
# ------------------------------------------------------------------------------------------------


@dataclass
class CallPlan:
    """One call per entry of ``ranks`` with ``args[i]`` / ``kwargs[i]``; ``collect`` turns the list of
    outputs (in ``ranks`` order) into the driver's result."""

    ranks: list[int]
    args: list[tuple]
    kwargs: list[dict]
    collect: Callable[[list], Any]


def _as_list(outputs: list) -> list:
    return list(outputs)


def _plan_one_to_all(world_size: int, args: tuple, kwargs: dict) -> CallPlan:
    ranks = list(range(world_size))
    return CallPlan(ranks, [args] * world_size, [kwargs] * world_size, _as_list)


def _plan_rank_zero(world_size: int, args: tuple, kwargs: dict) -> CallPlan:
    return CallPlan([0], [args], [kwargs], lambda outputs: outputs[0])


def _plan_all_to_all(world_size: int, args: tuple, kwargs: dict) -> CallPlan:
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"ALL_TO_ALL: {name} must be a list with one entry per rank ({world_size}), got {got}")
    per_args = [tuple(a[r] for a in args) for r in range(world_size)]
    per_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(world_size)]
    return CallPlan(list(range(world_size)), per_args, per_kwargs, _as_list)


def _plan_dp(world_size: int, args: tuple, kwargs: dict, mode_name: str) -> CallPlan:
    from verl_arpo.protocol import DataProto, pad_dataproto_to_divisor

    protos = [v for v in (*args, *kwargs.values()) if isinstance(v, DataProto)]
    if not protos:
        raise ValueError(f"{mode_name}: needs at least one DataProto argument")
    n = len(protos[0])
    if any(len(p) != n for p in protos):
        raise ValueError(f"{mode_name}: all DataProto arguments must have the same number of rows, got {[len(p) for p in protos]}")

    chunks: dict[int, list[DataProto]] = {}  # id(original) -> its chunks
    pad_size = 0
    for p in protos:
        if id(p) not in chunks:
            padded, pad_size = pad_dataproto_to_divisor(p, world_size)
            chunks[id(p)] = padded.chunk(world_size)
    rows = (n + pad_size) // world_size
    # chunk r holds global rows [r*rows, (r+1)*rows); those >= n are padding
    pads = [min(rows, max(0, (r + 1) * rows - n)) for r in range(world_size)]

    def pick(value: Any, r: int) -> Any:
        return chunks[id(value)][r] if isinstance(value, DataProto) else value

    per_args = [tuple(pick(a, r) for a in args) for r in range(world_size)]
    per_kwargs = [{k: pick(v, r) for k, v in kwargs.items()} for r in range(world_size)]

    def collect(outputs: list) -> Any:
        return collect_dp_outputs(outputs, rows, pads, mode_name)

    return CallPlan(list(range(world_size)), per_args, per_kwargs, collect)


def collect_dp_outputs(outputs: list, rows: int, pads: list[int], mode_name: str = "DP_COMPUTE_PROTO") -> Any:
    """Concatenate per-rank ``DataProto`` outputs, dropping ``pads[r] * k_r`` trailing rows of rank
    ``r``'s output where ``k_r = len(output) / rows`` (see module docstring)."""
    from verl_arpo.protocol import DataProto, unpad_dataproto

    is_proto = [isinstance(o, DataProto) for o in outputs]
    if not any(is_proto):
        return list(outputs)
    if not all(is_proto):
        kinds = [type(o).__name__ for o in outputs]
        raise TypeError(f"{mode_name}: ranks returned a mix of DataProto and other values: {kinds}")
    kept = []
    for r, (out, pad) in enumerate(zip(outputs, pads)):
        if pad:
            if len(out) % rows:
                raise ValueError(
                    f"{mode_name}: rank {r} got {rows} rows ({pad} of them padding) and returned {len(out)} rows; "
                    f"with padding a rank must return k rows per input row (k an integer, each row's outputs "
                    f"contiguous) so the padding's outputs can be dropped. Send a batch whose size is a multiple "
                    f"of the world size to avoid padding."
                )
            out = unpad_dataproto(out, pad * (len(out) // rows))
        kept.append(out)
    return DataProto.concat(kept)


def _plan_dp_with_func(world_size: int, args: tuple, kwargs: dict) -> CallPlan:
    if not args or not callable(args[0]):
        raise ValueError("DP_COMPUTE_PROTO_WITH_FUNC: the first positional argument must be a function")
    rest = _plan_dp(world_size, args[1:], kwargs, "DP_COMPUTE_PROTO_WITH_FUNC")
    rest.args = [(args[0], *a) for a in rest.args]
    return rest


_PLANNERS: dict[Dispatch, Callable[[int, tuple, dict], CallPlan]] = {
    Dispatch.ONE_TO_ALL: _plan_one_to_all,
    Dispatch.ALL_TO_ALL: _plan_all_to_all,
    Dispatch.RANK_ZERO: _plan_rank_zero,
    Dispatch.DP_COMPUTE_PROTO: lambda w, a, k: _plan_dp(w, a, k, "DP_COMPUTE_PROTO"),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: _plan_dp_with_func,
}


def plan_call(dispatch_mode: Dispatch | str, world_size: int, args: tuple = (), kwargs: dict | None = None) -> CallPlan:
    """The :class:`CallPlan` for calling a method registered with ``dispatch_mode`` on ``world_size``
    ranks with ``args`` / ``kwargs``."""
    mode = _as_dispatch(dispatch_mode)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _PLANNERS[mode](world_size, tuple(args), dict(kwargs or {}))

"""Single controller: one driver process drives groups of workers (one Ray actor per rank).

- :mod:`.base` — ``Worker``, the base class of worker processes (rank, world size, process group).
- :mod:`.decorator` — ``@register`` and ``Dispatch``: how a driver call is split over the ranks
  and how the answers are put back together.
- :mod:`.ray` — ``RayResourcePool`` (placement groups), ``RayClassWithInitArgs``,
  ``RayWorkerGroup`` (the actors, bound methods, failure reporting).

The names below are imported lazily, so a process that only needs :mod:`.base` (the start-up
probe task) does not import torch or Ray through this package.
"""

__all__ = ["Dispatch", "Worker", "register"]


def __getattr__(name: str):
    if name == "Worker":
        from verl_arpo.single_controller.base import Worker

        return Worker
    if name in ("Dispatch", "register"):
        from verl_arpo.single_controller import decorator

        return getattr(decorator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

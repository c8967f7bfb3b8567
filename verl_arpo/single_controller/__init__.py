"""Single controller: one driver process drives groups of workers (one Ray actor per rank).

- :mod:`.base` — ``Worker``, the base class of worker processes (rank, world size, process group).
- :mod:`.decorator` — ``@register`` and ``Dispatch``: how a driver call is split over the ranks
  and how the answers are put back together.
- :mod:`.ray` — ``RayResourcePool`` (placement groups), ``RayClassWithInitArgs``,
  ``RayWorkerGroup`` (the actors, bound methods, failure reporting). Imported lazily: importing
  this package does not import Ray.
"""

from verl_arpo.single_controller.base import Worker
from verl_arpo.single_controller.decorator import Dispatch, register

__all__ = ["Dispatch", "Worker", "register"]

"""Ray back end of the single controller: resource pools and worker groups.

``from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup``
(the same names as verl's ``verl.single_controller.ray``).
"""

from verl_arpo.single_controller.ray.base import (
    PendingCall,
    RayClassWithInitArgs,
    RayWorkerGroup,
    WorkerGroupError,
    WorkerGroupTimeoutError,
)
from verl_arpo.single_controller.ray.resource_pool import RayResourcePool

__all__ = [
    "PendingCall",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "WorkerGroupError",
    "WorkerGroupTimeoutError",
]

"""The four interfaces an engine implements. Plugins import from here or ``laminar_core``."""

from laminar_core.interfaces.build import BuildContext, build
from laminar_core.interfaces.repack import RepackPolicy
from laminar_core.interfaces.rollout import ReplicaFailure, RolloutEngine
from laminar_core.interfaces.trainer import TrainerContext, TrainerEngine
from laminar_core.interfaces.transport import Alloc, TransportError, WeightTransport

__all__ = [
    "Alloc",
    "BuildContext",
    "RepackPolicy",
    "ReplicaFailure",
    "RolloutEngine",
    "TrainerContext",
    "TrainerEngine",
    "TransportError",
    "WeightTransport",
    "build",
]

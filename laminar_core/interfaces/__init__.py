"""The interfaces an engine (or environment) implements. Plugins import from here or
``laminar_core``."""

from laminar_core.interfaces.build import BuildContext, build
from laminar_core.interfaces.environment import (
    EnvContext,
    EnvFailure,
    Environment,
    EnvUnavailable,
    Episode,
    StepResult,
    ToolCall,
    ToolCallParser,
)
from laminar_core.interfaces.inflight import InFlightTrajectories, LiveTrajectory
from laminar_core.interfaces.repack import RepackPolicy
from laminar_core.interfaces.rollout import ReplicaFailure, RolloutEngine
from laminar_core.interfaces.scratch import ShmScratch, shm_files_of
from laminar_core.interfaces.trainer import (
    TrainerContext,
    TrainerEngine,
    TrainerFailure,
    iterate_in_thread,
    to_device,
)
from laminar_core.interfaces.transport import Alloc, TransportError, WeightTransport
from laminar_core.interfaces.weights import (
    ModelOnly,
    SharedVersionGone,
    SharedWeights,
    TensorWeights,
    WeightsRef,
)

__all__ = [
    "Alloc",
    "BuildContext",
    "EnvContext",
    "EnvFailure",
    "EnvUnavailable",
    "Environment",
    "Episode",
    "InFlightTrajectories",
    "LiveTrajectory",
    "ModelOnly",
    "RepackPolicy",
    "ReplicaFailure",
    "RolloutEngine",
    "SharedVersionGone",
    "SharedWeights",
    "ShmScratch",
    "StepResult",
    "TensorWeights",
    "ToolCall",
    "ToolCallParser",
    "TrainerContext",
    "TrainerEngine",
    "TrainerFailure",
    "TransportError",
    "WeightTransport",
    "WeightsRef",
    "build",
    "iterate_in_thread",
    "shm_files_of",
    "to_device",
]

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
from laminar_core.interfaces.repack import RepackPolicy
from laminar_core.interfaces.rollout import ReplicaFailure, RolloutEngine
from laminar_core.interfaces.trainer import TrainerContext, TrainerEngine
from laminar_core.interfaces.transport import Alloc, TransportError, WeightTransport

__all__ = [
    "Alloc",
    "BuildContext",
    "EnvContext",
    "EnvFailure",
    "EnvUnavailable",
    "Environment",
    "Episode",
    "RepackPolicy",
    "ReplicaFailure",
    "RolloutEngine",
    "StepResult",
    "ToolCall",
    "ToolCallParser",
    "TrainerContext",
    "TrainerEngine",
    "TransportError",
    "WeightTransport",
    "build",
]

"""Laminar core: trajectory-level asynchronous RL post-training for LLMs.

The public API that plugins and users import. Everything not re-exported here (or in
``laminar_core.interfaces``) is internal and may change.

The names load on first use (PEP 562 ``__getattr__``): ``import laminar_core`` or any
``laminar_core.X`` submodule costs only what that submodule imports, so a process that needs
no torch (the CLI before it starts Ray, a relay resolving its config) does not import torch,
transformers or the agent gateway for names it never reads. ``from laminar_core import X``
works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers and IDEs see them
    from laminar_core.algorithms import AlgorithmConfig
    from laminar_core.config import ConfigError, LaminarConfig, ResolvedConfig
    from laminar_core.envs import EnvConfig, make_environment, make_parser
    from laminar_core.interfaces import (
        Alloc,
        BuildContext,
        EnvContext,
        EnvFailure,
        Environment,
        EnvUnavailable,
        Episode,
        InFlightTrajectories,
        LiveTrajectory,
        ModelOnly,
        RepackPolicy,
        ReplicaFailure,
        RolloutEngine,
        SharedVersionGone,
        SharedWeights,
        ShmScratch,
        StepResult,
        TensorWeights,
        ToolCall,
        ToolCallParser,
        TrainerContext,
        TrainerEngine,
        TrainerFailure,
        TransportError,
        WeightsRef,
        WeightTransport,
        iterate_in_thread,
        shm_files_of,
        to_device,
    )
    from laminar_core.interfaces.weights import load_shared
    from laminar_core.models import build_tiny_model, model_dir
    from laminar_core.net import free_port
    from laminar_core.plugins import PluginManager, hookimpl
    from laminar_core.relay import WeightIntegrityError, unpack
    from laminar_core.relay.packing import checksum as bucket_checksum
    from laminar_core.relay.wire import HEADER_BYTES as BUCKET_HEADER_BYTES
    from laminar_core.relay.wire import decode_bucket_header, encode_bucket_header
    from laminar_core.runtime.resolve import load_config
    from laminar_core.tasks import (
        DataError,
        DataReport,
        Response,
        RewardError,
        build_prompts,
        build_reward,
        response_of,
    )
    from laminar_core.text import encode_untrusted
    from laminar_core.training import (
        BatchLayout,
        MicroBatch,
        ModelTrainerEngine,
        add_logprob_agreement,
    )
    from laminar_core.types import (
        Bucket,
        EngineStats,
        FinishReason,
        GenerationRequest,
        Group,
        Move,
        PartialTrajectory,
        ReplicaState,
        SamplingParams,
        TensorSpec,
        TrainBatch,
        Trajectory,
        WeightManifest,
    )

# public name -> (module, attribute in it)
_LAZY: dict[str, tuple[str, str]] = {
    "AlgorithmConfig": ("laminar_core.algorithms", "AlgorithmConfig"),
    "ConfigError": ("laminar_core.config", "ConfigError"),
    "LaminarConfig": ("laminar_core.config", "LaminarConfig"),
    "ResolvedConfig": ("laminar_core.config", "ResolvedConfig"),
    "EnvConfig": ("laminar_core.envs", "EnvConfig"),
    "make_environment": ("laminar_core.envs", "make_environment"),
    "make_parser": ("laminar_core.envs", "make_parser"),
    "Alloc": ("laminar_core.interfaces", "Alloc"),
    "BuildContext": ("laminar_core.interfaces", "BuildContext"),
    "EnvContext": ("laminar_core.interfaces", "EnvContext"),
    "EnvFailure": ("laminar_core.interfaces", "EnvFailure"),
    "Environment": ("laminar_core.interfaces", "Environment"),
    "EnvUnavailable": ("laminar_core.interfaces", "EnvUnavailable"),
    "Episode": ("laminar_core.interfaces", "Episode"),
    "InFlightTrajectories": ("laminar_core.interfaces", "InFlightTrajectories"),
    "LiveTrajectory": ("laminar_core.interfaces", "LiveTrajectory"),
    "ModelOnly": ("laminar_core.interfaces", "ModelOnly"),
    "RepackPolicy": ("laminar_core.interfaces", "RepackPolicy"),
    "ReplicaFailure": ("laminar_core.interfaces", "ReplicaFailure"),
    "RolloutEngine": ("laminar_core.interfaces", "RolloutEngine"),
    "SharedVersionGone": ("laminar_core.interfaces", "SharedVersionGone"),
    "SharedWeights": ("laminar_core.interfaces", "SharedWeights"),
    "ShmScratch": ("laminar_core.interfaces", "ShmScratch"),
    "StepResult": ("laminar_core.interfaces", "StepResult"),
    "TensorWeights": ("laminar_core.interfaces", "TensorWeights"),
    "ToolCall": ("laminar_core.interfaces", "ToolCall"),
    "ToolCallParser": ("laminar_core.interfaces", "ToolCallParser"),
    "TrainerContext": ("laminar_core.interfaces", "TrainerContext"),
    "TrainerEngine": ("laminar_core.interfaces", "TrainerEngine"),
    "TrainerFailure": ("laminar_core.interfaces", "TrainerFailure"),
    "TransportError": ("laminar_core.interfaces", "TransportError"),
    "WeightsRef": ("laminar_core.interfaces", "WeightsRef"),
    "WeightTransport": ("laminar_core.interfaces", "WeightTransport"),
    "iterate_in_thread": ("laminar_core.interfaces", "iterate_in_thread"),
    "to_device": ("laminar_core.interfaces", "to_device"),
    "shm_files_of": ("laminar_core.interfaces", "shm_files_of"),
    "load_shared": ("laminar_core.interfaces.weights", "load_shared"),
    "build_tiny_model": ("laminar_core.models", "build_tiny_model"),
    "model_dir": ("laminar_core.models", "model_dir"),
    "free_port": ("laminar_core.net", "free_port"),
    "PluginManager": ("laminar_core.plugins", "PluginManager"),
    "hookimpl": ("laminar_core.plugins", "hookimpl"),
    "WeightIntegrityError": ("laminar_core.relay", "WeightIntegrityError"),
    "unpack": ("laminar_core.relay", "unpack"),
    "bucket_checksum": ("laminar_core.relay.packing", "checksum"),
    "BUCKET_HEADER_BYTES": ("laminar_core.relay.wire", "HEADER_BYTES"),
    "decode_bucket_header": ("laminar_core.relay.wire", "decode_bucket_header"),
    "encode_bucket_header": ("laminar_core.relay.wire", "encode_bucket_header"),
    "load_config": ("laminar_core.runtime.resolve", "load_config"),
    "DataError": ("laminar_core.tasks", "DataError"),
    "DataReport": ("laminar_core.tasks", "DataReport"),
    "Response": ("laminar_core.tasks", "Response"),
    "RewardError": ("laminar_core.tasks", "RewardError"),
    "build_prompts": ("laminar_core.tasks", "build_prompts"),
    "build_reward": ("laminar_core.tasks", "build_reward"),
    "response_of": ("laminar_core.tasks", "response_of"),
    "encode_untrusted": ("laminar_core.text", "encode_untrusted"),
    "BatchLayout": ("laminar_core.training", "BatchLayout"),
    "MicroBatch": ("laminar_core.training", "MicroBatch"),
    "ModelTrainerEngine": ("laminar_core.training", "ModelTrainerEngine"),
    "add_logprob_agreement": ("laminar_core.training", "add_logprob_agreement"),
    "Bucket": ("laminar_core.types", "Bucket"),
    "EngineStats": ("laminar_core.types", "EngineStats"),
    "FinishReason": ("laminar_core.types", "FinishReason"),
    "GenerationRequest": ("laminar_core.types", "GenerationRequest"),
    "Group": ("laminar_core.types", "Group"),
    "Move": ("laminar_core.types", "Move"),
    "PartialTrajectory": ("laminar_core.types", "PartialTrajectory"),
    "ReplicaState": ("laminar_core.types", "ReplicaState"),
    "SamplingParams": ("laminar_core.types", "SamplingParams"),
    "TensorSpec": ("laminar_core.types", "TensorSpec"),
    "TrainBatch": ("laminar_core.types", "TrainBatch"),
    "Trajectory": ("laminar_core.types", "Trajectory"),
    "WeightManifest": ("laminar_core.types", "WeightManifest"),
}

__version__ = "0.1.0"

__all__ = [
    "BUCKET_HEADER_BYTES",
    "AlgorithmConfig",
    "Alloc",
    "BatchLayout",
    "Bucket",
    "BuildContext",
    "ConfigError",
    "DataError",
    "DataReport",
    "EngineStats",
    "EnvConfig",
    "EnvContext",
    "EnvFailure",
    "EnvUnavailable",
    "Environment",
    "Episode",
    "FinishReason",
    "GenerationRequest",
    "Group",
    "InFlightTrajectories",
    "LaminarConfig",
    "LiveTrajectory",
    "MicroBatch",
    "ModelOnly",
    "ModelTrainerEngine",
    "Move",
    "PartialTrajectory",
    "PluginManager",
    "RepackPolicy",
    "ReplicaFailure",
    "ReplicaState",
    "ResolvedConfig",
    "Response",
    "RewardError",
    "RolloutEngine",
    "SamplingParams",
    "SharedVersionGone",
    "SharedWeights",
    "ShmScratch",
    "StepResult",
    "TensorSpec",
    "TensorWeights",
    "ToolCall",
    "ToolCallParser",
    "TrainBatch",
    "TrainerContext",
    "TrainerEngine",
    "TrainerFailure",
    "Trajectory",
    "TransportError",
    "WeightIntegrityError",
    "WeightManifest",
    "WeightTransport",
    "WeightsRef",
    "__version__",
    "add_logprob_agreement",
    "bucket_checksum",
    "build_prompts",
    "build_reward",
    "build_tiny_model",
    "decode_bucket_header",
    "encode_bucket_header",
    "encode_untrusted",
    "free_port",
    "hookimpl",
    "iterate_in_thread",
    "load_config",
    "load_shared",
    "make_environment",
    "make_parser",
    "model_dir",
    "response_of",
    "shm_files_of",
    "to_device",
    "unpack",
]


def __getattr__(name: str) -> Any:
    """Import a public name on first use and keep it in this module."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'laminar_core' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

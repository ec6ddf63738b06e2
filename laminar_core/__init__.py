"""Laminar core: trajectory-level asynchronous RL post-training for LLMs.

The public API that plugins and users import. Everything not re-exported here (or in
``laminar_core.interfaces``) is internal and may change.
"""

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
    "to_device",
    "unpack",
]

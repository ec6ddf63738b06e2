"""Events, metrics and the files of a run directory."""

from laminar_core.telemetry.events import EventLog, MetricsWriter
from laminar_core.telemetry.rollouts import ROLLOUTS_FILE, RolloutDump
from laminar_core.telemetry.tensorboard import TENSORBOARD_DIR, TensorBoardSink
from laminar_core.telemetry.wandb import WandbSink

__all__ = [
    "ROLLOUTS_FILE",
    "TENSORBOARD_DIR",
    "EventLog",
    "MetricsWriter",
    "RolloutDump",
    "TensorBoardSink",
    "WandbSink",
]

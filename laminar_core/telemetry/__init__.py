"""Events, metrics and the files of a run directory."""

from laminar_core.telemetry.events import (
    EVENTS_FILE,
    SCHEMA_VERSION,
    Event,
    EventFile,
    EventLog,
    EventsError,
    read_events,
)
from laminar_core.telemetry.metrics import MetricsWriter
from laminar_core.telemetry.rollouts import ROLLOUTS_FILE, RolloutDump
from laminar_core.telemetry.tensorboard import TENSORBOARD_DIR, TensorBoardSink
from laminar_core.telemetry.wandb import WandbSink

__all__ = [
    "EVENTS_FILE",
    "ROLLOUTS_FILE",
    "SCHEMA_VERSION",
    "TENSORBOARD_DIR",
    "Event",
    "EventFile",
    "EventLog",
    "EventsError",
    "MetricsWriter",
    "RolloutDump",
    "TensorBoardSink",
    "WandbSink",
    "read_events",
]

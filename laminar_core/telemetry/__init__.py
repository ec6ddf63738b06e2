"""Events, metrics and the files of a run directory."""

from laminar_core.telemetry.events import EventLog, MetricsWriter

__all__ = ["EventLog", "MetricsWriter"]

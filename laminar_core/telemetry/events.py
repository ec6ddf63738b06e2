"""Timestamped events from every component, and the files they end up in.

Recording is an append of a tuple (it sits on the per-trajectory hot path); formatting
happens once, when a sink writes the run directory.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class EventLog:
    """``record(t, kind, actor, duration=0.0, **fields)``; ``enabled=False`` keeps counts only."""

    enabled: bool = True
    events: list[tuple[float, str, str, float, dict[str, Any]]] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)

    def record(self, t: float, kind: str, actor: str, duration: float = 0.0, **fields: Any) -> None:
        self.counts[kind] += 1
        if self.enabled:
            self.events.append((t, kind, actor, duration, fields))

    def write_chrome_trace(self, path: str | Path) -> None:
        """A Chrome-trace / Perfetto timeline: one row per actor, spans for timed events."""
        actors: dict[str, int] = {}
        out = []
        for t, kind, actor, dur, fields in self.events:
            tid = actors.setdefault(actor, len(actors) + 1)
            ev = {"name": kind, "ts": t * 1e6, "pid": 1, "tid": tid, "args": fields}
            if dur > 0:
                ev.update(ph="X", dur=dur * 1e6, ts=(t - dur) * 1e6)
            else:
                ev.update(ph="i", s="t")
            out.append(ev)
        meta = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": actor}}
            for actor, tid in actors.items()
        ]
        Path(path).write_text(json.dumps({"traceEvents": meta + out}))

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for t, kind, actor, dur, fields in self.events:
                f.write(
                    json.dumps({"t": t, "kind": kind, "actor": actor, "duration": dur, **fields})
                    + "\n"
                )


class MetricsWriter:
    """One JSON object per trainer step in ``metrics.jsonl``, flushed as it goes.

    Each row also goes to ``on_row`` (e.g. console progress) and to every sink added with
    :meth:`add_sink` (e.g. TensorBoard); ``close()`` closes sinks that have a ``close``.
    """

    def __init__(self, path: str | Path | None) -> None:
        self._f = open(path, "a") if path else None  # noqa: SIM115 - lives as long as the run
        self.rows: list[dict[str, Any]] = []
        self.on_row: Callable[[dict[str, Any]], None] | None = None  # e.g. console progress
        self.sinks: list[Callable[[dict[str, Any]], None]] = []

    def add_sink(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.sinks.append(sink)

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        for sink in self.sinks:
            sink(row)
        if self._f is not None:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
        self.sinks = []

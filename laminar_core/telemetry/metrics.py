"""``metrics.jsonl``: one JSON object per trainer step, and the sinks that see each row."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


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

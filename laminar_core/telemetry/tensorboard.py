"""TensorBoard sink: each metrics row's numbers as scalars under ``RUN_DIR/tensorboard/``.

Uses ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package, which pulls
no torch of its own). Optional: when the package is missing the sink logs one warning and
does nothing, so a run never fails for want of TensorBoard.

Hook it to a :class:`~laminar_core.telemetry.metrics.MetricsWriter` with
``metrics.add_sink(TensorBoardSink(run_dir / "tensorboard"))``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("laminar.telemetry")

TENSORBOARD_DIR = "tensorboard"  # under the run directory


def scalars(row: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(tag, value)`` for every finite number in ``row``; nested dicts become ``a/b`` tags.

    Strings, lists and non-finite numbers are left out (TensorBoard scalars are numbers).
    """
    for key, value in row.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, f"{tag}/")
        elif isinstance(value, (int, float)) and math.isfinite(value):  # bools too, as 0/1
            yield tag, float(value)


class TensorBoardSink:
    """A metrics sink (``sink(row)``) writing TensorBoard event files to ``log_dir``.

    The x axis is ``row[step_key]`` (the trainer step); rows without it use a running count.
    ``enabled`` is ``False`` when TensorBoard is not installed (then calls are no-ops).
    """

    def __init__(self, log_dir: str | Path, step_key: str = "step", flush_secs: int = 10) -> None:
        self.log_dir = Path(log_dir)
        self.step_key = step_key
        self._count = 0
        self._writer: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning(
                "TensorBoard logging is off: the tensorboard package is not installed "
                "(pip install tensorboard, or set telemetry.tensorboard=false)"
            )
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def __call__(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            return
        step = row.get(self.step_key)
        step = int(step) if isinstance(step, (int, float)) else self._count
        self._count += 1
        for tag, value in scalars(row):
            if tag != self.step_key:
                self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value), ...]`` from the event files in ``log_dir`` (tests, reports)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

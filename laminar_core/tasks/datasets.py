"""Local dataset files (JSONL, Parquet) read into rows, with bad rows skipped and counted.

A *row* is a ``dict`` with at least ``"prompt": str`` plus any metadata the reward needs
(``"answer"``, ...). Reading never dies on one bad row: it is skipped, counted in the
:class:`DataReport` under its cause, and logged with ``file:line``. A file that is missing,
unreadable or has no good row at all raises :class:`DataError` naming the fix.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar_core.config.loader import ConfigError

log = logging.getLogger("laminar.tasks")

#: Bad rows logged one by one per file; the rest only counted (a broken file must not flood).
MAX_ROW_WARNINGS = 5


class DataError(ConfigError):
    """A dataset that cannot feed a run; the message names the file, the cause and the fix."""


@dataclass
class DataReport:
    """What reading and tokenising a dataset kept and skipped.

    ``rows``: rows kept; ``skipped``: rows dropped; ``reasons``: cause -> count of dropped rows.
    """

    source: str = ""
    rows: int = 0
    skipped: int = 0
    reasons: Counter = field(default_factory=Counter)

    def skip(self, reason: str, where: str = "") -> None:
        """Count one dropped row; log it (``where`` is ``file:line``) while under the limit."""
        self.skipped += 1
        self.reasons[reason] += 1
        if self.skipped <= MAX_ROW_WARNINGS:
            log.warning("%s: skipped bad row: %s", where or self.source, reason)
        elif self.skipped == MAX_ROW_WARNINGS + 1:
            log.warning("%s: more bad rows; counting the rest without a message", self.source)

    def summary(self) -> str:
        """One line: ``"data.jsonl: 98 rows, 2 skipped (missing prompt key 'prompt': 2)"``."""
        text = f"{self.source}: {self.rows} rows, {self.skipped} skipped"
        if self.reasons:
            text += " (" + ", ".join(f"{r}: {n}" for r, n in self.reasons.most_common()) + ")"
        return text


def check_row(row: Any, prompt_key: str) -> str | None:
    """Why ``row`` cannot be a prompt row (``None`` when it can)."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, not an object"
    if prompt_key not in row:
        return f"missing prompt key {prompt_key!r}"
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        return f"prompt {prompt_key!r} is a {type(prompt).__name__}, not a string"
    if not prompt.strip():
        return f"empty prompt {prompt_key!r}"
    return None


def _existing(path: str | Path, fmt: str) -> Path:
    p = Path(path).expanduser()
    if not str(path):
        raise DataError(f"data.source={fmt} needs a file: set data.path=/path/to/data.{fmt}")
    if not p.exists():
        raise DataError(f"data.path: {fmt} file {p} not found; fix data.path")
    if p.is_dir():
        raise DataError(f"data.path: {p} is a directory; point data.path at a .{fmt} file")
    return p


def _finish(rows: list[dict[str, Any]], report: DataReport, prompt_key: str) -> list[dict]:
    report.rows = len(rows)
    if not rows:
        causes = ", ".join(f"{r}: {n}" for r, n in report.reasons.most_common(3))
        raise DataError(
            f"data.path: {report.source} has no usable rows"
            + (f" ({report.skipped} bad: {causes})" if report.skipped else " (it is empty)")
            + f"; each row needs a non-empty string under data.prompt_key={prompt_key!r}"
        )
    return rows


def read_jsonl(path: str | Path, prompt_key: str = "prompt") -> tuple[list[dict], DataReport]:
    """Rows of a JSON-lines file (one object per line; blank lines ignored)."""
    p = _existing(path, "jsonl")
    report = DataReport(str(p))
    rows: list[dict[str, Any]] = []
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed below; bytes so one bad line is one bad row
    except OSError as e:
        raise DataError(f"data.path: cannot read {p} ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                report.skip("not UTF-8 text", where)
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                report.skip(f"invalid JSON ({e.msg})", where)
                continue
            bad = check_row(row, prompt_key)
            if bad:
                report.skip(bad, where)
                continue
            rows.append(row)
    return _finish(rows, report, prompt_key), report


def read_parquet(path: str | Path, prompt_key: str = "prompt") -> tuple[list[dict], DataReport]:
    """Rows of a Parquet file (needs ``pyarrow``); ``file:N`` in messages is the row number."""
    p = _existing(path, "parquet")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"data.source=parquet needs pyarrow to read {p}: pip install pyarrow"
        ) from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a corrupt/non-parquet file
        raise DataError(f"data.path: cannot read {p} as Parquet ({e})") from None
    report = DataReport(str(p))
    if prompt_key not in table.column_names:
        raise DataError(
            f"data.path: {p} has no column {prompt_key!r} (columns: "
            f"{', '.join(table.column_names)}); set data.prompt_key to the prompt column"
        )
    rows: list[dict[str, Any]] = []
    for i, row in enumerate(_iter_rows(table), 1):
        bad = check_row(row, prompt_key)
        if bad:
            report.skip(bad, f"{p}:row {i}")
            continue
        rows.append(row)
    return _finish(rows, report, prompt_key), report


def _iter_rows(table: Any) -> Iterator[dict[str, Any]]:
    for batch in table.to_batches():
        yield from batch.to_pylist()


def iter_task_rows(rows: Iterable[Any], prompt_key: str, source: str) -> tuple[list, DataReport]:
    """Check rows produced in memory (a procedural task), with the same skip-and-count rules."""
    report = DataReport(source)
    kept = []
    for i, row in enumerate(rows):
        bad = check_row(row, prompt_key)
        if bad:
            report.skip(bad, f"{source}[{i}]")
            continue
        kept.append(row)
    return _finish(kept, report, prompt_key), report

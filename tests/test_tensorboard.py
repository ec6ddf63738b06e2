"""The TensorBoard sink: numeric metrics become readable scalars under RUN_DIR/tensorboard/."""

from __future__ import annotations

import builtins
import logging
from pathlib import Path

import pytest

from laminar_core.telemetry import MetricsWriter, TensorBoardSink
from laminar_core.telemetry.tensorboard import scalars

pytest.importorskip("tensorboard")


def test_scalars_flattens_and_keeps_only_finite_numbers() -> None:
    row = {"step": 3, "reward": 0.5, "ok": True, "name": "x", "nan": float("nan"), "v": {"r0": 2}}
    assert dict(scalars(row)) == {"step": 3.0, "reward": 0.5, "ok": 1.0, "v/r0": 2.0}


def test_metrics_rows_are_written_and_readable(tmp_path: Path) -> None:
    from laminar_core.telemetry.tensorboard import read_scalars

    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    seen: list[dict] = []
    metrics.on_row = seen.append
    sink = TensorBoardSink(tmp_path / "tensorboard")
    metrics.add_sink(sink)
    for step in range(3):
        metrics.write({"step": step, "reward_mean": step / 10, "replica_versions": {"r0": step}})
    metrics.close()
    assert len(seen) == 3 and not sink.enabled  # closed with the writer
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    got = read_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in got["reward_mean"]] == [0, 1, 2]
    assert [round(v, 3) for _, v in got["reward_mean"]] == [0.0, 0.1, 0.2]
    assert [v for _, v in got["replica_versions/r0"]] == [0.0, 1.0, 2.0]
    assert "step" not in got


def test_missing_tensorboard_warns_once_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with caplog.at_level(logging.WARNING, logger="laminar.telemetry"):
        sink = TensorBoardSink(tmp_path / "tb")
    assert not sink.enabled
    assert "pip install tensorboard" in caplog.text and len(caplog.records) == 1
    sink({"step": 0, "reward_mean": 1.0})  # a no-op, no error
    sink.close()
    assert not (tmp_path / "tb").exists()

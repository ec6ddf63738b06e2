"""``laminar train`` on the real clock: run directory layout and metrics rows."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from laminar_core.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_train_writes_run_directory(tmp_path: Path, capsys) -> None:
    rc = main(
        [
            "train",
            str(ROOT / "examples/train_sim_tiny.yaml"),
            f"run.out_dir={tmp_path}",
            "run.steps=3",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    run_dirs = list(tmp_path.iterdir())
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert f"run directory: {run_dir}" in out
    assert {"config.yaml", "metrics.jsonl", "events.jsonl", "trace.json"} <= {
        p.name for p in run_dir.iterdir()
    }
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["run"]["steps"] == 3 and cfg["rollout"]["sim"]["decode_step_s"] == 0.001
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("reward_mean", "samples_per_second", "staleness_max", "wall_seconds"):
            assert key in r
        assert r["trajectories"] == 32 and r["samples_per_second"] > 0
    assert rows[0]["wall_seconds"] < rows[1]["wall_seconds"] < rows[2]["wall_seconds"]
    trace = json.loads((run_dir / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"trajectory", "train_step", "weight_push"} <= names

"""``laminar train`` on the real clock: run directory layout and metrics rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
    assert not (run_dir / "rollouts.jsonl").exists()  # only with run.dump_rollouts
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


def _checkpoints(tmp_path: Path, every: int, steps: int) -> list[str]:
    rc = main(
        [
            "train",
            str(ROOT / "examples/train_sim_tiny.yaml"),
            f"run.out_dir={tmp_path}",
            f"run.steps={steps}",
            f"run.checkpoint_every={every}",
            "telemetry.progress=false",
        ]
    )
    assert rc == 0
    (run_dir,) = list(tmp_path.iterdir())
    ckpts = run_dir / "checkpoints"
    return sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []


def test_checkpoint_every_n_steps_and_at_the_end(tmp_path: Path) -> None:
    assert _checkpoints(tmp_path, 2, 5) == ["latest", "step_000002", "step_000004", "step_000005"]


def test_checkpoint_every_minus_one_writes_none(tmp_path: Path) -> None:
    assert _checkpoints(tmp_path, -1, 3) == []


def test_resume_from_a_sim_run_continues_at_its_step(tmp_path: Path, capsys) -> None:
    first = tmp_path / "a"
    _checkpoints(first, 2, 2)
    (run_dir,) = list(first.iterdir())
    rc = main(
        [
            "train",
            str(ROOT / "examples/train_sim_tiny.yaml"),
            f"run.out_dir={tmp_path / 'b'}",
            "run.steps=4",
            f"run.resume={run_dir}",
            "telemetry.progress=false",
        ]
    )
    assert rc == 0
    assert "resumed from" in capsys.readouterr().out
    (resumed,) = list((tmp_path / "b").iterdir())
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path: Path, capsys) -> None:
    rc = main(
        [
            "train",
            str(ROOT / "examples/train_sim_tiny.yaml"),
            f"run.out_dir={tmp_path}",
            f"run.resume={tmp_path / 'nowhere'}",
        ]
    )
    assert rc == 2
    assert "no checkpoint there" in capsys.readouterr().err


def test_dump_rollouts_writes_every_trained_trajectory_once(tmp_path: Path) -> None:
    rc = main(
        [
            "train",
            str(ROOT / "examples/train_sim_tiny.yaml"),
            f"run.out_dir={tmp_path}",
            "run.steps=3",
            "run.dump_rollouts=true",
            "telemetry.progress=false",
        ]
    )
    assert rc == 0
    (run_dir,) = list(tmp_path.iterdir())
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    per_group = cfg["data"]["samples_per_prompt"]
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len({r["traj_id"] for r in rows}) == len(rows)  # none written twice
    for m in metrics:  # every trained trajectory of the step, as the step counted them
        mine = [r for r in rows if r["step"] == m["step"]]
        assert len(mine) == m["trajectories"]
        assert {r["weight_version"] for r in mine} == {m["weight_version"]}
        rewards = [r["reward"] for r in mine if r["reward"] is not None]
        assert (sum(rewards) / len(rewards) if rewards else None) == pytest.approx(m["reward_mean"])
        groups: dict[str, list[dict]] = {}
        for r in mine:
            groups.setdefault(r["group_id"], []).append(r)
        assert {len(g) for g in groups.values()} == {per_group}
        for g in groups.values():  # a group is one prompt's samples
            assert len({(r["prompt_index"], tuple(r["prompt_ids"])) for r in g}) == 1
        for r in mine:
            assert len(r["logprobs"]) == len(r["response_ids"])
            assert r["finish_reason"] in ("stop", "length")
            assert max(r["versions"]) < m["weight_version"]

"""Tests for the ``laminar`` command (``laminar_core.cli.main``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from laminar_core.cli import main
from laminar_core.telemetry.events import TrajectoryDone, WeightPush, read_events

TINY = [
    "run.steps=3",
    "cluster.gpus=8",
    "cluster.trainer_gpus=2",
    "data.prompts_per_step=8",
    "data.samples_per_prompt=4",
    "rollout.max_tokens=4096",
    "rollout.sim.lengths.median=400",
]
ROW_KEYS = {
    "schedule",
    "throughput_tokens_per_s",
    "rollout_utilization",
    "trainer_idle_share",
    "staleness_mean",
    "staleness_max",
    "repacks",
    "sim_seconds",
    "wall_seconds",
}


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text("run:\n  name: tiny\n  seed: 3\n")
    return p


def simulate(cfg: Path, out: Path, *extra: str) -> list[dict]:
    assert main(["simulate", str(cfg), *TINY, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("laminar: error: ")
    return lines[0]


def test_plugins_lists_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    rows = {tuple(line.split()[:3]) for line in capsys.readouterr().out.splitlines()[1:]}
    expected = {
        ("trainer", "sim"),
        ("rollout", "sim"),
        ("transport", "sim"),
        ("transport", "inprocess"),
        ("repack", "best_fit"),
        ("repack", "none"),
        ("schedule", "sync"),
        ("schedule", "one_step"),
        ("schedule", "stale"),
        ("schedule", "laminar"),
    }
    for kind, name in expected:
        assert (kind, name, "laminar-core") in rows, (kind, name)


def test_config_show_prints_override(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["config", "show", str(cfg_file), "run.steps=17", "rollout.sim.roofline_batch=9"]) == 0
    )
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["run"]["steps"] == 17
    assert shown["run"]["name"] == "tiny"  # from the file
    assert shown["rollout"]["sim"]["roofline_batch"] == 9
    assert shown["schedule"] == "laminar"


def test_simulate_writes_rows_and_is_deterministic(
    cfg_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = simulate(cfg_file, tmp_path / "a.json")
    assert [r["schedule"] for r in first] == ["laminar", "sync", "one_step", "stale:2"]
    for row in first:
        assert set(row) >= ROW_KEYS, ROW_KEYS - set(row)
        assert row["throughput_tokens_per_s"] > 0
        assert row["sim_seconds"] > 0
        assert 0 <= row["rollout_utilization"] <= 1
        assert 0 <= row["trainer_idle_share"] <= 1
    by_name = {r["schedule"]: r for r in first}
    assert by_name["sync"]["staleness_max"] == 0
    assert by_name["one_step"]["staleness_max"] <= 1
    assert by_name["stale:2"]["staleness_max"] <= 2
    out = capsys.readouterr().out
    assert "tokens/s" in out  # the table
    assert str(tmp_path / "a.json") in out

    second = simulate(cfg_file, tmp_path / "b.json")

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]

    assert strip(first) == strip(second)


def test_simulate_seed_changes_results(cfg_file: Path, tmp_path: Path) -> None:
    a = simulate(cfg_file, tmp_path / "a.json", "--schedules", "laminar")
    b = simulate(cfg_file, tmp_path / "b.json", "run.seed=4", "--schedules", "laminar")
    assert a[0]["sim_seconds"] != b[0]["sim_seconds"]


def test_simulate_schedules_restricts(cfg_file: Path, tmp_path: Path) -> None:
    rows = simulate(cfg_file, tmp_path / "r.json", "--schedules", "laminar,sync")
    assert [r["schedule"] for r in rows] == ["laminar", "sync"]


def test_malformed_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  steps: [1\n")
    assert main(["simulate", str(bad)]) == 2
    line = one_error_line(capsys)
    assert str(bad) in line and "malformed YAML" in line


def test_config_show_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in one_error_line(capsys)


def test_unknown_schedule_option(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(cfg_file), *TINY, "--schedules", "laminar,warp"]) == 2
    line = one_error_line(capsys)
    assert "'warp'" in line and "sync" in line
    assert capsys.readouterr().out == ""  # nothing ran


def test_unknown_schedule_override(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(cfg_file), *TINY, "schedule=warp"]) == 2
    assert "'warp'" in one_error_line(capsys)


def test_negative_batch_size(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(cfg_file), *TINY, "data.prompts_per_step=-4"]) == 2
    assert "data.prompts_per_step" in one_error_line(capsys)


def test_unknown_engine_option(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(cfg_file), "rollout.sim.decode_stepp_s=1"]) == 2
    assert "rollout.sim.decode_stepp_s" in one_error_line(capsys)


def test_unknown_lengths_kind(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(cfg_file), *TINY, "rollout.sim.lengths.kind=gauss"]) == 2
    assert "gauss" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("lengths.csv", "length,count\n100,3\n200;4\n"),
        ("lengths.json", '{"lengths": [100, 200], "counts": [1]}'),
        ("lengths.json", "{not json"),
    ],
)
def test_unparsable_length_histogram(
    cfg_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    hist = tmp_path / name
    hist.write_text(text)
    argv = [
        "simulate",
        str(cfg_file),
        *TINY,
        "rollout.sim.lengths.kind=histogram",
        f"rollout.sim.lengths.file={hist}",
    ]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert str(hist) in line and "length histogram" in line


def test_simulate_without_out_writes_json_to_a_run_directory(
    cfg_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    argv = ["simulate", str(cfg_file), *TINY, f"run.out_dir={runs}", "--schedules", "sync"]
    assert main(argv) == 0
    (run_dir,) = runs.iterdir()
    rows = json.loads((run_dir / "simulate.json").read_text())
    assert [r["schedule"] for r in rows] == ["sync"]
    assert (run_dir / "config.yaml").exists()
    assert f"wrote {run_dir / 'simulate.json'}" in capsys.readouterr().out


def test_simulate_trace_keeps_the_study_numbers(cfg_file: Path, tmp_path: Path) -> None:
    plain = simulate(cfg_file, tmp_path / "a.json", "--schedules", "laminar,sync")
    trace = tmp_path / "t" / "trace.json"
    traced = simulate(
        cfg_file, tmp_path / "b.json", "--schedules", "laminar,sync", "--trace", str(trace)
    )

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]

    assert strip(traced) == strip(plain)
    info = json.loads((trace.parent / "trace_info.json").read_text())
    assert info["schedule"] == "laminar"  # the first schedule by default
    assert info["row"] == traced[0]
    events = read_events(trace.parent / "events.jsonl").events
    assert events and events[0].kind in {"trajectory", "wait_data", "repack"}
    assert len((trace.parent / "metrics.jsonl").read_text().splitlines()) == traced[0]["steps"]
    assert json.loads(trace.read_text())["traceEvents"]


def test_simulate_trace_schedule_picks_the_traced_run(
    cfg_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t" / "sync.json"
    argv = ["--schedules", "laminar,sync", "--trace", str(trace), "--trace-schedule", "sync"]
    rows = simulate(cfg_file, tmp_path / "r.json", *argv)
    info = json.loads((trace.parent / "trace_info.json").read_text())
    assert info["schedule"] == "sync" and info["row"] == rows[1]
    assert yaml.safe_load((trace.parent / "config.yaml").read_text())["schedule"] == "sync"
    events = read_events(trace.parent / "events.jsonl")
    pushes = sorted(e.t for e in events.of(WeightPush))
    # sync: every trajectory finishes while the trainer still holds its generating version
    for e in events.of(TrajectoryDone):
        assert sum(t <= e.t for t in pushes) == e.version
    assert f"laminar report {trace.parent}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--trace-schedule", "sync"], "--trace-schedule needs --trace FILE"),
        (["--trace", "{tmp}/t.json", "--trace-schedule", "sink"], "'sink' is not one of"),
        (["--trace", "{tmp}/metrics.jsonl"], "one of the files written next to it"),
        (["--trace", "{tmp}/run/trace.json"], "holds another run's metrics.jsonl"),
    ],
)
def test_simulate_trace_bad_arguments(
    cfg_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    expected: str,
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    extra = [x.replace("{tmp}", str(tmp_path)) for x in extra]
    argv = ["simulate", str(cfg_file), *TINY, "--schedules", "laminar,sync", *extra]
    assert main(argv) == 2
    assert expected in one_error_line(capsys)
    assert capsys.readouterr().out == ""  # nothing ran
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 0}\n'

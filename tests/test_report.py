"""``laminar report``, ``laminar simulate --trace`` and the Weights & Biases sink.

One real-clock run of ``examples/train_sim_tiny.yaml`` and one traced simulated study are
shared by the module; partial run directories are cut from copies of them.
"""

from __future__ import annotations

import builtins
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from laminar_core import load_config
from laminar_core.cli import main
from laminar_core.telemetry import report as rep
from laminar_core.telemetry.events import (
    SCHEMA_VERSION,
    EventLog,
    EventsError,
    RepackMove,
    TrajectoryDone,
    WaitData,
    read_events,
)
from laminar_core.testing.audit import audit_run

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "train_sim_tiny.yaml"
QUIET = ["telemetry.progress=false", "telemetry.tensorboard=false"]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def check_report(report: rep.Report, expected: set[str]) -> str:
    """Every expected plot exists at its pixel size and the page shows each; returns the page."""
    names = {p.stem for p in report.images}
    assert names == expected, names
    page = report.index.read_text()
    for img in report.images:
        assert img.parent == report.out_dir and img.stat().st_size > 10_000, img
        assert png_size(img) == rep.FIGURE_PIXELS[img.stem], img
        assert f'src="{img.name}"' in page
    assert page.count("<img ") == len(report.images)
    return page


def figures(page: str) -> dict[str, str]:
    import re

    return dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", page))


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished real-clock run of the tiny example (simulated engines, about a second)."""
    from laminar_core.runtime.train import train

    out = tmp_path_factory.mktemp("runs")
    return train(load_config(str(TINY), [f"run.out_dir={out}", "run.steps=6", *QUIET]))


@pytest.fixture(scope="module")
def study_trace(tmp_path_factory: pytest.TempPathFactory, small_overrides: list[str]) -> Path:
    """The directory of ``laminar simulate --trace`` for a small long-tailed study."""

    d = tmp_path_factory.mktemp("study")
    cfg = d / "study.yaml"
    cfg.write_text("run: {name: study}\n")
    argv = ["simulate", str(cfg), *small_overrides, "--schedules", "laminar,sync"]
    argv += ["--trace", str(d / "trace" / "trace.json"), "--out", str(d / "rows.json")]
    assert main(argv) == 0
    return d / "trace"


def copy_run(src: Path, dst: Path, *files: str) -> Path:
    dst.mkdir()
    for name in files:
        shutil.copy(src / name, dst / name)
    return dst


# -- full reports ----------------------------------------------------------------------------


def test_report_of_a_real_clock_run(sim_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(sim_run)]) == 0
    out = sim_run / "report"
    captured = capsys.readouterr()
    assert f"wrote {out / 'index.html'}" in captured.out and "timeline.png" in captured.out
    report = rep.Report(out, out / "index.html", sorted(out.glob("*.png")), [], 0.0)
    page = check_report(report, {"throughput", "staleness", "timeline", "trainer", "weight_sync"})
    # the simulated engines score nothing: no reward plot, and the page and stderr say why
    assert "laminar report: note: no reward_mean" in captured.err
    assert "no reward_mean" in page
    got = figures(page)
    rows = [json.loads(line) for line in (sim_run / "metrics.jsonl").read_text().splitlines()]
    assert got["trainer steps"] == "6" == str(len(rows))
    assert got["schedule"] == "laminar"
    moves = read_events(sim_run / "events.jsonl").of(RepackMove)
    assert got["repack moves"].startswith(f"{len(moves):,} ")
    assert all(len(e.ids) == e.n for e in moves)  # each move names what it moved
    stale_max = max(r["staleness_max"] for r in rows)
    assert got["staleness mean / max"].endswith(f"/ {stale_max}")
    assert "simulated" not in got["run time"]


def test_reward_and_eval_reward_are_plotted_when_logged(sim_run: Path, tmp_path: Path) -> None:
    d = copy_run(sim_run, tmp_path / "run", "config.yaml", "events.jsonl")
    rows = [json.loads(line) for line in (sim_run / "metrics.jsonl").read_text().splitlines()]
    with open(d / "metrics.jsonl", "w") as f:
        for i, row in enumerate(rows):
            row["reward_mean"] = 0.1 * i
            if i % 2:
                row["eval_reward"] = 0.05 * i
            f.write(json.dumps(row) + "\n")
    report = rep.write_report(d, tmp_path / "out")
    page = check_report(
        report, {"reward", "throughput", "staleness", "timeline", "trainer", "weight_sync"}
    )
    got = figures(page)
    assert got["final reward_mean"].startswith(f"{0.1 * (len(rows) - 1):.4f}")
    assert got["final eval_reward"].startswith(f"{0.05 * (len(rows) - 1):.4f}")
    assert not (d / "report").exists()  # --out elsewhere


def test_report_of_a_simulated_study_trace(study_trace: Path) -> None:
    info = json.loads((study_trace / "trace_info.json").read_text())
    assert info["schedule"] == "laminar" and info["clock"] == "virtual"
    report = rep.write_report(study_trace)
    page = check_report(report, {"throughput", "staleness", "timeline", "trainer", "weight_sync"})
    got = figures(page)
    row = info["row"]
    assert got["trainer steps"] == str(row["steps"])
    # the page's counts cover the whole run; the study's row starts after the warm-up
    moves = read_events(study_trace / "events.jsonl").of(RepackMove)
    assert got["repack moves"].startswith(f"{len(moves):,} ") and row["repacks"] <= len(moves)
    metrics = [json.loads(x) for x in (study_trace / "metrics.jsonl").read_text().splitlines()]
    whole_max = max(m["staleness_max"] for m in metrics)
    assert got["staleness mean / max"].endswith(f"/ {whole_max}")
    assert row["staleness_max"] <= whole_max
    assert got["tokens/s after warm-up (study)"] == f"{row['throughput_tokens_per_s']:,.0f}"
    assert got["run time"].endswith("on the simulated clock")


# -- partial and bad inputs ------------------------------------------------------------------


def test_a_run_killed_before_writing_events(sim_run: Path, tmp_path: Path) -> None:
    d = copy_run(sim_run, tmp_path / "run", "config.yaml", "metrics.jsonl")
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "weight_ver')  # killed mid-write
    report = rep.write_report(d)
    page = check_report(report, {"throughput", "staleness", "trainer", "weight_sync"})
    assert any(n.startswith("events.jsonl is missing") for n in report.notes)
    assert any("metrics.jsonl: 1 unreadable line" in n for n in report.notes)
    assert "events.jsonl is missing" in page
    assert figures(page)["trainer steps"] == "6"


def test_events_without_metrics(sim_run: Path, tmp_path: Path) -> None:
    d = copy_run(sim_run, tmp_path / "run", "events.jsonl")
    report = rep.write_report(d)
    check_report(report, {"staleness", "timeline", "trainer", "weight_sync"})
    assert any(n.startswith("metrics.jsonl is missing") for n in report.notes)
    assert any(n.startswith("config.yaml is missing") for n in report.notes)
    # the per-step table came from the trainer's events: same steps, same stalls
    rows = [json.loads(line) for line in (sim_run / "metrics.jsonl").read_text().splitlines()]
    table = rep.step_table(rep.load_run(d))
    assert table is not None and table.source == "events.jsonl"
    assert table.step.tolist() == [r["step"] for r in rows]
    np.testing.assert_allclose(table.stall, [r["stall_seconds"] for r in rows], atol=1e-9)
    np.testing.assert_allclose(table.wait, [r["wait_seconds"] for r in rows], atol=1e-9)


def test_a_run_that_stopped_before_its_first_step(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("")
    report = rep.write_report(d)
    assert report.images == []
    assert any("no steps" in n for n in report.notes)
    assert "no steps" in report.index.read_text()


def test_stale_plots_of_an_earlier_report_are_removed(sim_run: Path, tmp_path: Path) -> None:
    d = copy_run(sim_run, tmp_path / "run", "config.yaml", "metrics.jsonl")
    (d / "report").mkdir()
    (d / "report" / "timeline.png").write_bytes(b"an earlier report's timeline")
    report = rep.write_report(d)
    assert not (d / "report" / "timeline.png").exists()
    assert "timeline.png" not in report.index.read_text()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing", "no such run directory"),
        (lambda d: d, "neither metrics.jsonl nor events.jsonl"),
    ],
)
def test_not_a_run_directory_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make, expected: str
) -> None:
    target = make(tmp_path)
    assert main(["report", str(target)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("laminar: error: report: "), err
    assert expected in err[0] and str(target) in err[0]


# -- events.jsonl through telemetry.events -----------------------------------------------------


def _rewrite_events(d: Path, edit) -> int:
    """Apply ``edit`` to the first trajectory line of ``d/events.jsonl``; its line number."""
    lines = (d / "events.jsonl").read_text().splitlines()
    n = next(i for i, x in enumerate(lines) if json.loads(x)["kind"] == "trajectory")
    row = json.loads(lines[n])
    edit(row)
    lines[n] = json.dumps(row)
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")
    return n + 1


def test_a_renamed_event_field_fails_loudly(
    sim_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a writer that renamed ``tokens`` leaves behind: the report and the audit name the
    line and the field instead of drawing zeros, and the writer itself cannot construct it."""
    d = copy_run(sim_run, tmp_path / "run", "config.yaml", "metrics.jsonl", "events.jsonl")
    line = _rewrite_events(d, lambda row: row.update(response_tokens=row.pop("tokens")))
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("laminar: error: report: "), err
    assert f"line {line}: a 'trajectory' event lacks field(s) tokens" in err[0]
    assert "has field(s) response_tokens that the schema does not define" in err[0]
    with pytest.raises(EventsError, match=f"line {line}: .* lacks field.s. tokens"):
        audit_run(d)
    with pytest.raises(TypeError, match="response_tokens"):
        TrajectoryDone(t=0.0, actor="r0", id="a", version=0, versions=[0], response_tokens=1)


def test_a_run_directory_from_before_the_schema_version_is_reported(
    sim_run: Path, tmp_path: Path
) -> None:
    d = copy_run(sim_run, tmp_path / "run", "config.yaml", "metrics.jsonl", "events.jsonl")
    lines = (d / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {
        "t": 0.0,
        "kind": "schema",
        "actor": "",
        "duration": 0.0,
        "version": SCHEMA_VERSION,
    }
    (d / "events.jsonl").write_text("\n".join(lines[1:]) + "\n")  # as written before
    old, new = read_events(d / "events.jsonl"), read_events(sim_run / "events.jsonl")
    assert (old.version, new.version) == (0, SCHEMA_VERSION) and old.events == new.events
    report = rep.write_report(d)
    assert figures(report.index.read_text()) == figures(rep.write_report(sim_run).index.read_text())


def test_a_cut_off_last_event_line_is_left_out_and_any_other_bad_line_is_an_error(
    sim_run: Path, tmp_path: Path
) -> None:
    d = copy_run(sim_run, tmp_path / "run", "config.yaml", "metrics.jsonl", "events.jsonl")
    with open(d / "events.jsonl", "a") as f:
        f.write('{"t": 11.5, "kind": "trajec')  # killed mid-write
    log = read_events(d / "events.jsonl")
    assert log.cut_off and len(log.events) == len(read_events(sim_run / "events.jsonl").events)
    assert any("last line is cut off" in n for n in rep.write_report(d).notes)
    assert any("last line is cut off" in p for p in audit_run(d).problems)
    with open(d / "events.jsonl", "a") as f:
        f.write("\n{}\n")  # the cut-off line is no longer the last one
    with pytest.raises(rep.ReportError, match=r"is not JSON .* not the last line"):
        rep.load_run(d)


def test_events_of_a_newer_schema_name_the_upgrade(sim_run: Path, tmp_path: Path) -> None:
    d = copy_run(sim_run, tmp_path / "run", "events.jsonl")
    lines = (d / "events.jsonl").read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "version": SCHEMA_VERSION + 1})
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(rep.ReportError, match="upgrade Laminar"):
        rep.load_run(d)


# -- the aggregation behind the timeline -----------------------------------------------------


def test_coverage_is_the_exact_mean_in_flight_per_bin() -> None:
    rng = np.random.default_rng(0)
    starts = rng.uniform(0, 10, 200)
    ends = starts + rng.exponential(1.0, 200)
    edges = np.linspace(0, 12, 25)
    fine = np.linspace(0, 12, 240_001)[:-1] + 12 / 480_000  # midpoints of a fine grid
    inflight = ((starts[:, None] <= fine) & (fine < ends[:, None])).sum(0)
    brute = inflight.reshape(24, -1).mean(1)
    np.testing.assert_allclose(rep._coverage(starts, ends, edges), brute, atol=2e-3)


def _traj(t: float, replica: str, duration: float, tid: str, version: int) -> TrajectoryDone:
    return TrajectoryDone(
        t=t,
        actor=replica,
        duration=duration,
        id=tid,
        version=version,
        versions=[version],
        tokens=10,
    )


def test_moved_trajectories_are_split_at_their_moves(tmp_path: Path) -> None:
    log = EventLog()
    for e in (
        WaitData(t=10.0, actor="trainer", duration=10.0, step=0),
        RepackMove(t=4.0, actor="r1", to="r10", n=1, ids=["a"]),
        RepackMove(t=6.0, actor="r10", to="r2", n=1, ids=["a"]),
        _traj(9.0, "r2", 8.0, "a", 0),
        _traj(5.0, "r1", 5.0, "b", 0),
    ):
        log.record(e)
    p = tmp_path / "events.jsonl"
    log.write_jsonl(p)
    with open(p, "a") as f:
        f.write('{"t": 11, "kind": "traj')  # killed mid-write
    notes: list[str] = []
    ev = rep.event_columns(p, notes)
    assert ev.replicas == ["r1", "r2", "r10"]  # natural order
    seg = sorted(
        zip(
            ev.segments["start"], ev.segments["t"], (ev.replicas[r] for r in ev.segments["replica"])
        )
    )
    assert seg == [(0.0, 5.0, "r1"), (1.0, 4.0, "r1"), (4.0, 6.0, "r10"), (6.0, 9.0, "r2")]
    assert notes == [
        "events.jsonl: the last line is cut off (the run was killed while writing it) and is "
        "left out"
    ]


def test_big_runs_draw_a_sample_of_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    n_rep, n_traj = 200, 5000
    log = EventLog()
    log.record(WaitData(t=5.0, actor="trainer", duration=5.0, step=0))
    for i in range(n_traj):
        end = float(rng.uniform(1, 100))
        log.record(_traj(end, f"r{i % n_rep}", end * 0.9, f"g{i}", i % 3))
    log.write_jsonl(tmp_path / "events.jsonl")
    from matplotlib.figure import Figure

    titles: list[str] = []
    real_savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        titles.extend(ax.get_title() for ax in fig.axes)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    report = rep.write_report(tmp_path)
    assert {p.stem for p in report.images} == {"staleness", "timeline"}
    assert png_size(report.out_dir / "timeline.png") == rep.FIGURE_PIXELS["timeline"]
    assert any(f"{rep.MAX_ROWS} of {n_rep} replicas shown" in t for t in titles), titles


# -- simulate --trace ------------------------------------------------------------------------


def test_trace_files_describe_the_traced_run(study_trace: Path) -> None:
    info = json.loads((study_trace / "trace_info.json").read_text())
    trace = json.loads((study_trace / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert "trainer" in names and "r0" in names
    metrics = [json.loads(x) for x in (study_trace / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(info["row"]["steps"]))
    kinds = {e.kind for e in read_events(study_trace / "events.jsonl").events}
    assert {"trajectory", "weight_pull", "train_step", "weight_push", "wait_data"} <= kinds
    rows = json.loads((study_trace.parent / "rows.json").read_text())
    assert info["row"] == rows[0]  # the traced run is the study's laminar run


# -- Weights & Biases ------------------------------------------------------------------------


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """The history rows of the one offline W&B run under ``run_dir/wandb/``.

    Reads the run's ``.wandb`` file: a W&B header, then LevelDB-log records (32 KiB blocks,
    7-byte headers) each holding a protobuf ``Record``.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        parts = chunk if kind in (1, 2) else parts + chunk  # full/first, middle/last
        if kind in (1, 4):
            records.append(parts)
    history = []
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            history.append(items)
    return history


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B's own settings and caches in tmp, no network, no account."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def test_wandb_offline_logs_every_metrics_row(wandb_home: Path) -> None:
    from laminar_core.runtime.train import train

    overrides = [
        f"run.out_dir={wandb_home / 'runs'}",
        *QUIET,
        "telemetry.wandb.project=laminar-test",
        "telemetry.wandb.mode=offline",
        "telemetry.wandb.tags=[tiny,sim]",
    ]
    run_dir = train(load_config(str(TINY), overrides))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = wandb_history(run_dir)
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    for h, r in zip(history, rows):
        assert h["tokens_per_second"] == pytest.approx(r["tokens_per_second"])
        assert h["weight_version"] == r["weight_version"]
        for replica, version in r["replica_versions"].items():
            assert h[f"replica_versions/{replica}"] == version
        assert "reward_mean" not in h  # None is not a number: left out, as in TensorBoard


def test_wandb_missing_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from laminar_core.config.schema import WandbConfig
    from laminar_core.telemetry import WandbSink

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbSink(WandbConfig(project="p", mode="offline"), tmp_path)
    assert not (tmp_path / "wandb").exists()


def test_wandb_bad_mode_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", str(TINY), f"run.out_dir={tmp_path}", *QUIET]
    argv += ["telemetry.wandb.project=p", "telemetry.wandb.mode=ofline"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("laminar: error: "), err
    assert "telemetry.wandb.mode" in err[0] and "offline" in err[0]


def test_wandb_is_off_without_a_project(sim_run: Path) -> None:
    assert not (sim_run / "wandb").exists()

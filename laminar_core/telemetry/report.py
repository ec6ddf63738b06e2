"""``laminar report RUN_DIR``: plots and an ``index.html`` from a run directory's files.

Reads what ``laminar train`` leaves in a run directory (``metrics.jsonl``, ``events.jsonl``,
``config.yaml``; see ``laminar_core.runtime.train``) or what ``laminar simulate --trace FILE``
writes next to FILE (the same files plus ``trace_info.json``: the traced schedule and its
study row; times are then on the simulated clock), and writes ``RUN_DIR/report/``:

==================  ========================================================  ===========
file                what it shows                                             needs
==================  ========================================================  ===========
reward.png          ``reward_mean`` per step (and ``eval_reward`` if logged)  metrics
throughput.png      tokens/s and samples/s per step over time                 metrics
staleness.png       staleness histogram (at finish) and per trained batch    events / metrics
timeline.png        per replica: trajectories in flight coloured by weight    events
                    version, weight pulls, repack moves, failures; the
                    trainer's steps on top (a Gantt, as in the paper)
trainer.png         per step: waiting for data / computing / weight-sync      metrics or events
                    stall, stacked
weight_sync.png     per step: the trainer's push stall and the replicas'      metrics or events
                    pull times
index.html          the run's key figures and every plot above                any
==================  ========================================================  ===========

A partial run (killed before it wrote ``events.jsonl``, or while writing it, or before its
first step) gets the plots its files allow and a note per missing input; a directory with
neither metrics nor events is an error (:class:`ReportError`), and so is an ``events.jsonl``
that ``telemetry.events.read_events`` does not accept (the message names the line). Big runs
stay fast: events are read into numpy columns once and everything is aggregated (in-flight
counts per time bin, bars per group of steps, at most ``MAX_ROWS`` replicas drawn), so the
cost is one pass over the files plus a fixed drawing cost.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from laminar_core.telemetry.events import (
    EventsError,
    RepackMove,
    ReplicaFailed,
    TrainStep,
    TrajectoryDone,
    WaitData,
    WeightPull,
    WeightPush,
    read_events,
)

REPORT_DIR = "report"
TRACE_INFO = "trace_info.json"  # written by ``laminar simulate --trace``
DPI = 100
FIGURE_INCHES: dict[str, tuple[float, float]] = {
    "reward": (12, 5),
    "throughput": (12, 6),
    "staleness": (12, 5),
    "timeline": (14, 8),
    "trainer": (12, 5),
    "weight_sync": (12, 5),
}
FIGURE_PIXELS = {k: (round(w * DPI), round(h * DPI)) for k, (w, h) in FIGURE_INCHES.items()}
MAX_ROWS = 64  # replicas drawn in the timeline (evenly chosen beyond this)
TIME_BINS = 1000  # timeline resolution: about one bin per pixel column
MAX_BARS = 200  # per-step bar charts: beyond this, bars are means over groups of steps

WAIT_COLOR, COMPUTE_COLOR, STALL_COLOR = "#f2b134", "#3b75af", "#c0392b"
PULL_COLOR = "#111111"


class ReportError(ValueError):
    """The directory cannot be reported on; the message names what is missing."""


# -- reading -------------------------------------------------------------------------------


@dataclass
class Events:
    """``events.jsonl`` as numpy columns per kind; times in seconds since the run started.

    Replica actors are numbered in ``replicas`` order (natural sort: r2 before r10).
    """

    replicas: list[str]
    traj: dict[str, np.ndarray]  # t (finish), start, version, replica, tokens
    # where trajectories ran: one segment per replica a trajectory was on (repack moves
    # split a trajectory at the move): start, end, version, replica
    segments: dict[str, np.ndarray]
    pulls: dict[str, np.ndarray]  # t (end), start, version, replica
    repacks: dict[str, np.ndarray]  # t, src, dst, n
    failures: dict[str, np.ndarray]  # t, replica
    waits: dict[str, np.ndarray]  # t (end), start, step
    trains: dict[str, np.ndarray]  # t (end), start, step
    pushes: dict[str, np.ndarray]  # t (end), start, version
    counts: Counter = field(default_factory=Counter)
    origin: float = 0.0  # absolute time of t = 0 (step 0 began)

    @property
    def end(self) -> float:
        ends = [
            c["t"].max() for c in (self.traj, self.pulls, self.trains, self.pushes) if len(c["t"])
        ]
        return float(max(ends, default=0.0))


@dataclass
class RunData:
    run_dir: Path
    metrics: list[dict[str, Any]]
    events: Events | None
    config: dict[str, Any]
    trace_info: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)  # what is missing or was skipped

    @property
    def simulated(self) -> bool:
        return self.trace_info is not None and self.trace_info.get("clock") == "virtual"


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    rows, bad = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # typically the last line of a run killed mid-write
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    if bad:
        notes.append(f"{path.name}: {bad} unreadable line(s) skipped (a run killed mid-write?)")
    return rows


def _columns(rows: list[tuple], names: tuple[str, ...], kinds: str) -> dict[str, np.ndarray]:
    """Rows of tuples as named numpy columns; ``kinds``: one type code per column (``d``:
    float64, as times are absolute clock readings that float32 would round to ~0.1 ms;
    ``q``: int64)."""
    if not rows:
        return {n: np.zeros(0, dtype=k) for n, k in zip(names, kinds)}
    cols = list(zip(*rows))
    return {n: np.asarray(c, dtype=k) for n, c, k in zip(names, cols, kinds)}


def event_columns(path: Path, notes: list[str]) -> Events:
    """``events.jsonl``, read through ``telemetry.events`` (one pass), as :class:`Events`
    columns. A last line cut off by a kill is left out with a note; anything else the schema
    does not accept raises :class:`ReportError` naming the line."""
    try:
        log = read_events(path)
    except EventsError as err:
        raise ReportError(f"{err} (move events.jsonl aside to report on the rest)") from err
    if log.cut_off:
        notes.append(
            f"{path.name}: the last line is cut off (the run was killed while writing it) "
            "and is left out"
        )
    actors: dict[str, int] = {}
    traj, pulls, repacks, fails, waits, trains, pushes = [], [], [], [], [], [], []
    traj_ids: list[str] = []
    moves: dict[str, list[tuple[float, str]]] = {}  # trajectory id -> [(time, from replica)]
    counts: Counter = Counter()
    for e in log.events:
        counts[e.kind] += 1
        t, d, actor = float(e.t), float(e.duration), e.actor
        if isinstance(e, TrajectoryDone):
            a = actors.setdefault(actor, len(actors))
            traj.append((t, t - d, e.version, a, e.tokens))
            traj_ids.append(e.id)
        elif isinstance(e, WeightPull):
            a = actors.setdefault(actor, len(actors))
            pulls.append((t, t - d, e.version, a))
        elif isinstance(e, RepackMove):
            a = actors.setdefault(actor, len(actors))
            b = actors.setdefault(e.to, len(actors))
            repacks.append((t, a, b, e.n))
            for tid in e.ids:
                moves.setdefault(tid, []).append((t, actor))
        elif isinstance(e, ReplicaFailed):
            fails.append((t, actors.setdefault(actor, len(actors))))
        elif isinstance(e, WaitData):
            waits.append((t, t - d, e.step))
        elif isinstance(e, TrainStep):
            trains.append((t, t - d, e.step))
        elif isinstance(e, WeightPush):
            pushes.append((t, t - d, e.version))
    # renumber replicas in natural order
    names = sorted(actors, key=_natural_key)
    remap = np.zeros(max(1, len(actors)), dtype=np.int64)
    for new, name in enumerate(names):
        remap[actors[name]] = new
    segs = _segments(traj, traj_ids, moves, actors)
    ev = Events(
        replicas=names,
        traj=_columns(traj, ("t", "start", "version", "replica", "tokens"), "ddqqq"),
        segments=_columns(segs, ("t", "start", "version", "replica"), "ddqq"),
        pulls=_columns(pulls, ("t", "start", "version", "replica"), "ddqq"),
        repacks=_columns(repacks, ("t", "src", "dst", "n"), "dqqq"),
        failures=_columns(fails, ("t", "replica"), "dq"),
        waits=_columns(waits, ("t", "start", "step"), "ddq"),
        trains=_columns(trains, ("t", "start", "step"), "ddq"),
        pushes=_columns(pushes, ("t", "start", "version"), "ddq"),
        counts=counts,
    )
    for cols, keys in (
        (ev.traj, ("replica",)),
        (ev.segments, ("replica",)),
        (ev.pulls, ("replica",)),
        (ev.repacks, ("src", "dst")),
        (ev.failures, ("replica",)),
    ):
        for k in keys:
            cols[k] = remap[cols[k]]
    # t = 0 is when step 0 began waiting for data (metrics' wall_seconds count from there)
    if len(ev.waits["t"]):
        origin = float(ev.waits["start"][np.argmin(ev.waits["step"])])
    else:
        starts = [c["start"].min() for c in (ev.traj, ev.pulls, ev.trains) if len(c["t"])]
        starts += [c["t"].min() for c in (ev.repacks, ev.failures) if len(c["t"])]
        origin = float(min(starts, default=0.0))
    ev.origin = origin
    for cols in (
        ev.traj,
        ev.segments,
        ev.pulls,
        ev.repacks,
        ev.failures,
        ev.waits,
        ev.trains,
        ev.pushes,
    ):
        for k in ("t", "start"):
            if k in cols:
                cols[k] = cols[k] - origin
    return ev


def _segments(
    traj: list[tuple],
    ids: list[str],
    moves: dict[str, list[tuple[float, str]]],
    actors: dict[str, int],
) -> list[tuple]:
    """Split each moved trajectory at its moves: ``(end, start, version, replica)`` rows."""
    if not moves:
        return [row[:4] for row in traj]
    out = []
    for row, tid in zip(traj, ids):
        t, start, version, replica = row[:4]
        for when, src in sorted(moves.get(tid, ())):
            if start <= when <= t:
                out.append((when, start, version, actors[src]))
                start = when
        out.append((t, start, version, replica))
    return out


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; raises :class:`ReportError` when there is nothing to report."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    notes: list[str] = []
    mpath, epath = run_dir / "metrics.jsonl", run_dir / "events.jsonl"
    if not mpath.exists() and not epath.exists():
        raise ReportError(
            f"{run_dir} has neither metrics.jsonl nor events.jsonl: not a run directory "
            "(laminar train writes them into its run directory; laminar simulate --trace FILE "
            "writes them next to FILE)"
        )
    metrics = _read_jsonl(mpath, notes) if mpath.exists() else []
    if not mpath.exists():
        notes.append(
            "metrics.jsonl is missing: no reward or throughput plots "
            "(trainer and weight-sync plots come from events.jsonl instead)"
        )
    elif not metrics:
        notes.append(
            "metrics.jsonl has no steps (the run stopped before its first trainer step): "
            "no reward or throughput plots"
        )
    events = event_columns(epath, notes) if epath.exists() else None
    if events is None:
        notes.append(
            "events.jsonl is missing (a run killed before its end writes none; "
            "laminar simulate writes it only with --trace): no timeline or staleness histogram"
        )
    elif sum(events.counts.values()) == 0:
        notes.append("events.jsonl is empty (telemetry.events=false?): no timeline")
    config: dict[str, Any] = {}
    cpath = run_dir / "config.yaml"
    if cpath.exists():
        import yaml

        try:
            loaded = yaml.safe_load(cpath.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except yaml.YAMLError:
            notes.append("config.yaml is unreadable: the run's settings are left out")
    else:
        notes.append("config.yaml is missing: the run's settings are left out")
    trace_info = None
    tpath = run_dir / TRACE_INFO
    if tpath.exists():
        try:
            trace_info = json.loads(tpath.read_text())
        except json.JSONDecodeError:
            notes.append(f"{TRACE_INFO} is unreadable: times are shown as seconds")
    return RunData(run_dir, metrics, events, config, trace_info, notes)


# -- figures -------------------------------------------------------------------------------


def _figure(name: str):
    from matplotlib.figure import Figure

    return Figure(figsize=FIGURE_INCHES[name], dpi=DPI, layout="constrained")


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 3 * 3600:
        return 3600.0, "h"
    if span >= 600:
        return 60.0, "min"
    return 1.0, "s"


def _time_label(data: RunData, unit: str) -> str:
    clock = "simulated clock" if data.simulated else "wall clock"
    return f"time since the first step began ({unit}, {clock})"


def _num(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(step, value)`` for the rows that hold a finite number under ``key``."""
    pts = [(r.get("step", i), _num(r, key)) for i, r in enumerate(rows)]
    pts = [(s, v) for s, v in pts if v is not None and isinstance(s, (int, float))]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s, dtype=float), np.asarray(v, dtype=float)


def _rolling(v: np.ndarray, k: int) -> np.ndarray:
    if k <= 1 or len(v) < k:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    out = np.empty_like(v)
    out[k - 1 :] = (c[k:] - c[:-k]) / k
    out[: k - 1] = c[1:k] / np.arange(1, k)
    return out


def plot_reward(data: RunData, path: Path) -> bool:
    steps, reward = _series(data.metrics, "reward_mean")
    esteps, ereward = _series(data.metrics, "eval_reward")
    if not len(reward) and not len(ereward):
        data.notes.append(
            "no reward_mean in metrics.jsonl (nothing scored the trajectories: e.g. simulated "
            "engines without reward.fn): no reward plot"
        )
        return False
    fig = _figure("reward")
    ax = fig.add_subplot()
    if len(reward):
        ax.plot(steps, reward, color="#9ab8d6", lw=1, label="reward_mean (training batch)")
        k = max(1, len(reward) // 20)
        if k > 1:
            ax.plot(steps, _rolling(reward, k), color="#1f5f99", lw=2, label=f"mean of {k} steps")
    if len(ereward):
        ax.plot(esteps, ereward, "o-", color="#d35400", lw=2, ms=5, label="eval_reward (held out)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_title("Reward per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.savefig(path)
    return True


def plot_throughput(data: RunData, path: Path) -> bool:
    rows = [r for r in data.metrics if _num(r, "wall_seconds") is not None]
    if not rows:
        return False
    from matplotlib.ticker import FuncFormatter

    t = np.asarray([r["wall_seconds"] for r in rows], dtype=float)
    div, unit = _time_unit(float(t.max()) if len(t) else 0.0)
    fig = _figure("throughput")
    axes = fig.subplots(2, 1, sharex=True)
    k = max(1, len(rows) // 20)
    for ax, key, label, color in (
        (axes[0], "tokens_per_second", "tokens/s", "#3b75af"),
        (axes[1], "samples_per_second", "samples (trajectories)/s", "#2e8b57"),
    ):
        v = np.asarray([_num(r, key) or 0.0 for r in rows])
        ax.plot(
            t / div,
            v,
            "o-" if len(v) <= 50 else "-",
            color=color,
            alpha=0.45 if k > 1 else 1.0,
            lw=1,
            ms=3,
            label="per step (at its end)",
        )
        if k > 1:
            ax.plot(t / div, _rolling(v, k), color=color, lw=2, label=f"mean of {k} steps")
        period = np.diff(np.insert(t, 0, 0.0))
        mean = float(np.average(v, weights=period)) if period.sum() > 0 else float(v.mean())
        ax.axhline(mean, color="grey", ls="--", lw=1, label=f"run average {mean:,.0f}")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=9)
    axes[0].set_title(
        "Throughput per trainer step (tokens and trajectories of the batch / step period)"
    )
    axes[1].set_xlabel(_time_label(data, unit))
    fig.savefig(path)
    return True


def _trainer_version(ev: Events) -> tuple[np.ndarray, np.ndarray, int]:
    """Sorted publish times and versions of the trainer, and the version before the first."""
    order = np.argsort(ev.pushes["t"])
    times, versions = ev.pushes["t"][order], ev.pushes["version"][order]
    # no push recorded (a run stopped before its first step): nothing newer than the
    # newest generating version existed
    initial = int(versions[0]) - 1 if len(versions) else int(ev.traj["version"].max(initial=0))
    return times, versions, initial


def plot_staleness(data: RunData, path: Path) -> bool:
    ev = data.events
    have_events = ev is not None and len(ev.traj["t"]) > 0
    steps, smean = _series(data.metrics, "staleness_mean")
    _, smax = _series(data.metrics, "staleness_max")
    if not have_events and not len(smean):
        return False
    fig = _figure("staleness")
    ax_h, ax_s = fig.subplots(1, 2, width_ratios=[1, 1.4])
    if have_events and ev is not None:
        times, versions, initial = _trainer_version(ev)
        idx = np.searchsorted(times, ev.traj["t"], side="right")
        known = versions[np.maximum(idx - 1, 0)] if len(versions) else initial
        trainer_v = np.where(idx > 0, known, initial)
        stale = np.maximum(trainer_v - ev.traj["version"], 0)
        counts = np.bincount(stale)
        xs = np.arange(len(counts))
        ax_h.bar(xs, counts / counts.sum(), color="#6c5b7b", width=0.8)
        for x, c in zip(xs, counts):
            if c:
                ax_h.annotate(f"{c:,}", (x, c / counts.sum()), ha="center", va="bottom", fontsize=8)
        ax_h.set_xticks(xs)
        ax_h.set_xlabel("staleness at finish (trainer version - generating version)")
        ax_h.set_ylabel("share of trajectories")
        ax_h.set_title(
            f"Staleness at finish, {len(stale):,} trajectories: mean {stale.mean():.2f}, "
            f"max {int(stale.max())}"
        )
    else:
        ax_h.text(
            0.5,
            0.5,
            "no events.jsonl:\nno per-trajectory staleness",
            ha="center",
            va="center",
            transform=ax_h.transAxes,
            color="grey",
        )
        ax_h.set_axis_off()
    if len(smean):
        style = "o-" if len(steps) <= 50 else "-"
        ax_s.plot(steps, smean, style, color="#6c5b7b", ms=4, label="mean")
        if len(smax):
            ax_s.plot(
                steps,
                smax,
                marker="s" if len(steps) <= 50 else "",
                color="#c06c84",
                ms=4,
                lw=1,
                ls="--",
                label="max",
            )
        ax_s.xaxis.get_major_locator().set_params(integer=True)
        ax_s.set_xlabel("trainer step")
        ax_s.set_ylabel("staleness (versions)")
        ax_s.set_title("Staleness of each trained batch (step - generating version)")
        ax_s.set_ylim(bottom=0)
        ax_s.yaxis.get_major_locator().set_params(integer=True)
        ax_s.grid(alpha=0.3)
        ax_s.legend(loc="upper left")
    else:
        ax_s.text(
            0.5,
            0.5,
            "no metrics.jsonl:\nno per-batch staleness",
            ha="center",
            va="center",
            transform=ax_s.transAxes,
            color="grey",
        )
        ax_s.set_axis_off()
    fig.savefig(path)
    return True


@dataclass
class StepTable:
    """Per trainer step: when it ended and where its time went (seconds)."""

    step: np.ndarray
    end: np.ndarray
    wait: np.ndarray
    compute: np.ndarray
    stall: np.ndarray
    source: str  # "metrics.jsonl" or "events.jsonl"


def step_table(data: RunData) -> StepTable | None:
    rows = [r for r in data.metrics if _num(r, "wall_seconds") is not None]
    if rows:
        end = np.asarray([r["wall_seconds"] for r in rows], dtype=float)
        period = np.diff(np.insert(end, 0, 0.0))
        wait = np.asarray([_num(r, "wait_seconds") or 0.0 for r in rows])
        stall = np.asarray([_num(r, "stall_seconds") or 0.0 for r in rows])
        step = np.asarray([r.get("step", i) for i, r in enumerate(rows)], dtype=float)
        compute = np.maximum(period - wait - stall, 0.0)
        return StepTable(step, end, wait, compute, stall, "metrics.jsonl")
    ev = data.events
    if ev is None or not len(ev.trains["t"]):
        return None
    order = np.argsort(ev.trains["step"])
    step = ev.trains["step"][order]
    compute = (ev.trains["t"] - ev.trains["start"])[order]
    wait_by = dict(zip(ev.waits["step"].tolist(), (ev.waits["t"] - ev.waits["start"]).tolist()))
    push_by = dict(
        zip((ev.pushes["version"] - 1).tolist(), (ev.pushes["t"] - ev.pushes["start"]).tolist())
    )
    end_by = dict(zip((ev.pushes["version"] - 1).tolist(), ev.pushes["t"].tolist()))
    wait = np.asarray([wait_by.get(s, 0.0) for s in step.tolist()])
    stall = np.asarray([push_by.get(s, 0.0) for s in step.tolist()])
    end = np.asarray([end_by.get(s, t) for s, t in zip(step.tolist(), ev.trains["t"][order])])
    return StepTable(step.astype(float), end, wait, compute, stall, "events.jsonl")


def _group_steps(x: np.ndarray, *cols: np.ndarray) -> tuple[int, np.ndarray, list[np.ndarray]]:
    """Bars for at most ``MAX_BARS`` groups: group size, first step, per-group means."""
    k = max(1, math.ceil(len(x) / MAX_BARS))
    if k == 1:
        return 1, x, list(cols)
    n = len(x) // k * k
    groups = [
        np.append(c[:n].reshape(-1, k).mean(1), c[n:].mean())
        if n < len(c)
        else c[:n].reshape(-1, k).mean(1)
        for c in cols
    ]
    return k, x[::k][: len(groups[0])], groups


def plot_trainer(data: RunData, table: StepTable | None, path: Path) -> bool:
    if table is None:
        return False
    k, x, (wait, compute, stall) = _group_steps(table.step, table.wait, table.compute, table.stall)
    fig = _figure("trainer")
    ax = fig.add_subplot()
    width = 0.8 * k
    ax.bar(x, wait, width, align="edge", color=WAIT_COLOR, label="waiting for a batch")
    ax.bar(x, compute, width, bottom=wait, align="edge", color=COMPUTE_COLOR, label="computing")
    ax.bar(
        x,
        stall,
        width,
        bottom=wait + compute,
        align="edge",
        color=STALL_COLOR,
        label="weight-sync stall",
    )
    total = table.wait.sum() + table.compute.sum() + table.stall.sum()
    share = table.wait.sum() / total if total > 0 else 0.0
    per = f" (bars: mean over {k} steps)" if k > 1 else ""
    ax.set_title(f"Trainer time per step: {share:.0%} of the run spent waiting for data{per}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel(f"seconds{' (simulated)' if data.simulated else ''}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right")
    if len(x) <= 30:
        ax.set_xticks(x + width / 2, [str(int(s)) for s in x])
    fig.savefig(path)
    return True


def plot_weight_sync(data: RunData, table: StepTable | None, path: Path) -> bool:
    ev = data.events
    have_pulls = ev is not None and len(ev.pulls["t"]) > 0
    if table is None and not have_pulls:
        return False
    fig = _figure("weight_sync")
    ax = fig.add_subplot()
    if table is not None:
        k, x, (stall,) = _group_steps(table.step, table.stall)
        ax.bar(
            x,
            stall,
            0.8 * k,
            align="edge",
            color=STALL_COLOR,
            alpha=0.85,
            label="trainer stall: push to the master relay" + (f" (mean of {k})" if k > 1 else ""),
        )
    if have_pulls and ev is not None:
        dur = ev.pulls["t"] - ev.pulls["start"]
        versions = ev.pulls["version"]
        uniq, inv = np.unique(versions, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        per_version = np.split(dur[order], np.flatnonzero(np.diff(inv[order])) + 1)
        med = np.asarray([np.median(d) for d in per_version])
        mx = np.asarray([d.max() for d in per_version])
        n = np.bincount(inv)
        xs = uniq - 1 + 0.4  # version v is published by step v - 1: centre on that bar
        style = "o-" if len(uniq) <= 50 else "-"
        ax.plot(
            xs,
            med,
            style,
            color="#2c3e50",
            ms=4,
            label=f"replica pull time, median ({len(dur):,} pulls)",
        )
        ax.plot(
            xs,
            mx,
            style.replace("o", "^"),
            color="#7f8c8d",
            ms=4,
            lw=1,
            label="replica pull time, max",
        )
        ax.set_title(
            "Weight sync per version: trainer stall and the time replicas spend loading it "
            f"(mean {n.mean():.1f} pulls per version)"
        )
    else:
        ax.set_title("Weight sync per step: trainer stall (no events.jsonl: no replica pulls)")
    ax.set_xlabel("trainer step (step s publishes version s + 1)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if table is not None and len(table.step) <= 30:
        ax.set_xticks(table.step + 0.4, [str(int(s)) for s in table.step])
    ax.set_ylabel(f"seconds{' (simulated)' if data.simulated else ''}")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.savefig(path)
    return True


def _version_colors(vmin: int, vmax: int):
    """(cmap, norm) mapping each integer version to a colour; qualitative when few."""
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize

    n = vmax - vmin + 1
    if n <= 20:
        base = colormaps["tab10" if n <= 10 else "tab20"]
        cmap = ListedColormap([base(i) for i in range(n)])
        return cmap, BoundaryNorm(np.arange(vmin - 0.5, vmax + 1.5), n)
    return colormaps["viridis"], Normalize(vmin, vmax)


def _coverage(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean number of intervals ``[start, end)`` covering each bin between ``edges``.

    Exact (an integral, not a sample): F(t) = sum over intervals of their length before t.
    """
    s, e = np.sort(starts), np.sort(ends)
    cs, ce = np.concatenate(([0.0], np.cumsum(s))), np.concatenate(([0.0], np.cumsum(e)))
    i, j = np.searchsorted(s, edges, side="right"), np.searchsorted(e, edges, side="right")
    area = (i * edges - cs[i]) - (j * edges - ce[j])
    return np.diff(area) / np.diff(edges)


def _step_polys(edges: np.ndarray, values: np.ndarray, base: float, scale: float) -> list:
    """Polygons (one per run of non-zero bins) of a step profile ``base + scale * values``."""
    polys: list[np.ndarray] = []
    nz = values > 1e-9
    if not nz.any():
        return polys
    d = np.diff(np.concatenate(([0], nz.astype(np.int8), [0])))
    for a, b in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)):
        x = np.repeat(edges[a : b + 1], 2)[1:-1]
        y = base + scale * np.repeat(values[a:b], 2)
        top = np.column_stack((x, y))
        bottom = np.array([[edges[b], base], [edges[a], base]])
        polys.append(np.vstack((top, bottom)))
    return polys


def _rects(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray) -> Any:
    return np.stack([np.column_stack(p) for p in ((x0, y0), (x0, y1), (x1, y1), (x1, y0))], axis=1)


def plot_timeline(data: RunData, path: Path) -> bool:
    """One row per replica (and the trainer on top), like the Laminar paper's timelines."""
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ev = data.events
    if ev is None or not ev.replicas:
        return False
    span = max(ev.end, 1e-9)
    div, unit = _time_unit(span)
    shown = list(range(len(ev.replicas)))
    if len(shown) > MAX_ROWS:
        shown = sorted({round(i) for i in np.linspace(0, len(ev.replicas) - 1, MAX_ROWS)})
    row_of = np.full(len(ev.replicas), -1)
    row_of[shown] = np.arange(1, len(shown) + 1)  # row 0 is the trainer
    vers = [ev.traj["version"], ev.pulls["version"], ev.pushes["version"]]
    allv = np.concatenate(vers) if any(len(v) for v in vers) else np.zeros(1, dtype=int)
    vmin, vmax = int(allv.min()), int(allv.max())
    cmap, norm = _version_colors(vmin, vmax)
    edges = np.linspace(0.0, span, TIME_BINS + 1)
    height = 0.8  # of a row

    # where trajectories ran (split at repack moves); a replica only generates version v
    # after its pull of v ended, so a trajectory redirected here from a failed replica (it
    # started elsewhere, and no move event says when it came) is clipped to that time
    tr = ev.segments
    era = {
        (int(r), int(v)): float(t)
        for r, v, t in zip(ev.pulls["replica"], ev.pulls["version"], ev.pulls["t"])
    }
    starts = tr["start"].copy()
    if era:
        keys = tr["replica"].astype(np.int64) * (vmax + 2) + (tr["version"] - vmin)
        lut = {r * (vmax + 2) + (v - vmin): t for (r, v), t in era.items()}
        era_start = np.asarray([lut.get(k, -np.inf) for k in keys.tolist()])
        starts = np.minimum(np.maximum(starts, era_start), tr["t"])
    sel = row_of[tr["replica"]] > 0
    groups: dict[tuple[int, int], np.ndarray] = {}
    if sel.any():
        idx = np.flatnonzero(sel)
        key = tr["replica"][idx].astype(np.int64) * (vmax - vmin + 1) + (tr["version"][idx] - vmin)
        order = np.argsort(key, kind="stable")
        idx, key = idx[order], key[order]
        cuts = np.flatnonzero(np.diff(key)) + 1
        for part in np.split(idx, cuts):
            groups[(int(tr["replica"][part[0]]), int(tr["version"][part[0]]))] = part
    profiles = {g: _coverage(starts[p], tr["t"][p], edges) for g, p in groups.items()}
    peak = max((float(p.max()) for p in profiles.values()), default=1.0) or 1.0
    polys, colors = [], []
    floor = 0.25  # any trajectory in flight shows: a long tail of one is not a hairline
    for (r, v), prof in profiles.items():
        base = row_of[r] + height / 2  # rows grow downwards (the y axis is inverted)
        h = np.where(prof > 1e-9, floor + (1 - floor) * prof / peak, 0.0)
        ps = _step_polys(edges / div, h, base, -height)
        polys += ps
        colors += [cmap(norm(v))] * len(ps)

    # trainer row: each step's compute coloured by the version it produces
    if len(ev.trains["t"]):
        t0, t1 = ev.trains["start"] / div, ev.trains["t"] / div
        polys += list(_rects(t0, t1, np.full(len(t0), -height / 2), np.full(len(t0), height / 2)))
        colors += [cmap(norm(s + 1)) for s in ev.trains["step"].tolist()]

    fig = _figure("timeline")
    ax = fig.add_subplot()
    if len(ev.waits["t"]):
        t0, t1 = ev.waits["start"] / div, ev.waits["t"] / div
        n = len(t0)
        ax.add_collection(
            PolyCollection(
                _rects(t0, t1, np.full(n, -height / 4), np.full(n, height / 4)),
                facecolors="none",
                edgecolors=WAIT_COLOR,
                hatch="////",
                linewidths=0.8,
            )
        )
    ax.add_collection(PolyCollection(polys, facecolors=colors, edgecolors="none"))
    # weight pulls and pushes: black, full row height, at least ~1 px wide so none vanish
    minw = span / div / 1400
    bars = []
    pl = ev.pulls
    psel = row_of[pl["replica"]] > 0
    if psel.any():
        rows = row_of[pl["replica"][psel]].astype(float)
        x0 = pl["start"][psel] / div
        x1 = np.maximum(pl["t"][psel] / div, x0 + minw)
        bars.append(_rects(x0, x1, rows - height / 2, rows + height / 2))
    if len(ev.pushes["t"]):
        x0 = ev.pushes["start"] / div
        x1 = np.maximum(ev.pushes["t"] / div, x0 + minw)
        n = len(x0)
        bars.append(_rects(x0, x1, np.full(n, -height / 2), np.full(n, height / 2)))
    if bars:
        ax.add_collection(
            PolyCollection(np.concatenate(bars), facecolors=PULL_COLOR, edgecolors="none")
        )
    rp = ev.repacks
    mk = 24 if len(shown) > 16 else 40
    if len(rp["t"]):
        s_ok, d_ok = row_of[rp["src"]] > 0, row_of[rp["dst"]] > 0
        ax.scatter(
            rp["t"][s_ok] / div,
            row_of[rp["src"][s_ok]] - height / 2,
            marker="v",
            s=mk,
            color="#e74c3c",
            edgecolors="white",
            linewidths=0.4,
            zorder=3,
        )
        ax.scatter(
            rp["t"][d_ok] / div,
            row_of[rp["dst"][d_ok]] - height / 2,
            marker="^",
            s=mk,
            color="#2980b9",
            edgecolors="white",
            linewidths=0.4,
            zorder=3,
        )
    fl = ev.failures
    if len(fl["t"]):
        ok = row_of[fl["replica"]] > 0
        ax.scatter(
            fl["t"][ok] / div,
            row_of[fl["replica"][ok]],
            marker="X",
            s=90,
            color="red",
            edgecolors="black",
            zorder=4,
        )

    every = max(1, math.ceil(len(shown) / 40))
    ticks = [0, *range(1, len(shown) + 1, every)]
    labels = ["trainer", *(ev.replicas[shown[i - 1]] for i in ticks[1:])]
    ax.set_yticks(ticks, labels, fontsize=8 if len(shown) > 20 else 10)
    ax.set_ylim(len(shown) + 0.5, -0.5)
    ax.set_xlim(0, span / div)
    ax.set_xlabel(_time_label(data, unit))
    n_shown = (
        f"{len(shown)} of {len(ev.replicas)} replicas shown"
        if len(shown) < len(ev.replicas)
        else f"{len(ev.replicas)} replicas"
    )
    ax.set_title(
        f"Timeline ({n_shown}): bar = generating, its height = trajectories in flight "
        f"(full row = {peak:.0f}), colour = weight version"
    )
    ax.grid(axis="x", alpha=0.25)
    handles = [
        Patch(color=PULL_COLOR, label="weight pull (replica) / push stall (trainer)"),
        Patch(color="#bbbbbb", label="trainer computing step s (colour: version s+1)"),
        Patch(
            facecolor="none", edgecolor=WAIT_COLOR, hatch="////", label="trainer waiting for data"
        ),
        Line2D([], [], marker="v", ls="", color="#e74c3c", label="repack: trajectories moved out"),
        Line2D([], [], marker="^", ls="", color="#2980b9", label="repack: moved in"),
    ]
    if len(fl["t"]):
        handles.append(Line2D([], [], marker="X", ls="", color="red", label="replica failed"))
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    from matplotlib.cm import ScalarMappable

    sm = ScalarMappable(cmap=cmap, norm=norm)
    cb = fig.colorbar(sm, ax=ax, pad=0.01, fraction=0.03)
    cb.set_label("weight version")
    if vmax - vmin + 1 <= 20:
        cb.set_ticks(range(vmin, vmax + 1))
    fig.savefig(path)
    return True


# -- key figures and the page -------------------------------------------------------------


def key_figures(data: RunData, table: StepTable | None) -> list[tuple[str, str]]:
    """``(label, value)`` rows for the page's summary table."""
    out: list[tuple[str, str]] = []
    cfg = data.config
    info = data.trace_info or {}
    schedule = info.get("schedule") or cfg.get("schedule")
    if info.get("point"):
        out.append(("sweep point", str(info["point"])))
    if schedule:
        out.append(
            ("schedule", str(schedule) + (" (simulated study run)" if data.simulated else ""))
        )
    cluster = cfg.get("cluster") or {}
    if cluster:
        out.append(("GPUs (trainer)", f"{cluster.get('gpus')} ({cluster.get('trainer_gpus')})"))
    engines = [
        f"{k}={(cfg.get(sec) or {}).get(k2)}"
        for sec, k, k2 in (
            ("trainer", "trainer", "engine"),
            ("rollout", "rollout", "engine"),
            ("relay", "transport", "transport"),
        )
        if (cfg.get(sec) or {}).get(k2)
    ]
    if engines:
        out.append(("engines", ", ".join(engines)))
    rows = data.metrics
    ev = data.events
    steps = len(rows) if rows else (len(table.step) if table is not None else 0)
    out.append(("trainer steps", str(steps)))
    wall = table.end.max() if table is not None and len(table.end) else None
    if wall is not None:
        clock = " on the simulated clock" if data.simulated else ""
        out.append(("run time", f"{wall:,.1f} s{clock}"))
    if rows and wall:
        trajs = sum(_num(r, "trajectories") or 0 for r in rows)
        tokens = sum(_num(r, "tokens") or 0 for r in rows)
        out.append(("samples/s", f"{trajs / wall:,.1f}  ({int(trajs):,} trajectories)"))
        out.append(("tokens/s", f"{tokens / wall:,.0f}  ({int(tokens):,} tokens)"))
    row = info.get("row") or {}
    if "throughput_tokens_per_s" in row:
        out.append(("tokens/s after warm-up (study)", f"{row['throughput_tokens_per_s']:,.0f}"))
    for key, label in (("reward_mean", "final reward_mean"), ("eval_reward", "final eval_reward")):
        _, v = _series(rows, key)
        if len(v):
            k = min(5, len(v))
            out.append((label, f"{v[-1]:.4f}  (mean of last {k}: {v[-k:].mean():.4f})"))
    if rows:
        n = np.asarray([_num(r, "trajectories") or 0 for r in rows])
        sm = np.asarray([_num(r, "staleness_mean") or 0 for r in rows])
        sx = [_num(r, "staleness_max") or 0 for r in rows]
        mean = float((n * sm).sum() / n.sum()) if n.sum() else 0.0
        out.append(("staleness mean / max", f"{mean:.2f} / {int(max(sx, default=0))}"))
    if table is not None and len(table.step):
        total = table.wait.sum() + table.compute.sum() + table.stall.sum()
        if total > 0:
            out.append(("trainer waiting for data", f"{table.wait.sum() / total:.1%} of its time"))
        out.append(
            (
                "weight-sync stall per step",
                f"{table.stall.mean():.3f} s mean, {table.stall.max():.3f} s max",
            )
        )
    if ev is not None:
        moved = int(ev.repacks["n"].sum())
        out.append(("repack moves", f"{len(ev.repacks['t']):,}  ({moved:,} trajectories moved)"))
        out.append(("weight pulls", f"{len(ev.pulls['t']):,}"))
        fails = int(ev.counts.get("replica_failed", 0))
        restarts = sum(c for k, c in ev.counts.items() if "restart" in k)
        if fails or restarts:
            out.append(("replica failures / restarts", f"{fails} / {restarts}"))
    if rows:
        last = rows[-1]
        for key in ("replica_restarts", "replicas_restarted"):
            restarts_v = _num(last, key)
            if restarts_v is not None:
                out.append(("replica restarts", f"{int(restarts_v)}"))
    return out


CAPTIONS = {
    "reward": "Training-batch reward per step (biased by asynchrony) and held-out eval reward "
    "when the run logs it.",
    "throughput": "Tokens and trajectories of each trained batch divided by the step's period.",
    "staleness": "Left: every finished trajectory's staleness when it finished. Right: the "
    "mean and max staleness of each batch the trainer consumed.",
    "timeline": "One row per rollout replica, the trainer on top. Coloured area: trajectories "
    "in flight (height) by weight version (colour); black: weight pulls/pushes; triangles: "
    "repack moves out/in; a white gap is an idle replica.",
    "trainer": "Where each trainer step's time went: waiting for a full batch, computing, and "
    "the weight-sync stall before it resumes.",
    "weight_sync": "Bars: the trainer's stall per step while the new version reaches the "
    "master relay. Lines: how long replicas took to load each version.",
}


def write_html(
    data: RunData, images: list[str], figures: list[tuple[str, str]], path: Path
) -> None:
    esc = html.escape
    title = f"Laminar report: {data.run_dir.name}"
    rows = "\n".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in figures)
    notes = ""
    if data.notes:
        items = "\n".join(f"<li>{esc(n)}</li>" for n in data.notes)
        notes = f'<h2>Missing or skipped</h2>\n<ul class="notes">\n{items}\n</ul>'
    trace_name = (data.trace_info or {}).get("trace") or "trace.json"
    trace = data.run_dir / trace_name
    where = esc(str(data.run_dir))
    if trace.exists():
        where += (
            f"<br>Every event on one timeline: open <code>{esc(str(trace))}</code> in "
            '<a href="https://ui.perfetto.dev">ui.perfetto.dev</a> (or chrome://tracing).'
        )
    figs = "\n".join(
        f'<figure id="{esc(Path(img).stem)}"><img src="{esc(img)}" alt="{esc(Path(img).stem)}">'
        f"<figcaption>{esc(CAPTIONS.get(Path(img).stem, ''))}</figcaption></figure>"
        for img in images
    )
    path.write_text(
        f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1450px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ padding: 0.25em 1em; border-bottom: 1px solid #ddd; text-align: left; }}
th {{ font-weight: 600; color: #444; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ color: #555; font-size: 0.95em; }} .notes {{ color: #a04000; }}
</style></head>
<body>
<h1>{esc(title)}</h1>
<p>{where}</p>
<h2>Key figures</h2>
<table>
{rows}
</table>
{notes}
{figs}
</body></html>
"""
    )


# -- entry point ---------------------------------------------------------------------------


@dataclass
class Report:
    out_dir: Path
    index: Path
    images: list[Path]
    notes: list[str]
    seconds: float


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Render ``run_dir`` into ``out_dir`` (default ``RUN_DIR/report/``).

    Raises :class:`ReportError` when ``run_dir`` holds nothing to report on, or matplotlib
    is missing.
    """
    t0 = time.perf_counter()
    data = load_run(run_dir)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError("laminar report needs matplotlib: pip install matplotlib") from None
    out = Path(out_dir) if out_dir is not None else data.run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    table = step_table(data)
    images: list[Path] = []

    def render(name: str, fn, *args) -> None:
        path = out / f"{name}.png"
        if fn(data, *args, path):
            images.append(path)
        elif path.exists():
            path.unlink()  # a stale plot of an earlier report would contradict this one

    render("reward", plot_reward)
    render("throughput", plot_throughput)
    render("staleness", plot_staleness)
    render("timeline", plot_timeline)
    render("trainer", plot_trainer, table)
    render("weight_sync", plot_weight_sync, table)
    index = out / "index.html"
    write_html(data, [p.name for p in images], key_figures(data, table), index)
    return Report(out, index, images, list(data.notes), time.perf_counter() - t0)

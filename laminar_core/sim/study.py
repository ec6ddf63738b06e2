"""Simulation studies: the real loop against simulated engines on a virtual clock.

``simulate_schedule`` runs one schedule and returns one result row; ``run_study`` runs every
schedule of ``study.schedules`` at every point of ``study.sweep``. Row keys are a stable
interface (scripts and dashboards read them): see ``RESULT_KEYS``.

Studies keep no event timeline (it costs memory and time at 1024 GPUs); a ``StudyTrace``
turns events on for one run of the study (one schedule at the first sweep point) and writes
that run's files (``write_trace``). Recording events does not change the simulation: the
traced run's row equals the untraced one (all but ``wall_seconds``).
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from laminar_core.config.loader import ResolvedConfig, apply_overrides
from laminar_core.loop.dispatch import make_dispatch
from laminar_core.loop.schedules import split_schedule_name
from laminar_core.plugins import PluginManager, default_manager
from laminar_core.runtime import Run, build_local_run
from laminar_core.runtime.resolve import resolve
from laminar_core.sim.clock import run_virtual

RESULT_KEYS = (
    "point",
    "schedule",
    "repack",
    "gpus",
    "trainer_gpus",
    "replicas",
    "steps",
    "warmup_steps",
    "throughput_tokens_per_s",
    "trajectories_per_s",
    "generation_tokens_per_s",
    "generation_share",
    "rollout_utilization",
    "rollout_idle_share",
    "trainer_idle_share",
    "kv_use_mean",
    "kv_use_busy_mean",
    "trajectory_latency_mean_s",
    "trajectory_latency_p99_s",
    "trajectory_latency_max_s",
    "staleness_mean",
    "staleness_p99",
    "staleness_max",
    "repacks",
    "repacked_trajectories",
    "move_seconds",
    "preemptions",
    "weight_sync_stall_s",
    "train_step_s",
    "switch_s",
    "replicas_started_min",
    "replicas_busy_min",
    "started_per_replica_min",
    "started_per_replica_max",
    "tool_calls_per_trajectory",
    "tool_latency_p50_s",
    "tool_latency_p99_s",
    "tool_observation_tokens_mean",
    "tool_prefill_tokens",
    "tool_kv_hit_share",
    "call_gap_p50_s",
    "call_gap_p99_s",
    "versions_per_trajectory_mean",
    "sim_seconds",
    "wall_seconds",
)
"""Every row's keys (``per_step`` holds the per-step work spread as a list). Figures are
measured after ``warmup_steps`` trainer steps (from the end of the last warm-up step to the
end of the last step): throughput, generation, utilisation, idle shares, KV use, latency,
staleness, moves and preemptions; the work spread (``replicas_*``, ``started_*``,
``per_step``) covers every step, warm-up included. The ``tool_*`` figures are 0 without a
tool-calling workload (``env.name: sim_tool``): tool calls per trajectory, the calls'
latency p50 / p99, observation tokens per call, the prefill that turns after a tool call
computed (re-prefill of the prefix, or only the observation where the KV was kept), and the
share of those turns that found their KV kept (``rollout.sim.tool_kv: keep``). ``call_gap_*``
is the time a trajectory spent off the replicas between two model turns (tool plus the
agent's think time, ``sim.agent``); ``versions_per_trajectory_mean`` counts the weight
versions that generated a finished trajectory's turns (above 1: turns after a call ran on
newer weights). ``trajectories_per_s`` is ``throughput_tokens_per_s``'s count of trained
trajectories (episodes, for an agent workload) instead of tokens."""


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])


# per-engine counters a study reads (cumulative; the window's share is end minus warm-up)
_ENGINE_COUNTERS = (
    "occupancy_seconds",
    "kv_seconds",
    "busy_seconds",
    "resume_seconds",
    "preemptions",
    "tokens_generated",
    "tool_resumes",
    "tool_prefill_tokens",
    "tool_kv_hits",
)


def engine_counters(engine: Any) -> dict[str, float]:
    """A simulated replica's cumulative counters now (zeros for another engine)."""
    advance = getattr(engine, "_advance", None)
    if advance is not None:
        advance()  # bring its integrals up to this instant
    return {k: float(getattr(engine, k, 0.0)) for k in _ENGINE_COUNTERS}


@dataclass
class WarmupSnapshot:
    """What the run had accumulated when the last warm-up step ended."""

    time: float
    engines: list[dict[str, float]]
    moves: int
    moved: int


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    total = 0.0
    cur: tuple[float, float] | None = None  # the run of overlapping intervals so far
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = (a, b)
        else:
            cur = (cur[0], max(cur[1], b))
    if cur is not None:
        total += cur[1] - cur[0]
    return total


def work_spread(engines: list[Any], bounds: list[float]) -> list[dict[str, Any]]:
    """Per step (``bounds[i]`` .. ``bounds[i + 1]``): how many replicas started a new
    trajectory, how many ran work at all, and the fewest / most trajectories a replica
    started."""
    out = []
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        started, busy = [], 0
        for e in engines:
            starts = getattr(e, "starts", [])
            started.append(bisect.bisect_left(starts, b) - bisect.bisect_left(starts, a))
            if any(p0 < b and p1 > a for p0, p1 in getattr(e, "busy_periods", [])):
                busy += 1
        out.append(
            {
                "step": i,
                "period_s": b - a,
                "replicas_started": sum(1 for n in started if n),
                "replicas_busy": busy,
                "started_min": min(started, default=0),
                "started_max": max(started, default=0),
            }
        )
    return out


def summarize(
    run: Run,
    wall: float,
    point: str = "",
    warm: WarmupSnapshot | None = None,
    final: WarmupSnapshot | None = None,
) -> dict[str, Any]:
    """One result row from a finished run. Throughput is the Laminar paper's: tokens of each
    global batch over the time between consecutive trainer updates; it and every other
    figure but the work spread are measured after ``study.warmup_steps``: from ``warm``, the
    counters when the last warm-up step ended (``None``: zeros, from the start), to
    ``final``, the counters when the last step ended."""
    cfg = run.resolved.cfg
    recs = run.controller.records
    n_warm = min(cfg.study.warmup_steps, max(0, len(recs) - 1))
    t_begin = recs[n_warm - 1].end if n_warm > 0 else run.controller.t_start
    post = recs[n_warm:]
    end = recs[-1].end if recs else 0.0
    period = (end - t_begin) if post else 0.0
    tokens = sum(r.tokens for r in post)
    trained = sum(r.trajectories for r in post)
    wait = sum(r.train_start - r.start for r in post)
    stale = [s for r in post for s in r.staleness]
    engines = run.engines
    zeros = [dict.fromkeys(_ENGINE_COUNTERS, 0.0)] * len(engines)
    if warm is None or warm.time != t_begin:
        warm = WarmupSnapshot(t_begin, zeros, 0, 0)
    now = final.engines if final is not None else zeros

    def window(key: str) -> float:
        return sum(n[key] - w[key] for n, w in zip(now, warm.engines))

    gpu_time = len(engines) * period
    busy = window("busy_seconds")
    ledger = getattr(run.runtime, "shared", {}).get("sim_ledger")
    done = [d for d in (ledger.done if ledger else []) if t_begin < d.finish <= end]
    latency = [d.latency for d in done]
    periods = [(a, min(b, end)) for e in engines for a, b in getattr(e, "busy_periods", [])]
    breakdowns = getattr(getattr(run.trainer, "engine", None), "breakdowns", [])[n_warm:]
    bounds = [run.controller.t_start] + [r.end for r in recs]
    spread = work_spread(engines, bounds)
    moved = run.manager.moved - warm.moved
    tools = _tool_figures(run, post, t_begin, end)
    tool_resumes = window("tool_resumes")
    return {
        "point": point,
        "schedule": run.schedule.name,
        "repack": cfg.repack.policy,
        "gpus": cfg.cluster.gpus,
        "trainer_gpus": run.placement.trainer_gpus,
        "replicas": run.placement.replicas,
        "steps": len(recs),
        "warmup_steps": n_warm,
        "throughput_tokens_per_s": tokens / period if period > 0 else 0.0,
        "trajectories_per_s": trained / period if period > 0 else 0.0,
        "generation_tokens_per_s": sum(d.tokens for d in done) / period if period > 0 else 0.0,
        "generation_share": _union_length(periods, t_begin, end) / period if period > 0 else 0.0,
        "rollout_utilization": window("occupancy_seconds") / gpu_time if gpu_time > 0 else 0.0,
        "rollout_idle_share": 1.0 - busy / gpu_time if gpu_time > 0 else 0.0,
        "trainer_idle_share": wait / period if period > 0 else 0.0,
        "kv_use_mean": window("kv_seconds") / gpu_time if gpu_time > 0 else 0.0,
        "kv_use_busy_mean": window("kv_seconds") / busy if busy > 0 else 0.0,
        "trajectory_latency_mean_s": sum(latency) / len(latency) if latency else 0.0,
        "trajectory_latency_p99_s": _percentile(latency, 0.99),
        "trajectory_latency_max_s": max(latency, default=0.0),
        "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness_p99": _percentile(stale, 0.99),
        "staleness_max": max(stale, default=0),
        "repacks": run.manager.moves - warm.moves,
        "repacked_trajectories": moved,
        "move_seconds": window("resume_seconds"),
        "preemptions": int(window("preemptions")),
        "weight_sync_stall_s": sum(r.stall for r in post) / len(post) if post else 0.0,
        "train_step_s": (
            sum(r.end - r.train_start - r.stall for r in post) / len(post) if post else 0.0
        ),
        "switch_s": sum(b.switch for b in breakdowns) / len(breakdowns) if breakdowns else 0.0,
        "replicas_started_min": min((s["replicas_started"] for s in spread), default=0),
        "replicas_busy_min": min((s["replicas_busy"] for s in spread), default=0),
        "started_per_replica_min": min((s["started_min"] for s in spread), default=0),
        "started_per_replica_max": max((s["started_max"] for s in spread), default=0),
        **tools,
        "tool_prefill_tokens": int(window("tool_prefill_tokens")),
        "tool_kv_hit_share": window("tool_kv_hits") / tool_resumes if tool_resumes else 0.0,
        "versions_per_trajectory_mean": (
            sum(d.versions for d in done) / len(done) if done else 0.0
        ),
        "sim_seconds": end,
        "wall_seconds": wall,
        "per_step": spread,
    }


def _tool_figures(run: Run, post: list[Any], t_begin: float, end: float) -> dict[str, float]:
    """Tool calls per trained trajectory (after the warm-up) and the latency and observation
    length of the calls that ended in the window (``sim.tools``; zeros without one)."""
    trajs = sum(r.trajectories for r in post)
    per_traj = (
        sum(r.rollout.get("tool_calls_mean", 0.0) * r.trajectories for r in post) / trajs
        if trajs
        else 0.0
    )
    env = getattr(getattr(run.manager, "episodes", None), "env", None)
    calls = [c for c in getattr(env, "calls", []) if t_begin < c[0] <= end]
    lat = [c[1] for c in calls]
    gaps = [c[3] for c in calls]
    return {
        "tool_calls_per_trajectory": per_traj,
        "tool_latency_p50_s": _percentile(lat, 0.5),
        "tool_latency_p99_s": _percentile(lat, 0.99),
        "tool_observation_tokens_mean": sum(c[2] for c in calls) / len(calls) if calls else 0.0,
        "call_gap_p50_s": _percentile(gaps, 0.5),
        "call_gap_p99_s": _percentile(gaps, 0.99),
    }


def schedule_config(
    resolved: ResolvedConfig, spec: str, pm: PluginManager | None = None
) -> ResolvedConfig:
    """The config a study runs schedule ``spec`` with: ``repack.policy`` if the schedule is
    one of ``study.repack_schedules`` (by name or full spec), else ``repack.policy=none``."""
    cfg = resolved.cfg
    listed = set(cfg.study.repack_schedules)
    if spec in listed or split_schedule_name(spec)[0] in listed or cfg.repack.policy == "none":
        return resolved
    raw = apply_overrides(json.loads(json.dumps(resolved.to_dict())), ["repack.policy=none"])
    return resolve(raw, (), pm or default_manager(), resolved.source)


def simulate_schedule(
    resolved: ResolvedConfig,
    schedule: str | None = None,
    pm: PluginManager | None = None,
    point: str = "",
    keep_run: list[Run] | None = None,
    record_events: bool = False,
    dispatch: str = "",
) -> dict[str, Any]:
    """Run ``schedule`` (default: the config's) for ``run.steps`` steps on virtual time, with
    the repack policy ``study.repack_schedules`` gives it (``schedule_config``).

    ``record_events`` keeps the run's event timeline (``run.events``; see ``keep_run``).
    ``dispatch`` replaces the schedule's dispatch policy (``loop.dispatch``), e.g.
    ``least_loaded`` to measure the previous rule.
    """
    pm = pm or default_manager()
    spec = schedule or resolved.cfg.schedule
    resolved = schedule_config(resolved, spec, pm)
    wall0 = time.perf_counter()
    snaps: dict[int, WarmupSnapshot] = {}

    async def main() -> Run:
        run = build_local_run(resolved, spec, pm, record_events=record_events)
        if dispatch:
            m = run.manager
            m.dispatch = make_dispatch(dispatch, m.slots, m.admission, m.opt.max_concurrent)
        ctl, write = run.controller, run.controller.metrics.write

        def write_and_snapshot(row: dict[str, Any]) -> None:
            # the replicas' counters at the end of every step (their integrals advanced to
            # this instant): the figures cover the end of the warm-up to the end of the run
            snaps[len(ctl.records)] = _snapshot(run, ctl.records[-1].end)
            write(row)

        ctl.metrics.write = write_and_snapshot  # type: ignore[method-assign]
        await ctl.run(resolved.cfg.run.steps)
        return run

    run = run_virtual(main())
    if keep_run is not None:
        keep_run.append(run)
    n = len(run.controller.records)
    warm = snaps.get(min(resolved.cfg.study.warmup_steps, max(0, n - 1)))
    return summarize(run, time.perf_counter() - wall0, point, warm, snaps.get(n))


def _snapshot(run: Run, t: float) -> WarmupSnapshot:
    return WarmupSnapshot(
        t, [engine_counters(e) for e in run.engines], run.manager.moves, run.manager.moved
    )


def sweep_points(resolved: ResolvedConfig, pm: PluginManager) -> list[tuple[str, ResolvedConfig]]:
    """``(label, config)`` per sweep point; a study without a sweep has one unnamed point."""
    sweep = resolved.cfg.study.sweep
    if not sweep:
        return [("", resolved)]
    base = resolved.to_dict()
    out = []
    for point in sweep:
        overrides = [f"{k}={v}" for k, v in point.items()]
        raw = apply_overrides(json.loads(json.dumps(base)), overrides)
        raw["study"]["sweep"] = []
        out.append((" ".join(overrides), resolve(raw, (), pm, resolved.source)))
    return out


# the files ``write_trace`` puts next to the trace (what ``laminar report DIR`` reads)
TRACE_FILES = ("events.jsonl", "metrics.jsonl", "config.yaml", "trace_info.json")


@dataclass
class StudyTrace:
    """Keep the events of one run of a study and write them: the Chrome/Perfetto timeline to
    ``path``, and ``TRACE_FILES`` next to it.

    ``schedule``: the schedule spec to trace (as listed in ``study.schedules`` or
    ``--schedules``); empty: the study's first. With a sweep, the first point is traced.
    """

    path: Path
    schedule: str = ""
    written: list[Path] | None = None  # set once the trace is written


def check_trace_path(path: str | Path) -> Path:
    """``path`` as a trace destination, or ``ValueError`` naming the conflict.

    Its directory receives ``TRACE_FILES``: refuse one holding another run's files (a
    ``laminar train`` run directory), and a name that is one of those files.
    """
    path = Path(path)
    if path.name in TRACE_FILES:
        raise ValueError(f"--trace {path}: that name is one of the files written next to it")
    d = path.parent
    if (d / "metrics.jsonl").exists() and not (d / "trace_info.json").exists():
        raise ValueError(
            f"--trace {path}: {d} holds another run's metrics.jsonl; "
            "choose a new or empty directory for the trace"
        )
    return path


def write_trace(run: Run, row: dict[str, Any], path: str | Path) -> list[Path]:
    """Write a finished run's timeline to ``path`` and ``TRACE_FILES`` next to it.

    The run must have been built with events on. Times are simulated seconds from 0.
    """
    path = Path(path)
    d = path.parent
    d.mkdir(parents=True, exist_ok=True)
    run.events.write_chrome_trace(path)
    run.events.write_jsonl(d / "events.jsonl")
    with open(d / "metrics.jsonl", "w") as f:
        for m in run.controller.metrics.rows:
            f.write(json.dumps(m) + "\n")
    config = run.resolved.to_dict()
    config["schedule"] = row["schedule"]  # the traced run's, which the config may not name
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    info = {
        "clock": "virtual",
        "schedule": row["schedule"],
        "point": row["point"],
        "trace": path.name,
        "row": row,
    }
    (d / "trace_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return [path, *(d / name for name in TRACE_FILES)]


def run_study(
    resolved: ResolvedConfig,
    pm: PluginManager | None = None,
    schedules: list[str] | None = None,
    progress=None,
    trace: StudyTrace | None = None,
) -> list[dict[str, Any]]:
    pm = pm or default_manager()
    rows = []
    for label, cfg in sweep_points(resolved, pm):
        specs = schedules or cfg.cfg.study.schedules
        for spec in specs:
            traced = (
                trace is not None and trace.written is None and spec == (trace.schedule or specs[0])
            )
            kept: list[Run] = []
            row = simulate_schedule(
                cfg, spec, pm, point=label, keep_run=kept if traced else None, record_events=traced
            )
            if traced and trace is not None:
                trace.written = write_trace(kept[0], row, trace.path)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The study's rows as a text table (figures after the warm-up, see ``RESULT_KEYS``)."""
    cols = [
        ("point", "point", "{}"),
        ("schedule", "schedule", "{}"),
        ("repack", "repack", "{}"),
        ("gpus", "gpus", "{}"),
        ("throughput_tokens_per_s", "tokens/s", "{:,.0f}"),
        ("generation_tokens_per_s", "gen tok/s", "{:,.0f}"),
        ("generation_share", "gen share", "{:.0%}"),
        ("kv_use_mean", "KV all", "{:.0%}"),
        ("kv_use_busy_mean", "KV busy", "{:.0%}"),
        ("trajectory_latency_mean_s", "lat mean s", "{:,.0f}"),
        ("trajectory_latency_p99_s", "lat p99 s", "{:,.0f}"),
        ("staleness_mean", "stale mean", "{:.2f}"),
        ("staleness_p99", "p99", "{:.0f}"),
        ("staleness_max", "max", "{}"),
        ("trainer_idle_share", "trainer idle", "{:.0%}"),
        ("rollout_idle_share", "rollout idle", "{:.0%}"),
        ("repacks", "moves", "{}"),
        ("repacked_trajectories", "moved", "{}"),
        ("move_seconds", "move s", "{:,.0f}"),
        ("replicas_busy_min", "busy min", "{}"),
        ("sim_seconds", "sim s", "{:,.0f}"),
        ("wall_seconds", "wall s", "{:.1f}"),
    ]
    if any(r.get("tool_calls_per_trajectory") for r in rows):  # a tool-calling workload
        cols[-2:-2] = [
            ("tool_calls_per_trajectory", "tools/traj", "{:.2f}"),
            ("tool_latency_p50_s", "tool p50 s", "{:.1f}"),
            ("tool_latency_p99_s", "tool p99 s", "{:.1f}"),
            ("tool_kv_hit_share", "KV kept hit", "{:.0%}"),
        ]
    if not any(r.get("point") for r in rows):
        cols = cols[1:]
    cells = [[fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (_, h, _), w in zip(cols, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    warm = {int(r.get("warmup_steps") or 0) for r in rows}
    lines.append(
        f"(after {', '.join(str(w) for w in sorted(warm))} warm-up step(s); busy min: the "
        "fewest replicas that ran work in any step, of 'replicas')"
    )
    return "\n".join(lines)


def write_json(rows: list[dict[str, Any]], path: str | Path) -> None:
    Path(path).write_text(json.dumps(rows, indent=2) + "\n")

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

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from laminar_core.config.loader import ResolvedConfig, apply_overrides
from laminar_core.plugins import PluginManager, default_manager
from laminar_core.plugins.resolve import resolve
from laminar_core.runtime import Run, build_local_run
from laminar_core.sim.clock import run_virtual

RESULT_KEYS = (
    "point",
    "schedule",
    "gpus",
    "trainer_gpus",
    "replicas",
    "steps",
    "throughput_tokens_per_s",
    "rollout_utilization",
    "trainer_idle_share",
    "staleness_mean",
    "staleness_p99",
    "staleness_max",
    "repacks",
    "repacked_trajectories",
    "weight_sync_stall_s",
    "sim_seconds",
    "wall_seconds",
)


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])


def summarize(run: Run, wall: float, point: str = "") -> dict[str, Any]:
    """One result row from a finished run (throughput as the Laminar paper measures it:
    tokens of each global batch over the time between consecutive trainer updates,
    averaged over the steps after ``study.warmup_steps``)."""
    recs = run.controller.records
    warm = min(run.resolved.cfg.study.warmup_steps, max(0, len(recs) - 1))
    t_begin = recs[warm - 1].end if warm > 0 else run.controller.t_start
    post = recs[warm:]
    period = (post[-1].end - t_begin) if post else 0.0
    tokens = sum(r.tokens for r in post)
    wait = sum(r.train_start - r.start for r in post)
    end = recs[-1].end if recs else 0.0
    stale = [s for r in recs for s in r.staleness]
    engines = run.engines
    occupancy = sum(getattr(e, "occupancy_seconds", 0.0) for e in engines)
    util = occupancy / (len(engines) * end) if engines and end > 0 else 0.0
    return {
        "point": point,
        "schedule": run.schedule.name,
        "gpus": run.resolved.cfg.cluster.gpus,
        "trainer_gpus": run.placement.trainer_gpus,
        "replicas": run.placement.replicas,
        "steps": len(recs),
        "throughput_tokens_per_s": tokens / period if period > 0 else 0.0,
        "rollout_utilization": util,
        "trainer_idle_share": wait / period if period > 0 else 0.0,
        "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness_p99": _percentile(stale, 0.99),
        "staleness_max": max(stale, default=0),
        "repacks": run.manager.moves,
        "repacked_trajectories": run.manager.moved,
        "weight_sync_stall_s": sum(r.stall for r in recs) / len(recs) if recs else 0.0,
        "sim_seconds": end,
        "wall_seconds": wall,
    }


def simulate_schedule(
    resolved: ResolvedConfig,
    schedule: str | None = None,
    pm: PluginManager | None = None,
    point: str = "",
    keep_run: list[Run] | None = None,
    record_events: bool = False,
) -> dict[str, Any]:
    """Run ``schedule`` (default: the config's) for ``run.steps`` steps on virtual time.

    ``record_events`` keeps the run's event timeline (``run.events``; see ``keep_run``).
    """
    pm = pm or default_manager()
    wall0 = time.perf_counter()

    async def main() -> Run:
        run = build_local_run(resolved, schedule, pm, record_events=record_events)
        await run.controller.run(resolved.cfg.run.steps)
        return run

    run = run_virtual(main())
    if keep_run is not None:
        keep_run.append(run)
    return summarize(run, time.perf_counter() - wall0, point)


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
            if traced:
                trace.written = write_trace(kept[0], row, trace.path)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("point", "point", "{}"),
        ("schedule", "schedule", "{}"),
        ("gpus", "gpus", "{}"),
        ("throughput_tokens_per_s", "tokens/s", "{:,.0f}"),
        ("rollout_utilization", "rollout util", "{:.1%}"),
        ("trainer_idle_share", "trainer idle", "{:.1%}"),
        ("staleness_mean", "stale mean", "{:.2f}"),
        ("staleness_p99", "stale p99", "{:.0f}"),
        ("staleness_max", "stale max", "{}"),
        ("repacks", "repacks", "{}"),
        ("weight_sync_stall_s", "sync stall s", "{:.2f}"),
        ("sim_seconds", "sim s", "{:,.0f}"),
        ("wall_seconds", "wall s", "{:.1f}"),
    ]
    if not any(r.get("point") for r in rows):
        cols = cols[1:]
    cells = [[fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (_, h, _), w in zip(cols, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(rows: list[dict[str, Any]], path: str | Path) -> None:
    Path(path).write_text(json.dumps(rows, indent=2) + "\n")

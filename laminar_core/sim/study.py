"""Simulation studies: the real loop against simulated engines on a virtual clock.

``simulate_schedule`` runs one schedule and returns one result row; ``run_study`` runs every
schedule of ``study.schedules`` at every point of ``study.sweep``. Row keys are a stable
interface (scripts and dashboards read them): see ``RESULT_KEYS``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

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
) -> dict[str, Any]:
    """Run ``schedule`` (default: the config's) for ``run.steps`` steps on virtual time."""
    pm = pm or default_manager()
    wall0 = time.perf_counter()

    async def main() -> Run:
        run = build_local_run(resolved, schedule, pm, record_events=False)
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


def run_study(
    resolved: ResolvedConfig,
    pm: PluginManager | None = None,
    schedules: list[str] | None = None,
    progress=None,
) -> list[dict[str, Any]]:
    pm = pm or default_manager()
    rows = []
    for label, cfg in sweep_points(resolved, pm):
        for spec in schedules or cfg.cfg.study.schedules:
            row = simulate_schedule(cfg, spec, pm, point=label)
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

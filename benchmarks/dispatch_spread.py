"""(f) Per-replica work spread at each paper setup: the previous dispatch rule vs the schedules'.

``least_loaded`` is the rule the rollout manager had before (the least-loaded open replica,
up to ``rollout.max_concurrent``); each schedule's own policy is ``balanced`` (sync,
one_step, stale:K) or ``fair_share`` (laminar), see ``laminar_core/loop/dispatch.py``. Per
trainer step: how many replicas started a new trajectory, the most one replica started, and
how many replicas ran any work.

    python benchmarks/dispatch_spread.py [--steps N] [--setups ...] [--schedules ...]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import EXAMPLES, SETUP_NAMES, SETUPS, say, table

from laminar_core import load_config
from laminar_core.sim.study import simulate_schedule

SCHEDULES = ["sync", "one_step", "stale:4+partial", "laminar"]


def run(
    steps: int, setups: list[str] = SETUPS, schedules: list[str] = SCHEDULES, progress=say
) -> list[dict[str, Any]]:
    """One row per (setup, schedule, rule); ``dispatch`` says which rule ran."""
    rows = []
    for setup in setups:
        resolved = load_config(EXAMPLES / f"{setup}.yaml", [f"run.steps={steps}"])
        for spec in schedules:
            for rule in ("least_loaded", ""):
                row = simulate_schedule(resolved, spec, point=setup, dispatch=rule)
                row["dispatch"] = rule or ("fair_share" if spec == "laminar" else "balanced")
                rows.append(row)
                progress(
                    f"  {setup} {spec} {row['dispatch']}: "
                    f"{row['throughput_tokens_per_s']:,.0f} tokens/s ({row['wall_seconds']:.1f} s)"
                )
    return rows


def spread_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        steps = r["per_step"]
        started = " ".join(str(s["replicas_started"]) for s in steps)
        most = " ".join(str(s["started_max"]) for s in steps)
        out.append(
            [
                SETUP_NAMES.get(r["point"], r["point"]),
                r["schedule"],
                r["dispatch"],
                str(r["replicas"]),
                started,
                most,
                str(r["replicas_busy_min"]),
                f"{r['throughput_tokens_per_s']:,.0f}",
            ]
        )
    return table(
        out,
        [
            "setup",
            "schedule",
            "dispatch",
            "replicas",
            "replicas starting work, per step",
            "most started by one replica, per step",
            "fewest replicas busy in a step",
            "tok/s",
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    rows = run(args.steps, args.setups.split(","), args.schedules.split(","))
    say()
    say(spread_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

"""(a) At each paper setup's largest scale: laminar vs the baseline schedules, side by side.

Every schedule runs the same loop, engines model and workload; only admission, dispatch and
update rules differ (sync time-shares all GPUs, as verl does). The schedules, and which of
them repack, are the setup YAML's (``study.schedules``, ``study.repack_schedules``): the same
settings ``laminar simulate`` runs. Prints throughput and the systems-paper metrics per
schedule, and laminar's ratios next to the published ones (``benchmarks/published.py``).

    python benchmarks/schedules.py [--steps N] [--setups paper_7b_256gpu,...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import EXAMPLES, SETUP_NAMES, SETUPS, ratio, say, table
from published import PUBLISHED

from laminar_core import load_config
from laminar_core.sim.study import simulate_schedule

# the paper's baselines: synchronous verl, one-step off-policy, AReaL (bounded staleness with
# partial rollout); plain stale:4 is shown for reference
PAPER_BASELINES = ["sync", "one_step", "stale:4+partial"]


def run(steps: int, setups: list[str] = SETUPS, progress=say) -> list[dict[str, Any]]:
    """One row per (setup, schedule of its YAML)."""
    rows = []
    for setup in setups:
        resolved = load_config(EXAMPLES / f"{setup}.yaml", [f"run.steps={steps}"])
        for spec in resolved.cfg.study.schedules:
            row = simulate_schedule(resolved, spec, point=setup)
            rows.append(row)
            progress(
                f"  {setup} {spec}: {row['throughput_tokens_per_s']:,.0f} tokens/s "
                f"({row['wall_seconds']:.1f} s wall)"
            )
    return rows


def by_setup(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["point"], {})[r["schedule"]] = r
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """laminar / each schedule, one value per setup (setups in row order)."""
    out: dict[str, list[float]] = {}
    for res in by_setup(rows).values():
        lam = res["laminar"]["throughput_tokens_per_s"]
        for spec, r in res.items():
            if spec != "laminar":
                out.setdefault(spec, []).append(ratio(lam, r["throughput_tokens_per_s"]))
    return out


def throughput_table(rows: list[dict[str, Any]]) -> str:
    grouped = by_setup(rows)
    specs = [s for s in next(iter(grouped.values())) if s != "laminar"]
    out = []
    for setup, res in grouped.items():
        lam = res["laminar"]["throughput_tokens_per_s"]
        cells = [SETUP_NAMES.get(setup, setup), f"{lam:,.0f}"]
        for s in specs:
            t = res[s]["throughput_tokens_per_s"]
            cells.append(f"{t:,.0f} ({ratio(lam, t):.2f}x)")
        cells.append(str(res["laminar"]["staleness_max"]))
        out.append(cells)
    header = ["setup", "laminar tok/s", *[f"{s} (laminar x)" for s in specs], "laminar stale max"]
    return table(out, header)


def metrics_table(rows: list[dict[str, Any]]) -> str:
    """The systems-paper metrics per setup and schedule (after the warm-up)."""
    out = []
    for r in rows:
        out.append(
            [
                SETUP_NAMES.get(r["point"], r["point"]),
                r["schedule"],
                r["repack"],
                f"{r['throughput_tokens_per_s']:,.0f}",
                f"{r['generation_tokens_per_s']:,.0f}",
                f"{r['generation_share']:.0%}",
                f"{r['kv_use_mean']:.0%} / {r['kv_use_busy_mean']:.0%}",
                f"{r['trajectory_latency_mean_s']:,.0f} / {r['trajectory_latency_p99_s']:,.0f}"
                f" / {r['trajectory_latency_max_s']:,.0f}",
                f"{r['staleness_mean']:.2f} / {r['staleness_p99']:.0f} / {r['staleness_max']}",
                f"{r['trainer_idle_share']:.0%}",
                f"{r['rollout_idle_share']:.0%}",
                f"{r['repacks']} / {r['repacked_trajectories']} / {r['move_seconds']:,.0f}",
                f"{r['train_step_s']:.1f} / {r['switch_s']:.1f}",
                f"{r['replicas_busy_min']} / {r['replicas']}",
            ]
        )
    header = [
        "setup",
        "schedule",
        "repack",
        "tok/s",
        "gen tok/s",
        "gen share",
        "KV all / busy",
        "latency s mean / p99 / max",
        "staleness mean / p99 / max",
        "trainer idle",
        "rollout idle",
        "moves / moved / move s",
        "train s / switch s",
        "busy replicas min",
    ]
    return table(out, header)


def ratio_table(rows: list[dict[str, Any]]) -> str:
    r = ratios(rows)

    def mean(v: list[float]) -> float:
        return sum(v) / len(v) if v else float("nan")

    paper = [x for b in PAPER_BASELINES for x in r.get(b, [])]
    lines = [
        ["laminar / verl (sync), max", f"{max(r['sync']):.2f}x", "laminar_over_sync_max"],
        ["laminar / verl (sync), mean", f"{mean(r['sync']):.2f}x", "laminar_over_sync_mean"],
        ["laminar / one-step, mean", f"{mean(r['one_step']):.2f}x", "laminar_over_one_step_mean"],
        [
            "laminar / AReaL (stale:4+partial), mean",
            f"{mean(r['stale:4+partial']):.2f}x",
            "laminar_over_areal_mean",
        ],
        [
            "laminar / {verl, one-step, AReaL}, mean",
            f"{mean(paper):.2f}x",
            "laminar_over_all_largest_mean",
        ],
        ["laminar / stale:4 (no partial rollout), mean", f"{mean(r['stale:4']):.2f}x", ""],
    ]
    out = []
    for what, ours, key in lines:
        pub = PUBLISHED.get(key)
        out.append([what, ours, pub.text() if pub else "none", pub.what if pub else "-"])
    return table(
        out, ["ratio (largest scale)", "ours (simulated)", "published (measured)", "published as"]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    rows = run(args.steps, args.setups.split(","))
    say()
    say(throughput_table(rows))
    say()
    say(metrics_table(rows))
    say()
    say(ratio_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

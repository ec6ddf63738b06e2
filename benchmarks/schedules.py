"""(a) At each paper setup's largest scale: laminar vs the baseline schedules, side by side.

Every schedule runs the same loop, engines model and workload; only admission, dispatch and
update rules differ (sync time-shares all GPUs, as verl does). The schedules, and which of
them repack, are the setup YAML's (``study.schedules``, ``study.repack_schedules``): the same
settings ``laminar simulate`` runs. Prints throughput and the systems-paper metrics per
schedule, and laminar's ratios next to the published ones (``benchmarks/published.py``).

    python benchmarks/schedules.py [--steps N] [--setups paper_7b_256gpu,...] [--json FILE]
    python benchmarks/schedules.py --workload tool_calling [--steps N] [--scale F]
    python benchmarks/schedules.py --workload agent [--steps N] [--scale F] [--ahead 1,2]

``--workload tool_calling`` runs ``examples/sim/paper_7b_tool_calling.yaml`` (ReTool-style
multi-turn trajectories with long-tailed tool latency, ``sim.tools``): the YAML's schedules
plus laminar without repack, laminar's ratio over each, and the tool figures, next to the
paper's 1.21x-5.42x at 7B (§8 / Fig. 12). ``--scale F`` multiplies the GPUs, the trainer's
GPUs and the prompts per step by ``F`` (a quicker, smaller run of the same shape).

``--workload agent`` runs ``examples/sim/paper_7b_agent.yaml`` (agents that own their loop,
behind the gateway: episodes of tens of short calls on a growing context, long-tailed tool
and think times between calls, each call placed at its call boundary; ``sim.agent``): the
same schedules plus laminar without repack, episodes/s and tokens/s side by side, and
laminar's ratio over sync next to ROLL Flash's 2.72x for agentic RL.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import EXAMPLES, SETUP_NAMES, SETUPS, ratio, say, table
from published import PUBLISHED

from laminar_core import load_config
from laminar_core.sim.study import simulate_schedule

TOOL_SETUP = "paper_7b_tool_calling"
AGENT_SETUP = "paper_7b_agent"
# Laminar §8 / Fig. 12 (reading note): tool calling (ReTool) at 7B, Laminar over the baselines
TOOL_PUBLISHED = (1.21, 5.42)

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


def run_multi_turn(
    steps: int,
    scale: float = 1.0,
    setup: str = TOOL_SETUP,
    progress=say,
    ahead: tuple[float, ...] = (),
) -> list[dict[str, Any]]:
    """A multi-turn setup (tool calling, agent): each schedule of its YAML, then laminar
    without repack, then laminar at each ``buffer.max_ahead_batches`` of ``ahead`` (how far
    ahead of the trainer it admits: a bound on sessions in flight and on staleness)."""
    over = [f"run.steps={steps}"]
    if scale != 1.0:
        base = load_config(EXAMPLES / f"{setup}.yaml").cfg
        over += [
            f"cluster.gpus={max(2, round(base.cluster.gpus * scale))}",
            f"cluster.trainer_gpus={max(1, round(base.cluster.trainer_gpus * scale))}",
            f"data.prompts_per_step={max(1, round(base.data.prompts_per_step * scale))}",
        ]
    path = EXAMPLES / f"{setup}.yaml"
    resolved = load_config(path, over)
    runs = [(spec, resolved) for spec in resolved.cfg.study.schedules]
    runs.append(("laminar (no repack)", load_config(path, [*over, "repack.policy=none"])))
    for k in ahead:
        cfg = load_config(path, [*over, f"buffer.max_ahead_batches={k}"])
        runs.append((f"laminar (max_ahead {k:g})", cfg))
    rows = []
    for label, cfg in runs:
        row = simulate_schedule(cfg, label.split(" (")[0], point=setup)
        row["schedule"] = label
        rows.append(row)
        progress(
            f"  {setup} {row['schedule']}: {row['throughput_tokens_per_s']:,.0f} tokens/s, "
            f"{row['trajectories_per_s']:,.2f} trajectories/s ({row['wall_seconds']:.1f} s wall)"
        )
    return rows


def tool_table(rows: list[dict[str, Any]]) -> str:
    """Laminar vs each schedule on the tool-calling workload, with the tool figures."""
    lam = next(r for r in rows if r["schedule"] == "laminar")["throughput_tokens_per_s"]
    out = []
    for r in rows:
        t = r["throughput_tokens_per_s"]
        out.append(
            [
                r["schedule"],
                r["repack"],
                f"{t:,.0f}",
                "-" if r["schedule"] == "laminar" else f"{ratio(lam, t):.2f}x",
                f"{r['tool_calls_per_trajectory']:.2f}",
                f"{r['tool_latency_p50_s']:.1f} / {r['tool_latency_p99_s']:.1f}",
                f"{r['tool_observation_tokens_mean']:,.0f}",
                f"{r['tool_kv_hit_share']:.0%}",
                f"{r['kv_use_mean']:.0%}",
                f"{r['trajectory_latency_mean_s']:,.0f} / {r['trajectory_latency_p99_s']:,.0f}",
                f"{r['staleness_mean']:.2f} / {r['staleness_max']}",
                f"{r['trainer_idle_share']:.0%}",
                f"{r['repacks']} / {r['repacked_trajectories']}",
            ]
        )
    header = [
        "schedule",
        "repack",
        "tok/s",
        "laminar x",
        "tool calls / traj",
        "tool latency s p50 / p99",
        "obs tokens / call",
        "KV kept hit",
        "KV all",
        "latency s mean / p99",
        "staleness mean / max",
        "trainer idle",
        "moves / moved",
    ]
    base = [
        ratio(lam, r["throughput_tokens_per_s"])
        for r in rows
        if r["schedule"] in ("sync", "one_step", "stale:4", "stale:4+partial")
    ]
    lo, hi = TOOL_PUBLISHED
    note = (
        f"laminar over the baselines (sync, one_step, stale:4, stale:4+partial): "
        f"{min(base):.2f}x-{max(base):.2f}x simulated; published at 7B (Laminar §8 / "
        f"Fig. 12, reading note): {lo:.2f}x-{hi:.2f}x"
    )
    return table(out, header) + "\n" + note


def agent_table(rows: list[dict[str, Any]]) -> str:
    """Laminar vs each schedule on the agent workload: episodes/s and tokens/s side by side,
    and what a session's calls met (KV kept between calls, weight versions per episode)."""
    lam = next(r for r in rows if r["schedule"] == "laminar")
    out = []
    for r in rows:
        eps, tok = r["trajectories_per_s"], r["throughput_tokens_per_s"]
        mine = r["schedule"] == "laminar"
        out.append(
            [
                r["schedule"],
                r["repack"],
                f"{eps:,.2f}",
                "-" if mine else f"{ratio(lam['trajectories_per_s'], eps):.2f}x",
                f"{tok:,.0f}",
                "-" if mine else f"{ratio(lam['throughput_tokens_per_s'], tok):.2f}x",
                f"{r['tool_calls_per_trajectory'] + 1:.1f}",
                f"{r['call_gap_p50_s']:.1f} / {r['call_gap_p99_s']:.1f}",
                f"{r['tool_kv_hit_share']:.0%}",
                f"{r['versions_per_trajectory_mean']:.2f}",
                f"{r['trajectory_latency_mean_s']:,.0f} / {r['trajectory_latency_p99_s']:,.0f}",
                f"{r['staleness_mean']:.2f} / {r['staleness_max']}",
                f"{r['trainer_idle_share']:.0%}",
                f"{r['rollout_idle_share']:.0%}",
                f"{r['repacks']} / {r['repacked_trajectories']}",
            ]
        )
    header = [
        "schedule",
        "repack",
        "episodes/s",
        "laminar x",
        "tok/s",
        "laminar x",
        "calls / episode",
        "gap s p50 / p99",
        "KV kept hit",
        "versions / episode",
        "episode latency s mean / p99",
        "staleness mean / max",
        "trainer idle",
        "rollout idle",
        "moves / moved",
    ]
    sync = next(r for r in rows if r["schedule"] == "sync")
    pub = PUBLISHED["roll_flash_agentic_over_sync"]
    note = (
        f"laminar over sync (episodes/s): "
        f"{ratio(lam['trajectories_per_s'], sync['trajectories_per_s']):.2f}x simulated; "
        f"published: {pub.text()} ({pub.what}; {pub.source})"
    )
    return table(out, header) + "\n" + note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="default 10 (tool_calling: 4)")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--workload", choices=["math", "tool_calling", "agent"], default="math")
    ap.add_argument(
        "--scale", type=float, default=1.0, help="tool_calling, agent: GPUs and prompts x F"
    )
    ap.add_argument(
        "--ahead",
        default="",
        help="tool_calling, agent: laminar also at these buffer.max_ahead_batches (e.g. 1,2)",
    )
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    if args.workload in ("tool_calling", "agent"):
        agent = args.workload == "agent"
        setup = AGENT_SETUP if agent else TOOL_SETUP
        ahead = tuple(float(x) for x in args.ahead.split(",") if x)
        rows = run_multi_turn(args.steps or 4, args.scale, setup, ahead=ahead)
        say()
        say(agent_table(rows) if agent else tool_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return
    rows = run(args.steps or 10, args.setups.split(","))
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

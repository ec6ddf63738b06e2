"""(c) Repack on vs off, laminar, at the Laminar paper's ablation placement by default: 32B on
64 trainer GPUs + 64 rollout GPUs (16 replicas of 4 GPUs).

Prints what the paper's ablation reports -- generation throughput and mean KV-cache use --
with the end-to-end throughput, trajectory latency, staleness and the moves' cost.

    python benchmarks/repack.py [--setup model_32b] [--gpus 128 --trainer-gpus 64] [--steps N]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import EXAMPLES, ratio, say, table
from published import PUBLISHED

from laminar_core import load_config
from laminar_core.sim.study import simulate_schedule


def run(
    steps: int, setup: str = "model_32b", gpus: int = 128, trainer_gpus: int = 64, progress=say
) -> dict[str, dict[str, Any]]:
    """``{"best_fit": row, "none": row}`` for laminar at ``setup`` on ``gpus``."""
    rows = {}
    for policy in ("best_fit", "none"):
        resolved = load_config(
            EXAMPLES / f"{setup}.yaml",
            [
                f"run.steps={steps}",
                f"cluster.gpus={gpus}",
                f"cluster.trainer_gpus={trainer_gpus}",
                f"repack.policy={policy}",
            ],
        )
        rows[policy] = simulate_schedule(resolved, "laminar", point=f"{setup} {gpus} GPUs")
        progress(
            f"  repack {policy}: {rows[policy]['throughput_tokens_per_s']:,.0f} tokens/s "
            f"({rows[policy]['wall_seconds']:.1f} s wall)"
        )
    return rows


METRICS = [
    ("throughput_tokens_per_s", "throughput (tok/s)", "{:,.0f}"),
    ("generation_tokens_per_s", "generation throughput (tok/s)", "{:,.0f}"),
    ("kv_use_mean", "KV use, all replicas", "{:.1%}"),
    ("kv_use_busy_mean", "KV use, busy replicas", "{:.1%}"),
    ("rollout_idle_share", "rollout idle share", "{:.1%}"),
    ("trainer_idle_share", "trainer idle share", "{:.1%}"),
    ("trajectory_latency_mean_s", "trajectory latency mean (s)", "{:,.1f}"),
    ("trajectory_latency_p99_s", "trajectory latency p99 (s)", "{:,.1f}"),
    ("trajectory_latency_max_s", "trajectory latency max (s)", "{:,.1f}"),
    ("staleness_mean", "staleness mean", "{:.2f}"),
    ("staleness_max", "staleness max", "{}"),
    ("repacks", "moves", "{}"),
    ("repacked_trajectories", "trajectories moved", "{}"),
    ("move_seconds", "time in moves (s, summed)", "{:,.0f}"),
    ("preemptions", "KV preemptions", "{}"),
]


def repack_table(rows: dict[str, dict[str, Any]]) -> str:
    on, off = rows["best_fit"], rows["none"]
    out = [[name, fmt.format(on[k]), fmt.format(off[k])] for k, name, fmt in METRICS]
    moved = on["repacked_trajectories"]
    per_move = on["move_seconds"] / moved if moved else 0.0
    out.append(["per moved trajectory (s)", f"{per_move:.2f}", "-"])
    return table(out, ["metric", "repack best_fit", "repack none"])


def summary(rows: dict[str, dict[str, Any]]) -> list[list[str]]:
    on, off = rows["best_fit"], rows["none"]
    g = ratio(on["generation_tokens_per_s"], off["generation_tokens_per_s"])
    t = ratio(on["throughput_tokens_per_s"], off["throughput_tokens_per_s"])
    lat = ratio(on["trajectory_latency_mean_s"], off["trajectory_latency_mean_s"])
    pub = PUBLISHED["repack_generation_gain"]
    kv0, kv1 = PUBLISHED["repack_kv_without"], PUBLISHED["repack_kv_with"]
    return [
        ["generation throughput, with / without", f"{g:.2f}x", pub.text()],
        ["throughput, with / without", f"{t:.2f}x", "none found"],
        [
            "KV use (busy replicas), without -> with",
            f"{off['kv_use_busy_mean']:.1%} -> {on['kv_use_busy_mean']:.1%}",
            f"{kv0.text()} -> {kv1.text()}",
        ],
        ["trajectory latency mean, with / without", f"{lat:.2f}x", "none found"],
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", default="model_32b")
    ap.add_argument("--gpus", type=int, default=128)
    ap.add_argument("--trainer-gpus", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="write both rows here")
    args = ap.parse_args()
    rows = run(args.steps, args.setup, args.gpus, args.trainer_gpus)
    say()
    say(repack_table(rows))
    say()
    say(table(summary(rows), ["figure", "ours (simulated)", "published (measured)"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

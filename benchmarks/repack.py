"""(c) Repack on/off at a fixed scale (laminar schedule, best_fit vs none).

python benchmarks/repack.py [--setup paper_7b_256gpu] [--steps N]
"""

from __future__ import annotations

import argparse

from _common import EXAMPLES, say, table

from laminar_core import load_config
from laminar_core.sim.study import simulate_schedule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", default="paper_7b_256gpu")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    rows = {}
    for policy in ("best_fit", "none"):
        resolved = load_config(
            EXAMPLES / f"{args.setup}.yaml", [f"run.steps={args.steps}", f"repack.policy={policy}"]
        )
        rows[policy] = simulate_schedule(resolved, "laminar")
    keys = [
        ("throughput_tokens_per_s", "{:,.0f}"),
        ("rollout_utilization", "{:.1%}"),
        ("trainer_idle_share", "{:.1%}"),
        ("staleness_mean", "{:.2f}"),
        ("staleness_max", "{}"),
        ("repacks", "{}"),
        ("repacked_trajectories", "{}"),
    ]
    say(
        table(
            [[k, fmt.format(rows["best_fit"][k]), fmt.format(rows["none"][k])] for k, fmt in keys],
            ["metric", "repack best_fit", "repack none"],
        )
    )
    ratio = rows["best_fit"]["throughput_tokens_per_s"] / rows["none"]["throughput_tokens_per_s"]
    say(f"throughput with repack / without: {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""(e) Wall time to simulate ten iterations of the 72B, 1024-GPU setup (goal: < 30 s).

python benchmarks/sim_speed.py [--schedule laminar]
"""

from __future__ import annotations

import argparse

from _common import EXAMPLES, say

from laminar_core import load_config
from laminar_core.sim.study import simulate_schedule


def run(steps: int = 10, schedule: str = "laminar") -> dict:
    """The study row of ``steps`` 72B / 1024-GPU iterations, with ``trajectories`` added."""
    resolved = load_config(EXAMPLES / "paper_72b_1024gpu.yaml", [f"run.steps={steps}"])
    row = simulate_schedule(resolved, schedule)
    d = resolved.cfg.data
    row["trajectories"] = row["steps"] * d.prompts_per_step * d.samples_per_prompt
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="laminar")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    row = run(args.steps, args.schedule)
    say(
        f"72B on 1024 GPUs, {args.schedule}, {row['steps']} iterations "
        f"({row['trajectories']:,} trajectories, {row['replicas']} replicas): "
        f"{row['sim_seconds']:,.0f} simulated s in {row['wall_seconds']:.1f} s wall (goal < 30 s); "
        f"{row['sim_seconds'] / row['wall_seconds']:,.0f}x faster than real time"
    )
    say(f"wall_seconds={row['wall_seconds']:.2f}")


if __name__ == "__main__":
    main()

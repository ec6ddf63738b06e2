"""(d) The control plane's own overhead: trajectories per second the loop sustains.

Zero-latency simulated engines (no decode, prefill, training or transfer time) leave only
the loop itself: dispatch, per-trajectory tasks, the partial-response pool, the experience
buffer, group release, trainer steps, relay publishes and repack. Goal: >= 10,000/s on a
2-core machine, so the control plane is never the bottleneck.

    python benchmarks/loop_overhead.py [--steps N] [--replicas R]

The last line is ``trajectories_per_second=N`` (scripts read it).
"""

from __future__ import annotations

import argparse
import time

from _common import say

from laminar_core import load_config
from laminar_core.runtime.local import build_local_run
from laminar_core.sim.clock import run_virtual


def measure(steps: int, replicas: int, schedule: str) -> tuple[int, float]:
    resolved = load_config(
        None,
        [
            f"schedule={schedule}",
            f"run.steps={steps}",
            f"cluster.gpus={replicas + 8}",
            "cluster.trainer_gpus=8",
            "cluster.gpus_per_node=8",
            "data.prompts_per_step=64",
            "data.samples_per_prompt=16",
            "rollout.max_concurrent=1024",
            "rollout.max_tokens=1024",
            "rollout.heartbeat_s=1",
            "rollout.partial_sync_s=0",
            "rollout.sim.decode_step_s=0",
            "rollout.sim.prefill_s_per_token=0",
            "rollout.sim.weight_load_s=0",
            "trainer.sim.kind=linear",
            "trainer.sim.gpu_seconds_per_token=0",
            "trainer.sim.step_overhead_s=0",
            "trainer.sim.switch=false",
            "relay.sim.start_s=0",
            "relay.sim.link_gbps=1e12",
            "relay.sim.push_gbps=1e12",
            "model.params_b=0.001",
            "relay.chunks=1",
            "repack.interval_s=1",
            "telemetry.events=false",
        ],
    )

    async def main() -> int:
        run = build_local_run(resolved)
        await run.controller.run(steps)
        return sum(r.trajectories for r in run.controller.records)

    t0 = time.perf_counter()
    n = run_virtual(main())
    return n, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--replicas", type=int, default=16)
    args = ap.parse_args()
    say(f"zero-latency engines, {args.replicas} replicas, 64 prompts x 16 samples per step")
    rates = {}
    for schedule in ("sync", "laminar"):
        n, wall = measure(args.steps, args.replicas, schedule)
        rates[schedule] = n / wall
        say(
            f"  {schedule:8s} {n} trajectories consumed in {wall:.2f} s wall: "
            f"{n / wall:,.0f} trajectories/s (goal >= 10,000)"
        )
    say(f"trajectories_per_second={rates['laminar']:.0f}")


if __name__ == "__main__":
    main()

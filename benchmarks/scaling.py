"""(b) Strong scaling: the same global batch on a growing cluster, per model size.

Efficiency = (throughput at the largest scale / at the smallest) / (GPU ratio). The paper
reports 53.7% for Laminar on math at 1024 GPUs.

    python benchmarks/scaling.py [--steps N] [--models 7b,32b,72b]
"""

from __future__ import annotations

import argparse

from _common import EXAMPLES, say, table

from laminar_core import load_config
from laminar_core.sim.study import run_study


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--models", default="7b,32b,72b")
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="extra config overrides, e.g. trainer.sim.scaling_exponent=0.85",
    )
    args = ap.parse_args()
    summary = []
    for model in args.models.split(","):
        resolved = load_config(
            EXAMPLES / f"sweep_{model}.yaml", [f"run.steps={args.steps}", *args.set]
        )
        rows = run_study(
            resolved,
            progress=lambda r, model=model: say(
                f"  {model} {r['gpus']:>5} GPUs {r['schedule']:8s} "
                f"{r['throughput_tokens_per_s']:>12,.0f} tokens/s ({r['wall_seconds']:.1f} s wall)"
            ),
        )
        for sched in ("laminar", "sync"):
            pts = sorted(
                (r["gpus"], r["throughput_tokens_per_s"]) for r in rows if r["schedule"] == sched
            )
            (g0, t0), (g1, t1) = pts[0], pts[-1]
            eff = (t1 / t0) / (g1 / g0)
            summary.append(
                [
                    model,
                    sched,
                    f"{g0}->{g1}",
                    f"{t0:,.0f}",
                    f"{t1:,.0f}",
                    f"{t1 / t0:.2f}x",
                    f"{eff:.1%}",
                ]
            )
    say()
    say(
        table(
            summary,
            ["model", "schedule", "GPUs", "tok/s small", "tok/s large", "speed-up", "efficiency"],
        )
    )
    say("paper: Laminar strong-scaling efficiency 53.7% (math)")


if __name__ == "__main__":
    main()

"""(b) Strong scaling: the same global batch on a growing cluster, per model size.

Efficiency = (throughput at the largest scale / at the smallest) / (GPU ratio). The trainer's
speed comes from the FLOP / parallelism model (``trainer.sim``), so it does not speed up
linearly with GPUs. The Laminar paper reports 53.7% for Laminar on math.

    python benchmarks/scaling.py [--steps N] [--models 7b,32b,72b] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import EXAMPLES, say, table
from published import PUBLISHED

from laminar_core import load_config
from laminar_core.sim.study import run_study


def run(steps: int, models: list[str], extra: list[str] = (), progress=say) -> list[dict[str, Any]]:
    """One row per (model, sweep point, schedule of the sweep YAML); ``model`` added."""
    rows = []
    for model in models:
        resolved = load_config(EXAMPLES / f"sweep_{model}.yaml", [f"run.steps={steps}", *extra])

        def report(r: dict[str, Any], model: str = model) -> None:
            progress(
                f"  {model} {r['gpus']:>5} GPUs {r['schedule']:8s} "
                f"{r['throughput_tokens_per_s']:>12,.0f} tokens/s ({r['wall_seconds']:.1f} s wall)"
            )

        for r in run_study(resolved, progress=report):
            r["model"] = model
            rows.append(r)
    return rows


def efficiencies(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, schedule): smallest and largest scale and the efficiency between."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for sched in dict.fromkeys(r["schedule"] for r in rows if r["model"] == model):
            pts = sorted(
                (r["gpus"], r["throughput_tokens_per_s"])
                for r in rows
                if r["model"] == model and r["schedule"] == sched
            )
            (g0, t0), (g1, t1) = pts[0], pts[-1]
            out.append(
                {
                    "model": model,
                    "schedule": sched,
                    "gpus": (g0, g1),
                    "throughput": (t0, t1),
                    "speedup": t1 / t0 if t0 else float("nan"),
                    "efficiency": (t1 / t0) / (g1 / g0) if t0 else float("nan"),
                }
            )
    return out


def scaling_table(rows: list[dict[str, Any]]) -> str:
    out = [
        [
            e["model"].upper(),
            e["schedule"],
            f"{e['gpus'][0]} -> {e['gpus'][1]}",
            f"{e['throughput'][0]:,.0f}",
            f"{e['throughput'][1]:,.0f}",
            f"{e['speedup']:.2f}x",
            f"{e['efficiency']:.1%}",
        ]
        for e in efficiencies(rows)
    ]
    return table(
        out, ["model", "schedule", "GPUs", "tok/s small", "tok/s large", "speed-up", "efficiency"]
    )


def points_table(rows: list[dict[str, Any]]) -> str:
    """Every sweep point: throughput, the ratio laminar / sync, trainer and rollout idle."""
    out = []
    for r in rows:
        out.append(
            [
                r["model"].upper(),
                str(r["gpus"]),
                f"{r['trainer_gpus']} / {r['replicas']}",
                r["schedule"],
                f"{r['throughput_tokens_per_s']:,.0f}",
                f"{r['train_step_s']:.1f}",
                f"{r['trainer_idle_share']:.0%}",
                f"{r['rollout_idle_share']:.0%}",
                f"{r['staleness_mean']:.2f} / {r['staleness_max']}",
            ]
        )
    return table(
        out,
        [
            "model",
            "GPUs",
            "train GPUs / replicas",
            "schedule",
            "tok/s",
            "train s",
            "trainer idle",
            "rollout idle",
            "staleness mean / max",
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--models", default="7b,32b,72b")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides (key=value)")
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    rows = run(args.steps, args.models.split(","), args.set)
    say()
    say(scaling_table(rows))
    pub = PUBLISHED["strong_scaling_efficiency"]
    say(f"published: {pub.what} {pub.text()} ({pub.source})")
    say()
    say(points_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

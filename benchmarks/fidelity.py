"""(g) Fidelity report: the simulator's figures next to the published, measured ones.

Runs the paper's setups and sweeps -- the per-replica work spread before and after the
dispatch policies (``dispatch_spread``), the schedules at the largest scale (``schedules``),
strong scaling (``scaling``), the repack ablation (``repack``) -- and prints, per figure, the
simulator's number, the published one where a public source has it (``published.py``), and
their ratio. ``--out DIR`` keeps each part's rows as JSON (``DIR/<part>.json``) and the
report as ``DIR/fidelity.json``; ``--from DIR`` rebuilds the report from saved parts without
running anything; ``benchmarks/make_readme.py DIR/fidelity.json`` regenerates
``benchmarks/README.md`` from it.

    python benchmarks/fidelity.py [--out DIR] [--parts spread,schedules,scaling,repack]
        [--steps N] [--scaling-steps N] [--spread-steps N] [--from DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import dispatch_spread
import loop_overhead
import repack
import scaling
import schedules
import sim_speed
from _common import EXAMPLES, ROOT, SETUP_NAMES, say, table
from published import PUBLISHED

from laminar_core import load_config
from laminar_core.relay.latency import chain_latency, optimal_chunks
from laminar_core.sim.study import simulate_schedule

PARTS = ("spread", "schedules", "scaling", "repack", "sensitivity", "overhead", "speed")
# machine-dependent (wall time): run them where the figures are quoted for
TIMED = ("overhead", "speed")


# One assumption changed at a time, at 7B / 256 GPUs: how much each moves the figures.
SENSITIVITY = [
    ("laminar", "the paper setup", []),
    ("laminar", "window 4 batches", ["buffer.max_ahead_batches=4"]),
    ("laminar", "window 8 batches", ["buffer.max_ahead_batches=8"]),
    ("laminar", "no repack", ["repack.policy=none"]),
    ("laminar", "flat decode (no KV reads)", ["rollout.sim.kv_read_s_per_token=0"]),
    (
        "laminar",
        "flat decode, no repack",
        ["rollout.sim.kv_read_s_per_token=0", "repack.policy=none"],
    ),
    ("laminar", "trainer MFU 50%", ["trainer.sim.mfu=0.5"]),
    ("stale:4+partial", "the paper setup", []),
    ("stale:4+partial", "flat decode (no KV reads)", ["rollout.sim.kv_read_s_per_token=0"]),
    ("sync", "the paper setup", []),
    ("sync", "flat decode (no KV reads)", ["rollout.sim.kv_read_s_per_token=0"]),
    ("sync", "no offload/onload switch", ["trainer.sim.switch=false"]),
]


def sensitivity(steps: int, setup: str = "paper_7b_256gpu") -> list[dict[str, Any]]:
    rows = []
    for spec, what, overrides in SENSITIVITY:
        resolved = load_config(EXAMPLES / f"{setup}.yaml", [f"run.steps={steps}", *overrides])
        row = simulate_schedule(resolved, spec, point=setup)
        row["variant"] = what
        rows.append(row)
        say(f"  {spec} / {what}: {row['throughput_tokens_per_s']:,.0f} tokens/s")
    return rows


def sensitivity_table(rows: list[dict[str, Any]]) -> str:
    out = [
        [
            r["schedule"],
            r["variant"],
            r["repack"],
            f"{r['throughput_tokens_per_s']:,.0f}",
            f"{r['generation_tokens_per_s']:,.0f}",
            f"{r['trainer_idle_share']:.0%}",
            f"{r['rollout_idle_share']:.0%}",
            f"{r['kv_use_busy_mean']:.0%}",
            f"{r['trajectory_latency_mean_s']:,.0f}",
            f"{r['staleness_mean']:.2f} / {r['staleness_max']}",
        ]
        for r in rows
    ]
    header = ["schedule", "variant", "repack", "tok/s", "gen tok/s", "trainer idle"]
    header += ["rollout idle", "KV busy", "latency mean s", "staleness mean / max"]
    return table(out, header)


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def figure(
    name: str, ours: float, key: str | None, fmt: str = "{:.2f}x", note: str = ""
) -> dict[str, Any]:
    pub = PUBLISHED.get(key) if key else None
    value = pub.value if pub else None
    return {
        "figure": name,
        "ours": ours,
        "ours_text": fmt.format(ours),
        "published": value,
        "published_text": pub.text() if pub else "none found",
        "ratio": ours / value if value else None,
        "source": pub.source if pub else "-",
        "note": note,
    }


def relay_broadcast_72b_127() -> float:
    """The chain model's time for 72B to reach the last of 127 relays, with the simulated
    link (``relay.sim`` of the 72B setup)."""
    resolved = load_config(EXAMPLES / "paper_72b_1024gpu.yaml")
    cfg, link = resolved.cfg, resolved.engine_options["relay"]
    gbps, start = link.link_gbps, link.start_s
    t_byte = 8.0 / (gbps * 1e9)
    nbytes = cfg.model.params_b * 1e9 * 2
    k = optimal_chunks(127, nbytes, t_byte, start)
    return chain_latency(127, nbytes, k, t_byte, start)


def figures(parts: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    largest = "at the largest scale only (the paper's mean also covers smaller scales)"
    if "schedules" in parts:
        rows = parts["schedules"]
        r = schedules.ratios(rows)
        base = [x for b in schedules.PAPER_BASELINES for x in r.get(b, [])]
        out += [
            figure("laminar / verl (sync), max", max(r["sync"]), "laminar_over_sync_max"),
            figure(
                "laminar / verl (sync), mean",
                _mean(r["sync"]),
                "laminar_over_sync_mean",
                note=largest,
            ),
            figure(
                "laminar / one-step, mean",
                _mean(r["one_step"]),
                "laminar_over_one_step_mean",
                note=largest,
            ),
            figure(
                "laminar / AReaL (stale:4+partial), mean",
                _mean(r["stale:4+partial"]),
                "laminar_over_areal_mean",
                note=largest,
            ),
            figure(
                "laminar / {verl, one-step, AReaL}, mean over setups",
                _mean(base),
                "laminar_over_all_largest_mean",
            ),
        ]
        grouped = schedules.by_setup(rows)

        def over_sync(res: dict[str, Any], spec: str) -> float:
            return res[spec]["throughput_tokens_per_s"] / res["sync"]["throughput_tokens_per_s"]

        areal = [over_sync(res, "stale:4+partial") for res in grouped.values()]
        one = [over_sync(res, "one_step") for res in grouped.values()]
        out += [
            figure(
                "AReaL (stale:4+partial) / sync, max",
                max(areal),
                "areal_over_sync_max",
                note="AReaL's own paper: other hardware and workload",
            ),
            figure(
                "one-step / sync, mean",
                _mean(one),
                "one_step_over_sync_mean",
                note="AsyncFlow's paper: Ascend NPUs, other workload",
            ),
        ]
        if "paper_7b_256gpu" in grouped:
            res = grouped["paper_7b_256gpu"]
            out.append(
                figure(
                    "7B: AReaL-style (stale:4+partial) / sync",
                    res["stale:4+partial"]["throughput_tokens_per_s"]
                    / res["sync"]["throughput_tokens_per_s"],
                    "fully_async_over_sync_7b",
                    note="ours at 256 GPUs, verl's at 128 (2.35-2.67x published)",
                )
            )
        gen = [res["sync"]["generation_share"] * 100 for res in grouped.values()]
        out.append(
            figure(
                "sync: generation share of an iteration, max over setups",
                max(gen),
                "generation_share_sync",
                "{:.1f}%",
            )
        )
        lam = [res["laminar"] for res in grouped.values()]
        out.append(
            figure(
                "laminar staleness max (after warm-up), max over setups",
                max(x["staleness_max"] for x in lam),
                "staleness_max",
                "{:.0f}",
            )
        )
        stalls = (("paper_32b_512gpu", "stall_32b_s"), ("paper_72b_1024gpu", "stall_72b_s"))
        for setup, key in stalls:
            if setup in grouped:
                out.append(
                    figure(
                        f"trainer stall per weight push, {SETUP_NAMES[setup]}",
                        grouped[setup]["laminar"]["weight_sync_stall_s"],
                        key,
                        "{:.2f} s",
                    )
                )
    out.append(
        figure(
            "72B broadcast to 127 relays (chain model, simulated link)",
            relay_broadcast_72b_127(),
            "relay_72b_127_s",
            "{:.2f} s",
            note="the paper's is an upper bound ('under 1.6 s')",
        )
    )
    if "scaling" in parts:
        for e in scaling.efficiencies(parts["scaling"]):
            if e["schedule"] == "laminar":
                out.append(
                    figure(
                        f"laminar strong-scaling efficiency, {e['model'].upper()} "
                        f"{e['gpus'][0]} -> {e['gpus'][1]} GPUs",
                        e["efficiency"] * 100,
                        "strong_scaling_efficiency",
                        "{:.1f}%",
                    )
                )
    if "repack" in parts:
        rows = parts["repack"]
        on, off = rows["best_fit"], rows["none"]
        out += [
            figure(
                "repack: generation throughput with / without (32B, 64 + 64 GPUs)",
                on["generation_tokens_per_s"] / off["generation_tokens_per_s"],
                "repack_generation_gain",
            ),
            figure(
                "repack: KV use (busy replicas) without",
                off["kv_use_busy_mean"] * 100,
                "repack_kv_without",
                "{:.1f}%",
            ),
            figure(
                "repack: KV use (busy replicas) with",
                on["kv_use_busy_mean"] * 100,
                "repack_kv_with",
                "{:.1f}%",
            ),
            figure(
                "repack: time from a move to the moved trajectory's next token",
                on["move_seconds"] / max(1, on["repacked_trajectories"]),
                "repack_overhead_s",
                "{:.2f} s",
                note="the paper's 'repack overhead' may be defined otherwise",
            ),
        ]
    return out


def figures_table(figs: list[dict[str, Any]]) -> str:
    out = []
    for f in figs:
        r = f["ratio"]
        out.append(
            [
                f["figure"],
                f["ours_text"],
                f["published_text"],
                f"{r:.2f}" if r is not None and not math.isnan(r) else "-",
                f["source"],
                f["note"],
            ]
        )
    header = ["figure", "ours (simulated)", "published (measured)", "ours / published"]
    return table(out, [*header, "source", "note"])


def run_parts(args: argparse.Namespace, out: Path | None) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    wanted = args.parts.split(",")
    for name in wanted:
        t0 = time.perf_counter()
        say(f"== {name}")
        if name == "spread":
            parts[name] = dispatch_spread.run(args.spread_steps)
        elif name == "schedules":
            parts[name] = schedules.run(args.steps)
        elif name == "scaling":
            parts[name] = scaling.run(args.scaling_steps, ["7b", "32b", "72b"])
        elif name == "repack":
            parts[name] = repack.run(args.steps)
        elif name == "sensitivity":
            parts[name] = sensitivity(args.sensitivity_steps)
        elif name == "overhead":
            parts[name] = {}
            for sched in ("sync", "laminar"):
                n, wall = loop_overhead.measure(40, 16, sched)
                parts[name][sched] = {"trajectories": n, "wall_seconds": wall, "per_s": n / wall}
                say(f"  {sched}: {n / wall:,.0f} trajectories/s")
        elif name == "speed":
            parts[name] = sim_speed.run(10)
            say(f"  72B / 1024 GPUs, 10 steps: {parts[name]['wall_seconds']:.1f} s wall")
        else:
            raise SystemExit(f"fidelity: unknown part {name!r}; known: {', '.join(PARTS)}")
        say(f"   ({time.perf_counter() - t0:.0f} s wall)")
        if out is not None:
            (out / f"{name}.json").write_text(json.dumps(parts[name], indent=1) + "\n")
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(p for p in PARTS if p not in TIMED))
    ap.add_argument("--steps", type=int, default=10, help="schedules and repack")
    ap.add_argument("--scaling-steps", type=int, default=8)
    ap.add_argument("--spread-steps", type=int, default=4)
    ap.add_argument("--sensitivity-steps", type=int, default=6)
    ap.add_argument("--out", help="keep each part's rows and the report here")
    ap.add_argument("--from", dest="source", help="build the report from saved parts")
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.source:
        src = Path(args.source)
        saved = [p for p in PARTS if (src / f"{p}.json").exists()]
        parts = {p: json.loads((src / f"{p}.json").read_text()) for p in saved}
        out = out or src
    else:
        parts = run_parts(args, out)
    figs = figures(parts)
    say()
    tables = [
        ("spread", dispatch_spread.spread_table),
        ("schedules", schedules.throughput_table),
        ("schedules", schedules.metrics_table),
        ("scaling", scaling.scaling_table),
        ("repack", repack.repack_table),
        ("sensitivity", sensitivity_table),
    ]
    for part, render in tables:
        if part in parts:
            say(render(parts[part]))
            say()
    say(figures_table(figs))
    if out is not None:
        report = {"parts": sorted(parts), "figures": figs, "root": str(ROOT)}
        (out / "fidelity.json").write_text(json.dumps(report, indent=1) + "\n")
        say(f"\nwrote {out / 'fidelity.json'}")


if __name__ == "__main__":
    main()

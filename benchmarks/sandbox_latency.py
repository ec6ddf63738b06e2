"""Per-call latency of ``python_sandbox``'s local sandboxes: this tree next to another checkout.

    python benchmarks/sandbox_latency.py --baseline /path/to/other/checkout
        [--calls 100] [--rounds 4] [--isolation bwrap namespaces] [--preload numpy sympy]

A call is ``SandboxPool.run(code)`` on a warm sandbox (the pool's one worker has finished
warming before each call is timed): handing the code over, the fork that drops privileges,
sets the limits and installs the seccomp filter, running the code, tearing the sandbox's
process tree down and classifying the outcome. Warming the next sandbox (starting the
interpreter, importing ``preload``) happens between calls and is timed separately ("warm").
Two programs: ``print(1)`` and a numpy sum (numpy preloaded, as ReTool's example does).

Each variant runs in its own process, its ``laminar_core`` and ``laminar_sandbox`` first on
``PYTHONPATH``; the two alternate in ``rounds`` rounds, so a machine whose load changes
meanwhile (a shared one) weighs on both alike. Root and bwrap / unshare(1) needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, say, table

PROGRAMS = {"print(1)": "print(1)", "numpy": "import numpy as np\nprint(np.arange(1000).sum())"}


async def _measure(isolation: str, calls: int, preload: list[str]) -> dict[str, list[float]]:
    from laminar_sandbox import Limits, SandboxPool

    pool = SandboxPool(Limits(memory_mb=1024), isolation, workers=1, preload=preload)
    await pool.start()
    out: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    out["warm"] = []
    try:
        slot = pool._slots[0]
        for i in range(calls):
            name = list(PROGRAMS)[i % len(PROGRAMS)]
            await slot.warm  # the sandbox for this call, warm
            t0 = time.perf_counter()
            r = await pool.run(PROGRAMS[name], 30.0)
            out[name].append(time.perf_counter() - t0)
            assert r.status == "ok", r
            warm_start = time.perf_counter()
            await slot.warm
            out["warm"].append(time.perf_counter() - warm_start)
    finally:
        await pool.close()
    return out


def _worker(args: argparse.Namespace) -> None:
    result = asyncio.run(_measure(args.isolation[0], args.calls, args.preload))
    print(json.dumps(result))


def _run_variant(tree: Path, isolation: str, calls: int, preload: list[str]) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{tree}:{tree / 'plugins' / 'sandbox'}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, __file__, "--worker", "--calls", str(calls), "--isolation", isolation]
    out = subprocess.run(
        [*cmd, "--preload", *preload], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{1000 * values[min(len(values) - 1, int(q * len(values)))]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. a worktree of main)")
    ap.add_argument("--calls", type=int, default=100, help="calls per variant and isolation")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--isolation", nargs="+", default=["bwrap", "namespaces"])
    ap.add_argument("--preload", nargs="*", default=["numpy", "sympy"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    variants = {"this tree": ROOT}
    if args.baseline:
        variants = {"baseline": args.baseline.resolve(), **variants}
    per_round = max(1, args.calls // args.rounds)
    rows = []
    for isolation in args.isolation:
        got: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
        for r in range(args.rounds):
            for name, tree in variants.items():
                say(f"{isolation}: round {r + 1}/{args.rounds}, {name} ({tree})")
                for key, values in _run_variant(tree, isolation, per_round, args.preload).items():
                    got[name].setdefault(key, []).extend(values)
        for name in variants:
            for key in [*PROGRAMS, "warm"]:
                v = got[name].get(key, [])
                rows.append(
                    [isolation, key, name, str(len(v)), _ms(v, 0.5), _ms(v, 0.99),
                     f"{1000 * statistics.fmean(v):.1f}" if v else "-"]
                )  # fmt: skip
    say("")
    say(table(rows, ["isolation", "what", "variant", "n", "p50 ms", "p99 ms", "mean ms"]))


if __name__ == "__main__":
    main()

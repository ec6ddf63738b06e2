"""Per-call latency of ``python_sandbox``'s local sandboxes: this tree next to another checkout.

    python benchmarks/sandbox_latency.py --baseline /path/to/other/checkout
        [--calls 100] [--isolation bwrap namespaces] [--preload numpy sympy]

A call is ``SandboxPool.run(code)`` on a warm sandbox (the pool's one worker has finished
warming before each call is timed): handing the code over, the fork that drops privileges,
sets the limits and installs the seccomp filter, running the code, tearing the sandbox's
process tree down and classifying the outcome. Warming the next sandbox (starting the
interpreter, importing ``preload``) happens between calls and is timed separately ("warm").
"cpu": the CPU time a call costs the pool's process and the processes reaped through it,
which a loaded machine does not stretch as it does wall time. Under ``namespaces`` that is
the whole sandbox that ran the call, its warm-up included; bwrap's init does not pass its
children's time up, so under ``bwrap`` it is little more than the pool's own share.
Two programs: ``print(1)`` and a numpy sum (numpy preloaded, as ReTool's example does).

Each variant's pool lives in a worker process of its own, its ``laminar_core`` and
``laminar_sandbox`` first on ``PYTHONPATH``. The variants take turns call by call (which one
goes first alternates), each waiting for the other's next sandbox to be warm, so a machine
whose load changes meanwhile (a shared one) weighs on both alike. Root and bwrap /
unshare(1) needed; run it with an interpreter outside ``/tmp`` when the baseline predates
issue 33 (its sandbox hid an interpreter there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, say, table

HEADER = ["isolation", "what", "variant", "n", "p50 ms", "p99 ms", "mean ms"]
PROGRAMS = {"print(1)": "print(1)", "numpy": "import numpy as np\nprint(np.arange(1000).sum())"}


async def _serve(isolation: str, preload: list[str]) -> None:
    """The worker: start a pool, then time one call per program name read from stdin."""
    from laminar_sandbox import Limits, SandboxPool

    pool = SandboxPool(Limits(memory_mb=1024), isolation, workers=1, preload=preload)
    await pool.start()
    loop = asyncio.get_running_loop()
    try:
        slot = pool._slots[0]
        await slot.warm
        print("ready", flush=True)
        while name := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            cpu0 = _cpu_s()
            t0 = time.perf_counter()
            r = await pool.run(PROGRAMS[name], 30.0)
            call = time.perf_counter() - t0
            cpu = _cpu_s() - cpu0
            assert r.status == "ok", r
            t0 = time.perf_counter()
            await slot.warm  # the next call's sandbox, warm before the other variant goes
            out = {name: call, "warm": time.perf_counter() - t0, "cpu": cpu}
            print(json.dumps(out), flush=True)
    finally:
        await pool.close()


def _cpu_s() -> float:
    """CPU seconds of this process and of the descendants it reaped (see "cpu" above)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def _start(tree: Path, isolation: str, preload: list[str]) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": f"{tree}:{tree / 'plugins' / 'sandbox'}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, __file__, "--worker", "--isolation", isolation, "--preload", *preload]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit(f"{tree}: the sandbox pool did not start (its stderr is above)")
    return proc


def _call(proc: subprocess.Popen, name: str) -> dict[str, float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker ended during the {name} call (its stderr is above)")
    return json.loads(line)


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{1000 * values[min(len(values) - 1, int(q * len(values)))]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. a worktree of main)")
    ap.add_argument("--calls", type=int, default=100, help="calls per variant and isolation")
    ap.add_argument("--isolation", nargs="+", default=["bwrap", "namespaces"])
    ap.add_argument("--preload", nargs="*", default=["numpy", "sympy"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return asyncio.run(_serve(args.isolation[0], args.preload))
    variants = {"this tree": ROOT}
    if args.baseline:
        variants = {"baseline": args.baseline.resolve(), **variants}
    rows = []
    for isolation in args.isolation:
        got: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
        say(f"{isolation}: {args.calls} calls per variant, taking turns")
        procs = {name: _start(tree, isolation, args.preload) for name, tree in variants.items()}
        try:
            for i in range(args.calls):
                program = list(PROGRAMS)[i % len(PROGRAMS)]
                order = list(procs) if i % 4 < 2 else list(procs)[::-1]
                for name in order:
                    for key, value in _call(procs[name], program).items():
                        got[name].setdefault(key, []).append(value)
        finally:
            for proc in procs.values():
                assert proc.stdin is not None
                proc.stdin.close()  # the worker closes its pool and exits
                proc.wait(timeout=60)
        for name in variants:
            for key in [*PROGRAMS, "warm", "cpu"]:
                v = got[name].get(key, [])
                rows.append(
                    [isolation, key, name, str(len(v)), _ms(v, 0.5), _ms(v, 0.99),
                     f"{1000 * statistics.fmean(v):.1f}" if v else "-"]
                )  # fmt: skip
        say(table(rows, HEADER))  # so far: a run cut short keeps what it measured
    say("")
    say(table(rows, HEADER))


if __name__ == "__main__":
    main()

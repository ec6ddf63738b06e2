"""Where ``laminar train``'s start-up goes: CPU seconds per process, until the first trajectory.

    python benchmarks/startup.py [--config examples/quickstart.yaml] [--json FILE]
    python benchmarks/startup.py --baseline /work/main --rounds 3   # A/B, alternating

Runs ``laminar train CONFIG run.steps=2`` (model built first if missing) and samples every
process it starts (the driver, Ray's own, the trainer ranks, the replicas, the relays)
twice a second. Prints the run's own start-up line and when the first
trajectory came, each process kind's CPU seconds up to then, a timeline of how many cores
each kind used, and, for scale, what importing vLLM alone costs in a fresh process (every
replica pays it). On a machine with few cores start-up is CPU-bound: the sum of the CPU
seconds over the cores is the floor of its wall time.

``--baseline DIR`` runs DIR's ``laminar`` (``DIR/.venv/bin/laminar``, in DIR) and this
checkout's in turn, ``--rounds`` times each, and prints the medians side by side: on a
machine others share, only figures from one such run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
from _common import ROOT, say, table

KINDS = [  # (kind, what the process's name or command line holds), first match wins
    # (a host forked from the zygote has the zygote's command line and its own name)
    ("replica", "RolloutHost"),
    ("trainer", "TrainerHost"),
    ("relay", "RelayActor"),
    ("ray", "ray::"),  # Ray's idle workers and agents
    ("ray", "/ray/"),  # gcs_server, raylet, Ray's Python daemons
    ("zygote", "runtime.zygote"),  # runtime.zygote: the engines' imports, once per node
    ("driver", "laminar"),
]
ORDER = ["driver", "ray", "zygote", "trainer", "relay", "replica", "other"]


def kind_of(cmdline: str) -> str:
    for kind, key in KINDS:
        if key in cmdline:
            return kind
    return "other"


class Sampler:
    """CPU seconds of ``root`` and its descendants, by kind, sampled every ``every_s``."""

    def __init__(self, root: int, every_s: float = 0.5) -> None:
        self.root, self.every_s = root, every_s
        self.t0 = time.monotonic()
        self.kind: dict[int, str] = {}
        self.series: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic() - self.t0
            try:
                procs = [psutil.Process(self.root), *psutil.Process(self.root).children(True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    times = p.cpu_times()
                    cmd = " ".join([p.name(), *p.cmdline()])
                except psutil.Error:  # gone since the listing
                    continue
                cpu = times.user + times.system
                # a Ray worker is "ray::IDLE" until it becomes an actor: keep the last name
                if cmd:
                    self.kind[p.pid] = kind_of(cmd)
                self.series[p.pid].append((now, cpu))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_until(self, t: float) -> dict[str, float]:
        """CPU seconds each kind had used ``t`` seconds after the start."""
        out: dict[str, float] = defaultdict(float)
        for pid, s in self.series.items():
            before = [c for when, c in s if when <= t]
            if before:
                out[self.kind.get(pid, "other")] += before[-1]
        return dict(out)

    def timeline(self, window_s: float, until: float) -> list[tuple[float, dict[str, float]]]:
        """Cores each kind used per ``window_s`` window up to ``until``."""
        rows = []
        t = 0.0
        while t < until:
            a, b = self.cpu_until(t), self.cpu_until(t + window_s)
            rows.append((t, {k: (b.get(k, 0.0) - a.get(k, 0.0)) / window_s for k in ORDER}))
            t += window_s
        return rows


def vllm_import_seconds() -> float | None:
    """CPU seconds to import what a replica imports of vLLM, in a fresh process."""
    code = (
        "import time; t = time.process_time(); "
        "import vllm.engine.arg_utils, vllm.v1.engine.llm_engine; "
        "print(time.process_time() - t)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300
    )
    try:
        return float(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def measure(
    laminar: str, cwd: Path, config: str, model: str, out: str, extra: list[str] = ()
) -> dict:
    """One ``laminar train CONFIG run.steps=2 [extra]`` (``laminar``: the command, run in
    ``cwd``), sampled: its start-up line, first trajectory, and CPU seconds by kind until
    then."""
    cmd = [
        laminar, "train", config, f"model.path={model}", "run.steps=2",
        "run.checkpoint_every=0", f"run.out_dir={out}", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )
    sampler = Sampler(proc.pid)
    log = proc.stdout.read() if proc.stdout else ""
    proc.wait()
    sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{laminar} train failed ({proc.returncode}):\n{log[-3000:]}")
    startup = re.search(r"start-up: (.*)", log)
    first_m = re.search(r"first trajectory ([\d.]+)s", log)
    first = float(first_m.group(1)) if first_m else None
    # the command's clock starts with its process; the sampler's a moment later
    last = max((s[-1][0] for s in sampler.series.values() if s), default=0.0)
    until = first if first is not None else last
    procs = {k: sum(1 for kind in sampler.kind.values() if kind == k) for k in ORDER}
    return {
        "startup_line": startup.group(1) if startup else None,
        "first_trajectory_seconds": first,
        "cpu": sampler.cpu_until(until),
        "processes": procs,
        "sampler": sampler,
        "until": until,
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2 if n else float("nan")


def compare(a: argparse.Namespace) -> None:
    """``--baseline DIR``: DIR's ``laminar`` and this checkout's, alternating, ``--rounds``
    times each; medians side by side (one run of both on one machine, whatever its load)."""
    base = Path(a.baseline).resolve()
    arms = {"baseline": (str(base / ".venv" / "bin" / "laminar"), base), "this": ("laminar", ROOT)}
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    for r in range(a.rounds):
        for name, (laminar, cwd) in arms.items():
            with tempfile.TemporaryDirectory() as out:
                try:
                    m = measure(laminar, cwd, a.config, a.model, out, a.set)
                except RuntimeError as e:  # a loaded machine: Ray's node start can time out
                    say(f"round {r} {name}: failed, not counted: {str(e).splitlines()[-1]}")
                    continue
            m.pop("sampler")
            runs[name].append(m)
            total = sum(m["cpu"].values())
            say(
                f"round {r} {name}: first trajectory {m['first_trajectory_seconds']}s, "
                f"{total:.1f} CPU s; start-up: {m['startup_line']}"
            )
    rows = []
    firsts = {
        k: _median([m["first_trajectory_seconds"] or 0.0 for m in v]) for k, v in runs.items()
    }
    rows.append(["first trajectory, s (wall)", *(f"{firsts[k]:.1f}" for k in arms)])
    for kind in [*ORDER, "all"]:
        med = {
            k: _median(
                [sum(m["cpu"].values()) if kind == "all" else m["cpu"].get(kind, 0.0) for m in v]
            )
            for k, v in runs.items()
        }
        procs = {k: runs[k][-1]["processes"].get(kind) for k in arms} if kind != "all" else {}
        label = f"CPU s until then: {kind}" + (
            f" ({procs['baseline']} / {procs['this']} processes)" if procs else ""
        )
        rows.append([label, *(f"{med[k]:.1f}" for k in arms)])
    counted = ", ".join(f"{k} {len(v)}" for k, v in runs.items())
    say(f"\nmedians of alternating runs ({counted}), {psutil.cpu_count()} cores\n")
    say(table(rows, ["", f"baseline ({base})", "this checkout"]))
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    ap.add_argument("--model", default=str(ROOT / "runs" / "tiny-qwen2"))
    ap.add_argument("--window", type=float, default=4.0, help="timeline window, seconds")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="another checkout (with its .venv) to compare with, alternating runs",
    )
    ap.add_argument("--rounds", type=int, default=2, help="with --baseline: runs of each")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (e.g. runtime.start_timeout_s=900 on a "
        "loaded machine)",
    )
    a = ap.parse_args()
    if not Path(a.model, "config.json").exists():
        subprocess.run(["laminar", "tiny-model", a.model], check=True, env=_env())
    a.config, a.model = str(Path(a.config).resolve()), str(Path(a.model).resolve())
    if a.baseline:
        compare(a)
        return
    with tempfile.TemporaryDirectory() as out:
        try:
            m = measure("laminar", ROOT, a.config, a.model, out, a.set)
        except RuntimeError as e:
            sys.exit(str(e))
    sampler, until, first, cpu = m["sampler"], m["until"], m["first_trajectory_seconds"], m["cpu"]
    say(f"start-up: {m['startup_line'] or '?'}")
    say(f"first trajectory: {first}s after `laminar train` started")
    total = sum(cpu.values())
    cores = psutil.cpu_count() or 1
    say(
        f"\nCPU seconds until the first trajectory, by process kind ({cores} cores: "
        f"{total:.1f} CPU s is at least {total / cores:.1f} s of wall time)\n"
    )
    procs = m["processes"]
    say(
        table(
            [[k, str(procs[k]), f"{cpu.get(k, 0.0):.1f}"] for k in ORDER if k in cpu]
            + [["all", str(sum(procs.values())), f"{total:.1f}"]],
            ["kind", "processes", "CPU s"],
        )
    )
    rows = sampler.timeline(a.window, until)
    say(f"\ncores in use per {a.window:g} s window, by kind\n")
    say(
        table(
            [[f"{t:.0f}-{t + a.window:.0f}"] + [f"{r[k]:.2f}" for k in ORDER] for t, r in rows],
            ["seconds", *ORDER],
        )
    )
    imp = vllm_import_seconds()
    say(f"\nimporting vLLM alone (a fresh process): {imp:.1f} CPU s per replica" if imp else "")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "startup_line": m["startup_line"],
                    "first_trajectory_seconds": first,
                    "cpu_seconds_until_first_trajectory": {k: round(v, 2) for k, v in cpu.items()},
                    "processes": procs,
                    "cores": cores,
                    "timeline": [[t, {k: round(v, 2) for k, v in r.items()}] for t, r in rows],
                    "vllm_import_cpu_seconds": imp,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

"""Chaos: kill real processes of a real run (``kill -9`` by pid) and measure the recovery.

``run_with_faults(resolved, faults)`` starts a run on the Ray runtime, and when the trainer
reaches each fault's step it kills the fault's target: a replica actor, the vLLM engine
process under one, a relay actor, the master relay, a trainer rank, or a whole Ray node (its
raylet and every process of it). The run goes on to its last step; ``audit_run`` then checks
from its events and checkpoints that nothing was lost or trained twice, and ``outcomes``
says, per fault, when it was detected and recovered and what it cost.

Used by ``tests/chaos/`` (a reduced set in CI) and ``benchmarks/chaos.py`` (the full set).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar_core.config.loader import ResolvedConfig
from laminar_core.runtime.run import Run
from laminar_core.telemetry.events import (
    EVENTS_FILE,
    Event,
    NodeEvicted,
    RelayFailed,
    RelayRestarted,
    ReplicaAdded,
    ReplicaEvicted,
    ReplicaFailed,
    ReplicaRestarted,
    TrainerRestarted,
    read_events,
)
from laminar_core.testing.audit import AuditReport, audit_run

log = logging.getLogger(__name__)

FAULT_KINDS = ("replica", "engine", "relay", "master", "trainer", "node", "join")

# the events that say a fault of each kind was noticed, and that it was recovered from
_DETECTED: dict[str, tuple[type[Event], ...]] = {
    "replica": (ReplicaFailed,),
    "engine": (ReplicaFailed,),
    "relay": (RelayFailed,),
    "master": (RelayFailed,),
    "trainer": (TrainerRestarted,),
    "node": (ReplicaFailed, RelayFailed, TrainerRestarted),
    "join": (ReplicaAdded,),
}
_RECOVERED: dict[str, tuple[type[Event], ...]] = {
    "replica": (ReplicaRestarted, ReplicaEvicted),
    "engine": (ReplicaRestarted, ReplicaEvicted),
    "relay": (RelayRestarted,),
    "master": (RelayRestarted,),
    "trainer": (TrainerRestarted,),
    "node": (ReplicaEvicted, NodeEvicted, ReplicaRestarted),
    "join": (ReplicaAdded,),
}


@dataclass
class Fault:
    """Once the trainer has done ``at_step`` steps, kill ``kind``'s target ``index`` (a
    replica, a relay, a rank, or a Ray node of the test cluster other than the head), or
    (``join``) add a Ray node to the cluster (a run with ``runtime.elastic`` grows onto it)."""

    kind: str
    at_step: int
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; known: {', '.join(FAULT_KINDS)}")


@dataclass
class FaultOutcome:
    fault: Fault
    pids: list[int] = field(default_factory=list)
    killed_at: float = 0.0  # loop time
    detected_after_s: float | None = None
    recovered_after_s: float | None = None
    redirected: int = 0  # in-flight trajectories resumed from the partial-response pool
    restarted: int = 0  # in-flight trajectories started again from their prompt
    samples_per_second_before: float | None = None
    samples_per_second_after: float | None = None


@dataclass
class ChaosResult:
    run_dir: Path
    steps: int
    outcomes: list[FaultOutcome]
    audit: AuditReport
    pids: set[int] = field(default_factory=set)  # every process the run had, over its life
    shm_files: set[str] = field(default_factory=set)  # what its engines mapped in /dev/shm


async def run_processes(run: Run) -> set[int]:
    """The pids of ``run``'s actors (trainer ranks, replicas, relays) and of the processes
    under them (vLLM's engine core and workers)."""
    import psutil

    rt: Any = run.runtime
    handles = [*rt.trainer_handles, *rt.replica_handles, *(r.handle for r in rt.relays)]
    pids: set[int] = set()
    for h in handles:
        try:
            pid = int(await asyncio.wait_for(h.pid.remote(), 5))
        except Exception:  # dead or being restarted
            continue
        pids.add(pid)
        with contextlib.suppress(psutil.Error):
            pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    return pids


async def _pid(call: Any) -> int:
    return int(await call.remote())


async def target_pids(
    run: Run, fault: Fault, cluster: Any = None, joined: list[Any] | None = None
) -> list[int]:
    """The processes ``fault`` kills in ``run`` (a Ray runtime's run)."""
    rt: Any = run.runtime
    if fault.kind == "replica":
        return [await _pid(rt.replica_handles[fault.index].pid)]
    if fault.kind == "engine":
        import psutil

        parent = await _pid(rt.replica_handles[fault.index].pid)
        kids = psutil.Process(parent).children(recursive=True)
        # vLLM's engine core; SGLang's scheduler (under its host process)
        marks = ("EngineCore", "sglang::scheduler")
        cores = [p.pid for p in kids if any(m in " ".join(_name(p)) for m in marks)]
        if not cores:
            raise RuntimeError(f"replica {fault.index} has no engine process under pid {parent}")
        return cores[:1]
    if fault.kind == "relay":
        return [await _pid(rt.relays[fault.index].handle.pid)]
    if fault.kind == "master":
        return [await _pid(rt.relays[run.tier.master_rank - 1].handle.pid)]
    if fault.kind == "trainer":
        return [await _pid(rt.trainer_handles[fault.index].pid)]
    # a node that joined during the run, else one of the cluster's other nodes
    nodes = list(joined or ()) or sorted(
        getattr(cluster, "worker_nodes", ()), key=lambda n: n.unique_id
    )
    if fault.index >= len(nodes):
        raise ValueError("a node fault needs a ray.cluster_utils.Cluster with that many nodes")
    node = nodes[fault.index]
    cluster.worker_nodes.discard(node)  # it is gone: the cluster must not stop it later
    return [p.process.pid for procs in node.all_processes.values() for p in procs if p.process]


def _name(p: Any) -> list[str]:
    try:
        return [p.name(), *p.cmdline()]
    except Exception:
        return []


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def run_with_faults(
    resolved: ResolvedConfig,
    faults: list[Fault],
    run_dir: Path,
    cluster: Any = None,
    join_cpus: int = 1,
) -> ChaosResult:
    """Run ``resolved`` (Ray runtime) to its last step, killing as ``faults`` say;
    ``cluster`` (a ``ray.cluster_utils.Cluster``) for node faults, ``join_cpus`` the CPUs
    of a node that joins."""
    from laminar_core.runtime.train import start_run

    run = await start_run(resolved, run_dir)
    outcomes: list[FaultOutcome] = []
    loop = asyncio.get_running_loop()
    pending = sorted(faults, key=lambda f: f.at_step)

    seen_pids: set[int] = set()
    seen_shm: set[str] = set()
    joined: list[Any] = []

    async def watch() -> None:
        while True:
            seen_pids.update(await run_processes(run))
            for e in getattr(run.runtime, "replica_engines", []):
                seen_shm.update(e.shm_files)
            await asyncio.sleep(2.0)

    async def injector() -> None:
        while pending:
            await asyncio.sleep(0.1)
            if run.controller.step < pending[0].at_step:
                continue
            fault = pending.pop(0)
            out = FaultOutcome(fault)
            out.redirected, out.restarted = run.manager.redirected, run.manager.restarted
            if fault.kind == "join":
                out.killed_at = loop.time()
                joined.append(await asyncio.to_thread(cluster.add_node, num_cpus=join_cpus))
                outcomes.append(out)
                continue
            try:
                out.pids = await target_pids(run, fault, cluster, joined)
            except Exception as e:  # the target is already gone (a previous fault)
                log.warning("fault %s: no target (%s)", fault, e)
                continue
            out.killed_at = loop.time()
            log.warning("chaos: kill -9 %s (%s) at step %s", out.pids, fault.kind, fault.at_step)
            kill(out.pids)
            outcomes.append(out)

    tasks = [asyncio.ensure_future(injector()), asyncio.ensure_future(watch())]
    try:
        records = await run.controller.run(resolved.cfg.run.steps)
    finally:
        for t in tasks:
            t.cancel()
        run.events.write_jsonl(run_dir / "events.jsonl")
        run.events.write_chrome_trace(run_dir / "trace.json")
        counts = (run.manager.redirected, run.manager.restarted)
        await run.close()
    _measure(outcomes, read_events(run_dir / EVENTS_FILE).events, records, counts)
    audit = audit_run(run_dir)
    # the step the run reached (records also hold steps redone after a trainer restart)
    return ChaosResult(run_dir, run.controller.step, outcomes, audit, seen_pids, seen_shm)


def _measure(
    outcomes: list[FaultOutcome],
    events: list[Event],
    records: list[Any],
    counts: tuple[int, int],
) -> None:
    """Fill each outcome's detection / recovery times and throughput from the events."""
    for i, out in enumerate(outcomes):
        nxt = outcomes[i + 1].killed_at if i + 1 < len(outcomes) else float("inf")
        kind = out.fault.kind
        if kind in ("node", "join"):
            # a node's parts fail and recover together: all of it, up to the next fault
            after = [e for e in events if out.killed_at <= e.t < nxt]
        else:
            # one part: its own first failure and recovery, even when a later fault was
            # injected while it was coming back (a replica restart outlasts a step or two)
            after = [e for e in events if out.killed_at <= e.t]
            if kind in ("replica", "engine"):
                after = [e for e in after if e.actor == f"r{out.fault.index}"]
        det = [e for e in after if isinstance(e, _DETECTED[kind])]
        rec = [e for e in after if isinstance(e, _RECOVERED[kind])]
        if det:
            first = det[0]
            start = first.t - (first.duration if isinstance(first, TrainerRestarted) else 0)
            out.detected_after_s = start - out.killed_at
        if rec:
            out.recovered_after_s = (rec[-1] if kind == "node" else rec[0]).t - out.killed_at
        end_counts = (
            (outcomes[i + 1].redirected, outcomes[i + 1].restarted)
            if i + 1 < len(outcomes)
            else counts
        )
        out.redirected, out.restarted = (
            end_counts[0] - out.redirected,
            end_counts[1] - out.restarted,
        )
        before = [r for r in records if r.end < out.killed_at]
        later = [r for r in records if out.killed_at <= r.end < nxt]
        out.samples_per_second_before = _rate(before[-3:])
        out.samples_per_second_after = _rate(later[:3])


def _rate(records: list[Any]) -> float | None:
    if len(records) < 2:
        return None
    span = records[-1].end - records[0].end
    return sum(r.trajectories for r in records[1:]) / span if span > 0 else None

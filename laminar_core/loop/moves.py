"""Repack moves: the repack policy's plan, executed by the rollout manager.

Every ``repack.interval_s`` and after every trainer step the policy (``repack/``) gets a
snapshot of the live replicas that are not loading weights and returns moves; a move aborts
trajectories on its source and resumes them on its destination. It only ever joins replicas
of one version: a move between versions is refused (and counted) even if a policy proposes
one, and both replicas are pinned (``loop.supervisor``) while the abort is in flight so
neither can change version under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from laminar_core.buffers import PartialPool
from laminar_core.interfaces import RepackPolicy, ReplicaFailure
from laminar_core.loop.placement import Placement
from laminar_core.loop.supervisor import ReplicaSlot, ReplicaSupervisor
from laminar_core.loop.tasks import ManagerTasks
from laminar_core.telemetry import EventLog
from laminar_core.telemetry.events import RepackMove
from laminar_core.types import Move, ReplicaState

log = logging.getLogger(__name__)


class Repacker:
    """Plans and executes repack moves (module docstring)."""

    def __init__(
        self,
        policy: RepackPolicy | None,
        supervisor: ReplicaSupervisor,
        placement: Placement,
        pool: PartialPool,
        tasks: ManagerTasks,
        events: EventLog,
        probe_timeout_s: float,
        kick: Callable[[], None],
        fail: Callable[[ReplicaSlot, str], None],
    ) -> None:
        self.policy = policy
        self.supervisor = supervisor
        self.placement = placement
        self.pool = pool
        self.tasks = tasks
        self.events = events
        self.probe_timeout_s = probe_timeout_s
        self.kick = kick
        self.fail = fail
        self.asked = asyncio.Event()  # set: plan a round at once (a trainer step was taken)
        self.moves = 0  # moves executed
        self.moved = 0  # trajectories they moved
        self.refused = 0  # moves refused (between versions, or to a replica not taking work)

    async def run(self, interval_s: float) -> None:
        """Plan a round every ``interval_s`` (0: only when asked) and whenever asked."""
        while not self.tasks.stopping:
            if interval_s > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.asked.wait(), interval_s)
            else:
                await self.asked.wait()
            self.asked.clear()
            await self.once()

    async def snapshot(self) -> list[ReplicaState]:
        """The live replicas not loading weights, as the policy sees them."""
        live = [s for s in self.supervisor.slots if s.alive and not s.updating]
        probes = [asyncio.ensure_future(s.engine.stats()) for s in live]
        late: set[asyncio.Future] = set()
        if probes:
            # a replica that does not answer is left out of this round (the heartbeat
            # decides whether it is dead); repack never waits on it
            _, late = await asyncio.wait(probes, timeout=self.probe_timeout_s)
            for t in late:
                t.cancel()
        states = []
        for s, probe in zip(live, probes):
            if probe in late:
                continue
            st = probe.exception() or probe.result()
            if isinstance(st, BaseException):
                if isinstance(st, ReplicaFailure):
                    self.fail(s, str(st))
                continue
            states.append(
                ReplicaState(
                    s.replica_id,
                    s.version,
                    st.kv_use,
                    s.prev_kv,
                    len(s.inflight),
                    # only what it can launch elsewhere (an agent's call is not in the pool)
                    sorted(t for t in s.inflight if t in self.pool),
                )
            )
            s.prev_kv = st.kv_use
        return states

    async def once(self) -> list[Move]:
        """One round: snapshot, plan, execute."""
        assert self.policy is not None
        moves = self.policy.plan(await self.snapshot())
        for mv in moves:
            await self.execute(mv)
        return moves

    async def execute(self, mv: Move) -> None:
        by_id = self.supervisor.by_id
        src, dst = by_id[mv.source], by_id[mv.destination]
        if src.version != dst.version or not (src.alive and dst.alive) or dst.updating:
            self.refused += 1
            log.warning(
                "repack: skipped %s -> %s (versions %s/%s, alive %s/%s)",
                src.replica_id,
                dst.replica_id,
                src.version,
                dst.version,
                src.alive,
                dst.alive,
            )
            return
        ids = [t for t in mv.traj_ids if t in src.inflight]
        if not ids:
            return
        try:
            # dst must not change version while the move is in flight
            with self.supervisor.pinned(src, dst):
                parts = await src.engine.abort(ids)
        except ReplicaFailure as e:
            self.fail(src, str(e))
            return
        self.moves += 1
        self.events.record(
            RepackMove(
                t=self.tasks.now(),
                actor=src.replica_id,
                to=dst.replica_id,
                n=len(parts),
                ids=[p.traj_id for p in parts],  # `laminar report` draws each move on its rows
            )
        )
        for p in parts:
            src.inflight.discard(p.traj_id)
            item = self.pool.get(p.traj_id)
            if item is None:
                continue
            self.moved += 1
            if dst.alive and dst.version == p.version:
                self.placement.launch(dst, item, p)
            else:
                self.placement.redirect(item, p)
        src.wake.set()
        dst.wake.set()
        self.kick()

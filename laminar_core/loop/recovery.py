"""Health and recovery: heartbeats, replica restarts and evictions, node relay restarts.

Every ``heartbeat_s`` each live replica is asked for its stats (and, every
``partial_sync_s``, for the partial outputs of what it holds, so the partial-response pool
can resume them elsewhere); one that raises ``ReplicaFailure`` or does not answer within
``heartbeat_timeout_s`` is failed. A failed replica is re-initialised in place by the
runtime (``restart_fn``) and goes back into rotation after loading its node relay's newest
version; after ``max_restarts`` failures within ``restart_window_s`` it is evicted instead,
and once every replica is evicted the run stops. A node relay found dead is replaced
(``restart_relay_fn``) as often; its replicas then load what they missed. Without the
runtime's functions (studies, relays in the driver) nothing is restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from laminar_core.buffers import PartialPool
from laminar_core.interfaces import ReplicaFailure, RolloutEngine
from laminar_core.loop.options import ManagerOptions
from laminar_core.loop.supervisor import (
    FAILED,
    RESTARTING,
    NodeRelayLike,
    ReplicaSlot,
    ReplicaSupervisor,
)
from laminar_core.loop.tasks import ManagerTasks
from laminar_core.telemetry import EventLog
from laminar_core.telemetry.events import (
    NodeEvicted,
    RelayFailed,
    RelayRestarted,
    ReplicaEvicted,
    ReplicaRestarted,
)

log = logging.getLogger(__name__)

# Re-initialise replica ``index`` in place (the runtime's ``restart_replica``): returns the
# new engine, started.
RestartFn = Callable[[int], Awaitable[RolloutEngine]]
# Replace a dead node relay (the runtime's ``restart_relay``: it rejoins the chain and
# catches up).
RestartRelayFn = Callable[[int], Awaitable[None]]


class Recovery:
    """Heartbeats and restarts (module docstring). ``fail`` fails a replica the manager's
    way (its trajectories redirected, then :meth:`recover`); ``back`` starts a restarted
    replica's driver."""

    def __init__(
        self,
        supervisor: ReplicaSupervisor,
        pool: PartialPool,
        tasks: ManagerTasks,
        events: EventLog,
        options: ManagerOptions,
        fail: Callable[[ReplicaSlot, str], None],
        back: Callable[[ReplicaSlot], None],
    ) -> None:
        self.supervisor = supervisor
        self.pool = pool
        self.tasks = tasks
        self.events = events
        self.opt = options
        self.fail = fail
        self.back = back
        self.restart_fn: RestartFn | None = None  # None: a failed replica stays out
        self.restart_relay_fn: RestartRelayFn | None = None  # None: relays are not restarted
        self.replica_restarts = 0
        self.relay_restarts = 0
        self._relay_failures: dict[int, list[float]] = {}
        self._relays_restarting: set[int] = set()

    # -- heartbeats ----------------------------------------------------------------------------
    async def heartbeats(self) -> None:
        """The heartbeat loop (module docstring); also watches the node relays."""
        last_sync = 0.0
        now = self.tasks.now
        while not self.tasks.stopping:
            await asyncio.sleep(self.opt.heartbeat_s)
            if self.restart_relay_fn is not None:
                self._watch_relays()
            live = [s for s in self.supervisor.slots if s.alive]
            sync = self.opt.partial_sync_s > 0 and now() - last_sync >= self.opt.partial_sync_s
            if sync:
                last_sync = now()
            probes = {asyncio.ensure_future(self._probe(s, sync)): (s, s.incarnation) for s in live}
            if not probes:
                continue
            _, late = await asyncio.wait(probes, timeout=self.opt.heartbeat_timeout_s)
            for task in late:
                task.cancel()
                slot, incarnation = probes[task]
                if slot.incarnation == incarnation:
                    self.fail(slot, "heartbeat timed out")

    async def _probe(self, slot: ReplicaSlot, sync: bool) -> None:
        incarnation = slot.incarnation
        try:
            await slot.engine.stats()
            if sync and slot.inflight:
                for p in await slot.engine.partials(sorted(slot.inflight)):
                    self.pool.update(p)
        except ReplicaFailure as e:
            if slot.incarnation == incarnation:
                self.fail(slot, str(e))

    # -- replicas ------------------------------------------------------------------------------
    def recover(self, slot: ReplicaSlot, reason: str) -> None:
        """``slot`` failed for ``reason``: restart it (or evict it), if the runtime can."""
        if self.restart_fn is not None:
            self.tasks.spawn(self._recover(slot, reason))

    async def _recover(self, slot: ReplicaSlot, reason: str) -> None:
        """Re-initialise a failed replica in place and put it back into rotation; it loads
        the node relay's newest version before it takes work."""
        assert self.restart_fn is not None
        sup = self.supervisor
        while not self.tasks.stopping:
            if sup.failures_within(slot, self.opt.restart_window_s) > self.opt.max_restarts:
                self._evict(slot, reason)
                return
            t0 = self.tasks.now()
            sup.transition(slot, RESTARTING, reason)
            try:
                engine = await self.restart_fn(slot.index)
                version = (await engine.stats()).version
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the restart failed: that is one more failure
                reason = f"restart failed: {type(e).__name__}: {e}"
                log.warning("replica %s: %s", slot.replica_id, reason)
                sup.transition(slot, FAILED, reason)
                continue
            if self.tasks.stopping:
                return
            self._revive(slot, engine, version, self.tasks.now() - t0)
            return

    def _revive(self, slot: ReplicaSlot, engine: RolloutEngine, version: int, took: float) -> None:
        self.supervisor.restarted(slot, engine, version)
        self.replica_restarts += 1
        log.warning(
            "replica %s restarted in %.1fs (version %s); back in rotation",
            slot.replica_id,
            took,
            version,
        )
        self.events.record(
            ReplicaRestarted(
                t=self.tasks.now(), actor=slot.replica_id, duration=took, version=version
            )
        )
        self.supervisor.back_in_rotation(slot, "restarted")
        self.back(slot)

    def _evict(self, slot: ReplicaSlot, reason: str) -> None:
        sup = self.supervisor
        sup.evict(slot, f"{len(slot.failures)} failures within {self.opt.restart_window_s:g}s")
        log.warning(
            "replica %s evicted after %d failures within %.0fs (last: %s); %d replicas left",
            slot.replica_id,
            len(slot.failures),
            self.opt.restart_window_s,
            reason,
            sup.replicas_alive,
        )
        now = self.tasks.now()
        self.events.record(ReplicaEvicted(t=now, actor=slot.replica_id, reason=reason))
        node = slot.relay.node
        if all(s.evicted for s in sup.slots if s.relay.node == node):
            log.warning("every replica of node %s was evicted: the node is out", node)
            self.events.record(NodeEvicted(t=now, actor=f"node{node}"))
        if all(s.evicted for s in sup.slots):
            self.tasks.fail(RuntimeError(f"every replica was evicted (the last: {reason})"))

    # -- node relays ---------------------------------------------------------------------------
    def _watch_relays(self) -> None:
        """A node relay found dead is replaced (at most ``max_restarts`` times within
        ``restart_window_s``; after that its node's replicas keep the weights they hold)."""
        for relay in {id(s.relay): s.relay for s in self.supervisor.slots}.values():
            rid = relay.relay_id
            if relay.alive or rid in self._relays_restarting:
                continue
            now = self.tasks.now()
            recent = [
                t for t in self._relay_failures.get(rid, []) if now - t <= self.opt.restart_window_s
            ]
            if len(recent) >= self.opt.max_restarts:
                continue  # given up on: logged when it happened
            self._relay_failures[rid] = [*recent, now]
            self._relays_restarting.add(rid)
            self.tasks.spawn(self._recover_relay(relay))

    async def _recover_relay(self, relay: NodeRelayLike) -> None:
        assert self.restart_relay_fn is not None
        rid, t0 = relay.relay_id, self.tasks.now()
        log.warning("relay %s (node %s) died: starting a new one", rid, relay.node)
        self.events.record(RelayFailed(t=t0, actor=f"relay{rid}"))
        try:
            await self.restart_relay_fn(rid)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            left = self.opt.max_restarts - len(self._relay_failures.get(rid, []))
            log.warning(
                "relay %s could not be restarted (%s: %s)%s",
                rid,
                type(e).__name__,
                e,
                "; trying again" if left > 0 else "; giving up: its node keeps old weights",
            )
            return
        finally:
            self._relays_restarting.discard(rid)
        self.relay_restarts += 1
        took = self.tasks.now() - t0
        log.warning("relay %s restarted in %.1fs, at version %s", rid, took, relay.version)
        self.events.record(RelayRestarted(t=self.tasks.now(), actor=f"relay{rid}", duration=took))
        for s in self.supervisor.slots:  # its replicas may now load what they missed
            if s.relay is relay:
                s.wake.set()

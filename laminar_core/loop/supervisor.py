"""The replica lifecycle: one phase per replica, one transition function, every transition an
event.

The rollout manager keeps a :class:`ReplicaSlot` per replica. Its phase changes only through
:meth:`ReplicaSupervisor.transition`, which refuses what the table below does not allow
(:class:`InvalidTransition`: a bug in the loop; raised in one of the manager's tasks it stops
the run) and records every change as a ``replica_state`` event
(``telemetry.events.ReplicaTransition``).

==========  ==========  ===============================================================
phase       takes work  meaning
==========  ==========  ===============================================================
JOINING     no          started and added to a running job (``runtime.elastic``)
OPEN        yes         alive and in rotation: dispatch may hand it new trajectories
DRAINING    no          alive; a newer version is at its node relay: it finishes what it
                        holds (under partial rollout: aborts it), then pulls
UPDATING    no          loading weights
FAILED      no          dead; its trajectories were redirected; a restart may follow
RESTARTING  no          the runtime is re-initialising it
EVICTED     no          failed more than ``max_restarts`` times within
                        ``restart_window_s``: out for good
==========  ==========  ===============================================================

Allowed transitions (``TRANSITIONS``)::

    JOINING ---------> OPEN | DRAINING         back in rotation (DRAINING if its node relay
    RESTARTING ------> OPEN | DRAINING           already holds a newer version)
    UPDATING --------> OPEN | DRAINING         weights loaded (DRAINING: a newer one arrived
                                                 meanwhile, or the one it mapped was replaced)
    OPEN ------------> DRAINING                a newer version reached its node relay
    OPEN | DRAINING -> UPDATING                nothing in flight (or aborted): pull
    OPEN | DRAINING | UPDATING -> FAILED       an engine call raised ReplicaFailure, or a
                                                 heartbeat timed out
    RESTARTING ------> FAILED                  the restart itself failed
    FAILED ----------> RESTARTING | EVICTED
    EVICTED ---------> (none)

Pins are a count, not a phase: operations that need a replica's version to stay put (a
repack move in flight, on both its replicas; a partial-rollout abort; an eval round's
requests) pin it, and a pinned replica starts no pull; what it takes and its phase do not
change. A restart gives the slot a new *incarnation* (a new engine): it starts unpinned, and
work of the old incarnation that ends later (a pin released, a pull that returns) does not
touch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from laminar_core.interfaces import RolloutEngine, WeightsRef
from laminar_core.relay.events import RelayEvents
from laminar_core.telemetry import EventLog
from laminar_core.telemetry.events import ReplicaTransition


class ReplicaPhase(enum.Enum):
    """A replica's place in its lifecycle (module docstring)."""

    JOINING = "joining"
    OPEN = "open"
    DRAINING = "draining"
    UPDATING = "updating"
    FAILED = "failed"
    RESTARTING = "restarting"
    EVICTED = "evicted"


JOINING, OPEN, DRAINING, UPDATING = (
    ReplicaPhase.JOINING,
    ReplicaPhase.OPEN,
    ReplicaPhase.DRAINING,
    ReplicaPhase.UPDATING,
)
FAILED, RESTARTING, EVICTED = ReplicaPhase.FAILED, ReplicaPhase.RESTARTING, ReplicaPhase.EVICTED

TRANSITIONS: dict[ReplicaPhase, frozenset[ReplicaPhase]] = {
    JOINING: frozenset({OPEN, DRAINING}),
    OPEN: frozenset({DRAINING, UPDATING, FAILED}),
    DRAINING: frozenset({UPDATING, FAILED}),
    UPDATING: frozenset({OPEN, DRAINING, FAILED}),
    FAILED: frozenset({RESTARTING, EVICTED}),
    RESTARTING: frozenset({OPEN, DRAINING, FAILED}),
    EVICTED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A transition the lifecycle does not allow: a bug in the loop, not in an engine."""


class NodeRelayLike(Protocol):
    """What the manager needs of a replica's node relay: a ``NodeRelay`` in this process,
    or the driver's proxy of one hosted on the replica's node (``relay.remote.RemoteRelay``).
    """

    relay_id: int
    node: int
    events: RelayEvents  # committed / shared, per version (``relay.events``)

    @property
    def version(self) -> int:
        """The newest version a replica on the node can load."""

    @property
    def alive(self) -> bool: ...

    def weights(self) -> WeightsRef:
        """The newest version for ``update_weights``: the tensors of a relay in this
        process, a reference the replica loads on its node for a remote one."""


@dataclass(eq=False)
class ReplicaSlot:
    """The manager's view of one replica. Its phase is written by
    :meth:`ReplicaSupervisor.transition` only; ``pinned`` by ``pin`` / ``unpin``."""

    replica_id: str
    index: int
    engine: RolloutEngine
    relay: NodeRelayLike
    version: int = 0
    failures: list[float] = field(default_factory=list)  # when it failed (loop time)
    pinned: int = 0
    prev_kv: float = 1.0
    inflight: set[str] = field(default_factory=set)
    # multi-turn: trajectories whose last turn ran here and whose tool runs now (no batch
    # slot; counted as this replica's load by dispatch, ``loop.dispatch.load``)
    tooling: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    incarnation: int = 0  # restarts so far: which engine the slot's work belongs to
    _phase: ReplicaPhase = field(default=OPEN, repr=False)

    @property
    def phase(self) -> ReplicaPhase:
        return self._phase

    @property
    def alive(self) -> bool:
        """Running: OPEN, DRAINING or UPDATING."""
        p = self._phase
        return p is OPEN or p is DRAINING or p is UPDATING

    @property
    def updating(self) -> bool:
        return self._phase is UPDATING

    @property
    def evicted(self) -> bool:
        return self._phase is EVICTED


@dataclass(frozen=True)
class Pin:
    """A pin on ``slot``'s incarnation ``incarnation`` (module docstring)."""

    slot: ReplicaSlot
    incarnation: int


class ReplicaSupervisor:
    """The replicas of one run: their phases, the open set dispatch chooses from, pins and
    failure counts (module docstring). Synchronous: it calls no engine."""

    def __init__(self, slots: list[ReplicaSlot], events: EventLog, now: Callable[[], float]):
        self.slots = slots  # grows in place when replicas join (dispatch holds the same list)
        self.by_id = {s.replica_id: s for s in slots}
        self.events = events
        self.now = now
        # the OPEN replicas, in the order they (re)opened: dispatch breaks ties by it
        self.open: dict[str, ReplicaSlot] = {}
        self.newest_open = -1  # the newest version among them, as of the last refresh()
        self._stale = True  # the open set changed since the last refresh()
        self.failed: list[str] = []  # every failure, in order (a replica once per failure)
        self.evicted: list[str] = []
        for s in slots:
            if s.phase is not OPEN:
                raise InvalidTransition(f"replica {s.replica_id} starts {s.phase.value}")
            self.open[s.replica_id] = s

    # -- phases --------------------------------------------------------------------------------
    def transition(self, slot: ReplicaSlot, to: ReplicaPhase, reason: str) -> None:
        """Move ``slot`` to ``to``, keep the open set in step, record the event."""
        was = slot.phase
        if to not in TRANSITIONS[was]:
            raise InvalidTransition(
                f"replica {slot.replica_id}: {was.value} -> {to.value} is not a lifecycle "
                f"transition ({reason})"
            )
        alive = slot.alive
        slot._phase = to
        if was is OPEN:
            del self.open[slot.replica_id]
            self._stale = True
        elif to is OPEN:
            self.open[slot.replica_id] = slot
            self._stale = True
        elif alive and not slot.alive:
            # a replica that took no work died: dispatch must still recount the live ones
            # (a step split over them waits for its share otherwise)
            self._stale = True
        self.events.record(
            ReplicaTransition(
                t=self.now(),
                actor=slot.replica_id,
                previous=was.value,
                state=to.value,
                reason=reason,
            )
        )

    def drain(self, slot: ReplicaSlot, reason: str) -> None:
        """Stop handing ``slot`` new work, if it takes any (OPEN -> DRAINING)."""
        if slot.phase is OPEN:
            self.transition(slot, DRAINING, reason)

    def back_in_rotation(self, slot: ReplicaSlot, reason: str) -> None:
        """``slot`` is ready for work (weights loaded, restarted, joined): OPEN, unless its
        node relay already holds a newer version -- then DRAINING, and woken to pull it."""
        if slot.relay.version > slot.version:
            self.transition(slot, DRAINING, f"{reason}; its relay holds a newer version")
            slot.wake.set()
        else:
            self.transition(slot, OPEN, reason)

    def fail(self, slot: ReplicaSlot, reason: str) -> bool:
        """``slot`` failed: FAILED, woken (its driver ends). False if it was not alive."""
        if not slot.alive:
            return False
        self.transition(slot, FAILED, reason)
        slot.wake.set()
        self.failed.append(slot.replica_id)
        return True

    def restarted(self, slot: ReplicaSlot, engine: RolloutEngine, version: int) -> None:
        """``slot`` has a new engine holding ``version``: a new incarnation, unpinned."""
        slot.engine, slot.version = engine, version
        slot.incarnation += 1
        slot.pinned, slot.prev_kv = 0, 1.0
        slot.wake = asyncio.Event()

    def evict(self, slot: ReplicaSlot, reason: str) -> None:
        self.transition(slot, EVICTED, reason)
        self.evicted.append(slot.replica_id)

    def join(self, slot: ReplicaSlot) -> None:
        """Add a replica that joined the run (``runtime.elastic``): JOINING, until
        :meth:`back_in_rotation`."""
        slot._phase = JOINING
        self.slots.append(slot)
        self.by_id[slot.replica_id] = slot

    # -- what dispatch reads -------------------------------------------------------------------
    def refresh(self) -> bool:
        """Whether the open set or the live replicas changed since the last call;
        ``newest_open`` is then recomputed (call only with ``open`` non-empty)."""
        if not self._stale:
            return False
        self._stale = False
        self.newest_open = max(s.version for s in self.open.values())
        return True

    @property
    def replicas_alive(self) -> int:
        return sum(1 for s in self.slots if s.alive)

    # -- pins and failure counts ---------------------------------------------------------------
    def pin(self, slot: ReplicaSlot) -> Pin:
        """Keep ``slot`` on its version until :meth:`unpin` (module docstring)."""
        slot.pinned += 1
        return Pin(slot, slot.incarnation)

    def unpin(self, pin: Pin) -> None:
        if pin.slot.incarnation == pin.incarnation:
            pin.slot.pinned -= 1

    @contextlib.contextmanager
    def pinned(self, *slots: ReplicaSlot) -> Iterator[None]:
        pins = [self.pin(s) for s in slots]
        try:
            yield
        finally:
            for p in pins:
                self.unpin(p)

    def failures_within(self, slot: ReplicaSlot, window_s: float) -> int:
        """Record a failure of ``slot`` now; how many it had within the last ``window_s``."""
        now = self.now()
        slot.failures = [t for t in slot.failures if now - t <= window_s]
        slot.failures.append(now)
        return len(slot.failures)

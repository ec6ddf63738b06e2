"""The replica lifecycle (``loop.supervisor``): one phase per replica, the transitions its
table allows and no other, each one an event; and the rollout manager keeping to it through
failures, restarts and evictions on the virtual clock."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from laminar_core import load_config
from laminar_core.buffers import PartialPool
from laminar_core.loop.placement import Placement
from laminar_core.loop.supervisor import (
    TRANSITIONS,
    InvalidTransition,
    ReplicaPhase,
    ReplicaSlot,
    ReplicaSupervisor,
)
from laminar_core.loop.tasks import ManagerTasks
from laminar_core.relay.events import RelayEvents
from laminar_core.runtime import Run, build_local_run
from laminar_core.sim.clock import run_virtual
from laminar_core.sim.rollout import SimRolloutEngine
from laminar_core.telemetry import EventLog
from laminar_core.telemetry.events import ReplicaFailed, ReplicaTransition, TrajectoryDone

P = ReplicaPhase


@dataclasses.dataclass
class Relay:
    version: int = 0
    relay_id: int = 0
    node: int = 0
    alive: bool = True
    events: RelayEvents = dataclasses.field(default_factory=lambda: RelayEvents(0))


def supervisor(n: int = 3) -> tuple[ReplicaSupervisor, list[ReplicaSlot], Relay, EventLog]:
    relay, log = Relay(), EventLog()
    slots = [ReplicaSlot(f"r{i}", i, None, relay) for i in range(n)]  # type: ignore[arg-type]
    return ReplicaSupervisor(slots, log, lambda: 1.0), slots, relay, log


def test_a_pull_cycle_is_three_events_and_reopening_goes_last() -> None:
    sup, (r0, r1, _), relay, log = supervisor()
    assert list(sup.open) == ["r0", "r1", "r2"] and sup.refresh() and not sup.refresh()
    relay.version = 1
    sup.drain(r0, "version 1 at its relay")
    sup.drain(r0, "again")  # not OPEN: nothing happens
    sup.transition(r0, P.UPDATING, "pulling")
    assert (r0.alive, r0.updating, "r0" in sup.open) == (True, True, False)
    r0.version = 1
    sup.back_in_rotation(r0, "loaded version 1")
    assert list(sup.open) == ["r1", "r2", "r0"]  # dispatch breaks ties by this order
    assert sup.refresh() and sup.newest_open == 1
    assert [(e.actor, e.previous, e.state) for e in log.of(ReplicaTransition)] == [
        ("r0", "open", "draining"),
        ("r0", "draining", "updating"),
        ("r0", "updating", "open"),
    ]
    # a replica back in rotation under a relay with a newer version drains to pull it
    relay.version = 2
    sup.transition(r1, P.UPDATING, "pulling")
    r1.version = 1
    sup.back_in_rotation(r1, "loaded version 1")
    assert r1.phase is P.DRAINING and r1.wake.is_set() and "r1" not in sup.open


@pytest.mark.parametrize("was", list(P))
def test_only_the_tables_transitions_are_allowed(was: ReplicaPhase) -> None:
    for to in P:
        sup, (slot, *_), _, log = supervisor()
        slot._phase = was
        if was is not P.OPEN:
            del sup.open[slot.replica_id]
        if to in TRANSITIONS[was]:
            sup.transition(slot, to, "test")
            assert slot.phase is to and (slot.replica_id in sup.open) == (to is P.OPEN)
            assert len(log.of(ReplicaTransition)) == 1
        else:
            with pytest.raises(InvalidTransition, match=f"{was.value} -> {to.value}"):
                sup.transition(slot, to, "test")
            assert slot.phase is was and not log.events


def test_a_pin_taken_before_a_restart_does_not_unpin_the_new_engine() -> None:
    sup, (slot, *_), _, _ = supervisor()
    pin = sup.pin(slot)  # e.g. an eval request on the old engine
    sup.fail(slot, "died")
    sup.transition(slot, P.RESTARTING, "died")
    sup.restarted(slot, None, 0)  # type: ignore[arg-type]
    sup.back_in_rotation(slot, "restarted")
    sup.unpin(pin)  # the old request ends after the restart
    assert slot.pinned == 0  # -1 would keep its driver from ever pulling again
    with sup.pinned(slot):
        assert slot.pinned == 1
    assert slot.pinned == 0


def test_a_turn_can_be_placed_on_an_open_replica_of_a_version() -> None:
    sup, (r0, r1, r2), _, log = supervisor()
    r0.version, r1.version, r2.version = 1, 2, 2
    r1.inflight.update({"a", "b"})
    place = Placement(sup, PartialPool(), None, ManagerTasks(), log, 8, print, print)  # type: ignore[arg-type]
    assert place.least_loaded(1) is r0
    assert place.least_loaded(1, version=2) is r2 and place.least_loaded(1, min_version=2) is r2
    sup.drain(r2, "newer version")
    assert place.least_loaded(1, version=2) is r1  # draining replicas take no new turns
    assert place.least_loaded(7, version=2) is None  # r1 has no room for 7 more


# -- the manager keeps to it -----------------------------------------------------------------


def _run(overrides: list[str], hook) -> Run:
    resolved = load_config(None, overrides)

    async def main() -> Run:
        run = build_local_run(resolved, record_events=True)
        hook(run)
        await asyncio.wait_for(run.controller.run(resolved.cfg.run.steps), 3600.0)
        return run

    return run_virtual(main())


def _restarts(fail_forever: set[str]):
    """A runtime's ``restart_replica`` for simulated replicas: a fresh engine after 3 s, or
    an error for the replicas in ``fail_forever``."""

    def hook(run: Run) -> None:
        m = run.manager

        async def restart(index: int) -> SimRolloutEngine:
            old = m.slots[index].engine
            await asyncio.sleep(3.0)
            if old.replica_id in fail_forever:
                raise RuntimeError("no GPU left")
            cfg = dataclasses.replace(old.cfg, failures=[])
            engine = SimRolloutEngine(old.replica_id, cfg, old.lengths, ledger=old.ledger)
            await engine.start()
            return engine

        m.restart_fn = restart

    return hook


def test_every_phase_change_of_a_run_is_an_allowed_transition_event(small_overrides) -> None:
    failures = "[{replica: 1, at_s: 1.0}, {replica: 2, at_s: 2.0}, {replica: 3, at_s: 5.0}]"
    overrides = [*small_overrides, "run.steps=6", "rollout.max_restarts=2"]
    run = _run([*overrides, f"rollout.sim.failures={failures}"], _restarts({"r2"}))
    phase = {s.replica_id: "open" for s in run.manager.slots}
    seen: set[tuple[str, str]] = set()
    for e in run.events.of(ReplicaTransition):
        assert e.previous == phase[e.actor], e
        assert P(e.state) in TRANSITIONS[P(e.previous)], e
        phase[e.actor] = e.state
        seen.add((e.previous, e.state))
    assert phase == {s.replica_id: s.phase.value for s in run.manager.slots}
    assert phase["r2"] == "evicted" and run.manager.evicted_replicas == ["r2"]
    assert {("failed", "restarting"), ("restarting", "failed"), ("failed", "evicted")} <= seen
    assert {("open", "draining"), ("draining", "updating"), ("updating", "open")} <= seen
    assert ("restarting", "open") in seen or ("restarting", "draining") in seen
    # each failure of a running replica is one replica_failed event, at the same time
    running = {"open", "draining", "updating"}
    to_failed = [
        (e.t, e.actor)
        for e in run.events.of(ReplicaTransition)
        if e.state == "failed" and e.previous in running
    ]
    assert to_failed == [(e.t, e.actor) for e in run.events.of(ReplicaFailed)]


def test_a_pull_that_returns_after_its_replica_failed_does_not_reopen_it(small_overrides) -> None:
    """r1's heartbeat stops answering while it loads a version, and the load returns after
    the heartbeat failed it: r1 stays out of rotation and gets no more work (it used to be
    put back into the open set, dead, and handed new groups)."""
    failed_at: list[float] = []

    def hook(run: Run) -> None:
        slot = run.manager.by_id["r1"]
        engine = slot.engine
        real_stats, real_update = engine.stats, engine.update_weights
        hung = asyncio.Event()

        async def stats():
            if hung.is_set():
                await asyncio.sleep(1e6)  # never answers again
            return await real_stats()

        async def update_weights(weights):
            hung.set()
            await asyncio.sleep(4.0)  # past heartbeat_timeout_s: failed meanwhile
            failed_at.append(asyncio.get_running_loop().time())
            return await real_update(weights)

        engine.stats, engine.update_weights = stats, update_weights

    # sync: no newer version arrives during the load, so it used to reopen r1 at once
    run = _run([*small_overrides, "rollout.heartbeat_timeout_s=2", "schedule=sync"], hook)
    slot = run.manager.by_id["r1"]
    assert failed_at and run.manager.failed_replicas == ["r1"]
    assert slot.phase is P.FAILED and "r1" not in run.manager.supervisor.open
    assert slot.version == 0  # the load that returned late was not taken as done
    late = [e for e in run.events.of(TrajectoryDone) if e.actor == "r1" and e.t > failed_at[0]]
    assert not late, f"the failed replica finished {len(late)} trajectories after its load"

"""One placement rule for agent calls: ``loop.placement.choose_call_replica``.

The gateway's ``ManagerTurnBackend`` and the loop's ``Placement.place_turn`` (which the
simulator's ``sim_agent`` workload places its calls with) must choose the same replica in
the same state, so a simulated agent run predicts where a real run's calls go.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from laminar_core.gateway import TurnRequest
from laminar_core.loop.agent_backend import ManagerTurnBackend
from laminar_core.loop.placement import Placement, choose_call_replica
from laminar_core.loop.supervisor import OPEN
from laminar_core.types import SamplingParams


def _slot(rid: str, version: int, inflight: int, index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        replica_id=rid,
        index=index,
        phase=OPEN,
        version=version,
        inflight={f"{rid}.{i}" for i in range(inflight)},
    )


def test_newest_then_home_then_least_loaded() -> None:
    old, new_busy, new_idle = _slot("a", 1, 0), _slot("b", 2, 3), _slot("c", 2, 1)
    slots = [old, new_busy, new_idle]
    # the newest version first, even over an idle home holding an older one
    assert choose_call_replica(slots, 8, home="a") is new_idle
    # among the newest, the session's home, even when it is busier
    assert choose_call_replica(slots, 8, home="b") is new_busy
    # no home: the least loaded; full replicas are skipped
    assert choose_call_replica(slots, 8) is new_idle
    assert choose_call_replica(slots, 2, home="b") is new_idle
    # ties: the replica that opened first
    assert choose_call_replica([_slot("x", 2, 0), _slot("y", 2, 0)], 8).replica_id == "x"
    # a schedule's min_version, an eval round's exact version, nothing with room
    assert choose_call_replica(slots, 8, home="a", min_version=3) is None
    assert choose_call_replica(slots, 8, home="b", version=1) is old
    assert choose_call_replica(slots[1:], 1) is None


def test_the_gateway_and_the_loop_place_a_call_alike() -> None:
    rng = random.Random(0)
    limit = 4
    for _ in range(300):
        slots = [_slot(f"r{i}", rng.randint(3, 5), rng.randint(0, limit), i) for i in range(4)]
        home = rng.choice(slots)
        sup = SimpleNamespace(open={s.replica_id: s for s in slots})
        # the gateway's choice (version_policy latest, no schedule bound)
        manager = SimpleNamespace(
            supervisor=sup,
            opt=SimpleNamespace(max_concurrent=limit),
            admission=SimpleNamespace(min_version=lambda tag: None),
        )
        backend = ManagerTurnBackend(manager, "latest")
        backend._home["s"] = home.replica_id
        request = TurnRequest("s", "g", "s.0", 1, [1], SamplingParams(max_tokens=4), {})
        gateway = backend._choose(request)
        # the loop's (the simulator's agent workload): where place_turn launches the turn
        placement = Placement.__new__(Placement)
        placement.supervisor, placement.max_concurrent = sup, limit
        placement.orphans = []
        launched: list = []
        placement.launch = lambda slot, item, resume, into=launched: into.append(slot)
        placement.kick = lambda: None
        placement.place_turn(SimpleNamespace(), SimpleNamespace(), prefer=home)
        loop = launched[0] if launched else None
        assert loop is gateway, ([vars(s) for s in slots], home.replica_id)


def test_a_waiting_call_is_woken_by_a_dispatch_not_a_timer() -> None:
    """A call that finds no replica with room waits on ``Placement.changed`` (set by the
    manager's dispatch), and is placed as soon as it is set."""
    full = _slot("a", 1, 1)
    sup = SimpleNamespace(open={"a": full})
    changed = asyncio.Event()
    manager = SimpleNamespace(
        supervisor=sup,
        slots=[SimpleNamespace(alive=True, phase=None)],
        opt=SimpleNamespace(max_concurrent=1),
        admission=SimpleNamespace(min_version=lambda tag: None),
        placement=SimpleNamespace(changed=changed),
        tasks=SimpleNamespace(stopping=False),
    )
    backend = ManagerTurnBackend(manager, "latest")
    request = TurnRequest("s", "g", "s.0", 0, [1], SamplingParams(max_tokens=4), {})

    async def main():
        waiting = asyncio.ensure_future(backend._place(request))
        await asyncio.sleep(1.0)
        assert not waiting.done()  # nothing changed: no timer placed it meanwhile
        full.inflight.clear()  # a call ended ...
        await asyncio.sleep(1.0)
        assert not waiting.done()  # ... but nobody said so yet
        changed.set()  # the manager's dispatch
        return await asyncio.wait_for(waiting, 1.0)

    assert asyncio.run(main()) is full

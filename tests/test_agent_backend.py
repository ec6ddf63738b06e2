"""``ManagerTurnBackend`` places agent calls through a real rollout manager (simulated
replicas on the virtual clock, the trainer publishing versions as the run goes on).

``latest``: each call gets the newest version an open replica holds, so a long session
spans versions. ``pin``: every call of a session runs on the replica (and version) of its
first call, which pulls no newer version while the session is open (the cost: it lags the
other replicas), and pulls once the session closes.
"""

from __future__ import annotations

import asyncio

from laminar_core import load_config
from laminar_core.gateway import TurnRequest
from laminar_core.loop.agent_backend import ManagerTurnBackend
from laminar_core.runtime import build_local_run
from laminar_core.sim.clock import run_virtual
from laminar_core.telemetry.events import WeightPull
from laminar_core.types import SamplingParams


def _session(backend, sid: str, out: list, calls: int, think_s: float):
    async def go() -> None:
        for i in range(calls):
            req = TurnRequest(
                sid,
                "agents",
                f"{sid}.0",
                i,
                [1] * 32,
                SamplingParams(max_tokens=64),
                {"sample_key": 1_000_000 + i},
            )
            r = await backend.generate_turn(req)
            out.append((r.version, r.replica))
            await asyncio.sleep(think_s)  # the agent's tool / think time between calls
        await backend.session_closed(sid)
        out.append(("closed", asyncio.get_running_loop().time()))

    return go()


def test_latest_follows_the_newest_version_and_pin_holds_one(small_overrides) -> None:
    resolved = load_config(None, [*small_overrides, "run.steps=40"])

    async def main():
        run = build_local_run(resolved, record_events=True)
        m = run.manager
        latest, pinned = [], []
        controller = asyncio.ensure_future(run.controller.run(40))
        while m.tasks.loop is None or not m.supervisor.open:
            await asyncio.sleep(0.1)
        await asyncio.gather(
            _session(ManagerTurnBackend(m, "latest"), "L", latest, 10, 3.0),
            _session(ManagerTurnBackend(m, "pin"), "P", pinned, 10, 3.0),
        )
        pin_closed = pinned.pop()[1]
        latest.pop()
        await controller
        return run, latest, pinned, pin_closed

    run, latest, pinned, pin_closed = run_virtual(main())
    versions = [v for v, _ in latest]
    assert versions == sorted(versions) and versions[-1] > versions[0], latest
    # pin: one replica, one version, for the whole session ...
    assert len(set(pinned)) == 1, pinned
    ((version, replica),) = set(pinned)
    pulls = [e for e in run.events.of(WeightPull) if e.actor == replica]
    # ... which pulled nothing while the session was open, though newer versions came out
    assert all(e.t >= pin_closed for e in pulls if e.version > version), pulls
    assert max(v for v, _ in latest) > version
    # and caught up once it closed
    assert any(e.version > version for e in pulls), pulls

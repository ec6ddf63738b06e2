"""Chain membership: which relays are live, who is master, and repair after a death.

Relays are chain ranks 1..p in the order given (rank 0 is the trainer). ``refresh`` cuts dead
relays out, elects the first live one master and reconnects the survivors (and the trainer)
to each other's endpoints; ``repair`` sends a version to the live relays that missed it, from
one that holds it, as a chain of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from laminar_core.relay.protocol import TRAINER_RANK, HostHandle, RelayUnavailable
from laminar_core.types import WeightManifest

log = logging.getLogger(__name__)

Member = tuple[int, HostHandle]  # (chain rank, host)


class Chain:
    """The relays of one tier, in rank order, and the live chain through them."""

    def __init__(self, hosts: Sequence[HostHandle]) -> None:
        if not hosts:
            raise ValueError("the relay tier needs at least one relay")
        self.hosts: list[Member] = list(enumerate(hosts, start=1))
        self.live: list[Member] = []
        self.endpoints: dict[int, Any] = {}
        self.rebuilds = 0  # times the chain was rebuilt after a relay died
        self.on_master_change: list[Callable[[int, Any], None]] = []  # (rank, endpoint)

    @property
    def master(self) -> Member:
        """Where the trainer pushes (the first live relay)."""
        return self.live[0]

    @property
    def ranks(self) -> list[int]:
        return [r for r, _ in self.live]

    def host(self, rank: int) -> HostHandle:
        return dict(self.hosts)[rank]

    async def open(self, trainer_endpoint: Any, connect_trainer: ConnectFn) -> None:
        """Open every relay's endpoint and connect the chain."""
        self.endpoints[TRAINER_RANK] = trainer_endpoint
        eps = await asyncio.gather(*(h.open() for _, h in self.hosts))
        self.endpoints.update({r: ep for (r, _), ep in zip(self.hosts, eps)})
        await self.refresh(connect_trainer, force=True)

    async def refresh(self, connect_trainer: ConnectFn, force: bool = False) -> None:
        """Cut dead relays out, elect the master, and reconnect the survivors."""
        alive = [(r, h) for r, h in self.hosts if h.is_alive()]
        if not alive:
            raise RelayUnavailable("every relay is dead: restart relays before publishing")
        if not force and [r for r, _ in alive] == self.ranks:
            return
        old = self.live[0][0] if self.live else None
        gone = sorted(set(self.ranks) - {r for r, _ in alive})
        self.live = alive
        peers = {TRAINER_RANK: self.endpoints[TRAINER_RANK]}
        peers.update({r: self.endpoints[r] for r, _ in alive})
        await asyncio.gather(connect_trainer(peers), *(h.connect(peers) for _, h in alive))
        if not force:
            self.rebuilds += 1
            log.warning("relay(s) %s cut out; chain is now %s", gone, self.ranks)
        new = alive[0][0]
        if old is not None and new != old:
            log.warning("master relay %s is gone: relay %s is the new master", old, new)
        if old != new:
            for cb in self.on_master_change:
                cb(new, self.endpoints[new])

    def any_dead(self, members: list[Member]) -> bool:
        return any(not h.is_alive() for _, h in members)

    async def cancel(self, members: list[Member], version: int, attempt: int) -> None:
        """Call ``attempt`` at ``version`` off on every live member (errors ignored)."""
        await asyncio.gather(
            *(h.cancel(version, attempt) for _, h in members if h.is_alive()),
            return_exceptions=True,
        )

    async def repair(
        self, version: int, count: int, manifest: WeightManifest, attempt: int, timeout_s: float
    ) -> None:
        """Live relays that missed ``version`` get it from one holding it: the holder
        serves it down a chain of the ones that need it."""
        chain = list(self.live)
        held = await asyncio.gather(*(h.status() for _, h in chain), return_exceptions=True)
        have = [chain[i] for i, v in enumerate(held) if v == version]
        need = [chain[i] for i, v in enumerate(held) if isinstance(v, int) and v < version]
        if not have or not need:
            if need:
                log.error(
                    "version %s: no live relay holds it; %s keep older versions",
                    version,
                    [r for r, _ in need],
                )
            return
        sub = [have[0], *need]
        log.warning("repairing version %s: rank %s -> %s", version, sub[0][0], [r for r, _ in need])
        tasks = [asyncio.ensure_future(sub[0][1].serve(version, sub[1][0]))]
        for i in range(1, len(sub)):
            nxt = sub[i + 1][0] if i + 1 < len(sub) else None
            take = _take(sub[i][1], version, count, sub[i - 1][0], nxt, manifest, attempt)
            tasks.append(asyncio.ensure_future(take))
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            await self.cancel(need, version, attempt)
        for t, (rank, _) in zip(tasks, sub):
            if t.done() and not t.cancelled() and t.exception() is not None:
                log.error(
                    "repair of version %s at rank %s failed: %r", version, rank, t.exception()
                )


ConnectFn = Callable[[dict[int, Any]], Awaitable[None]]


async def _take(
    host: HostHandle,
    version: int,
    count: int,
    pred: int,
    nxt: int | None,
    manifest: WeightManifest,
    attempt: int,
) -> None:
    """One repair target: receive the version (forwarding it on), commit, share."""
    got = asyncio.ensure_future(host.receive(version, count, pred, nxt, attempt))
    await host.offer_manifest(manifest, attempt)
    await got
    await host.drain(version)

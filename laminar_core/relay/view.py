"""The driver's view of a node relay hosted elsewhere (a Ray actor, a relay process).

The rollout manager watches a node relay for new versions and, when a replica is free, asks
it for the weights to load. With the relay in the driver (``NodeRelay``) that is the version's
buckets; with the relay on the replica's node it is a ``SharedWeights`` reference to the
version the relay wrote into the node's shared memory, which the replica maps itself: the
weights never travel through the driver.

The view learns versions from the relay tier's ``on_ready(rank, version)`` hook, which fires
once a relay host has committed a version *and* written it to shared memory (its ``drain``
returned), so a version the view holds can always be loaded on the node. Earlier, as soon as
the relay has committed a version (before the shared-memory write ends), ``committed`` lets
the view tell its listeners that a newer version is coming, so replicas stop taking new work
for the old one; the listeners hear the version again once it can be loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from laminar_core.relay.shm import SharedWeights


class SharedRelayView:
    """Stands in for ``NodeRelay`` in the manager: ``relay_id``, ``node``, ``version``,
    ``alive``, ``listeners``, ``wait_newer`` and ``weights()``. ``advance(version)`` is
    what the tier's ``on_ready`` hook calls; ``is_alive`` follows the remote relay (a dead
    relay's view stops advancing).

    Listeners are called with a version when the relay committed it (``committed``) and
    again when it is shared (``advance``), at most once each; ``version`` is always the
    newest *shared* one, the one a replica can load.
    """

    def __init__(
        self,
        relay_id: int,
        node: int,
        shm_root: str | Path,
        is_alive: Callable[[], bool] | None = None,
    ) -> None:
        self.relay_id = relay_id
        self.node = node
        self.shm_root = str(shm_root)
        self._is_alive = is_alive or (lambda: True)
        self._version = -1
        self._announced = -1
        self._changed = asyncio.Event()
        self.listeners: list[Callable[[int], None]] = []

    @property
    def version(self) -> int:
        """The newest version the relay holds and shares on its node (-1: none yet)."""
        return self._version

    @property
    def alive(self) -> bool:
        return self._is_alive()

    def committed(self, version: int) -> None:
        """The relay committed ``version``; it is being written to shared memory. Listeners
        learn that it is coming (replicas stop admitting); ``version`` does not move yet."""
        if version <= max(self._announced, self._version):
            return
        self._announced = version
        for listener in self.listeners:
            listener(version)

    def advance(self, version: int) -> None:
        """The relay committed ``version`` and shared it: replicas may load it (older ones
        are ignored, versions only move forward)."""
        if version <= self._version:
            return
        self._version = version
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self.listeners:
            listener(version)

    async def wait_newer(self, version: int) -> int:
        """Return once a version newer than ``version`` is held."""
        while self._version <= version:
            await self._changed.wait()
        return self._version

    def weights(self) -> tuple[int, SharedWeights]:
        """``(version, tensors)`` for a replica on this node: the newest version, as a
        reference the replica loads from the node's shared memory."""
        if self._version < 0:
            raise LookupError(f"relay {self.relay_id} holds no version yet")
        return self._version, SharedWeights(self.shm_root, self.relay_id, self._version)

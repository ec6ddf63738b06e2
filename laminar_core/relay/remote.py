"""The driver's handle on a relay hosted elsewhere: one proxy for every control channel.

A ``RemoteRelay`` is two things to the driver:

* to the relay tier, a ``relay.protocol.HostHandle``: every call is forwarded to the
  ``relay.server.RelayServer`` in the relay's process through ``_call(method, *args)``,
  which a subclass implements for its channel (a pipe to a spawned process:
  ``relay.process.RelayProcess``; a Ray actor: ``runtime.relay_actor.RayRelay``). A channel
  that finds the relay gone marks it dead (``_died``) and raises ``RelayDied``.
* to the rollout manager, the node relay its replicas watch and load from: ``version`` (the
  newest version shared on the node), ``events`` (``relay.events``: committed when its
  ``receive`` returned, shared when its ``drain`` returned -- also when only forwarding
  failed -- or when ``status`` reports it held), and ``weights()``, a ``SharedWeights``
  reference the replica maps on its own node: the weights never cross the driver.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

from laminar_core.interfaces.weights import SharedWeights
from laminar_core.relay.events import RelayEventKind, RelayEvents
from laminar_core.relay.protocol import ForwardFailed, RelayDied
from laminar_core.types import WeightManifest, manifest_to_json

log = logging.getLogger(__name__)


class RemoteRelay(abc.ABC):
    """Driver-side proxy of relay ``relay_id`` on ``node`` (see module docstring); its
    versions are shared under ``shm_root`` (``None``: the relay shares nothing)."""

    def __init__(self, relay_id: int, node: int, shm_root: str | None = None) -> None:
        self.relay_id = relay_id
        self.node = node
        self.shm_root = shm_root
        self.events = RelayEvents(relay_id)
        self.written: dict[int, dict[str, Any]] = {}  # version -> where it was shared
        self._dead: str | None = None
        self._closed = False

    # --- the channel ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def _call(self, method: str, *args: Any) -> Any:
        """Run ``method`` on the relay's server; raise ``RelayDied`` if the relay is gone
        (after calling ``_died``) and the relay's own exception otherwise."""

    def _alive(self) -> bool:
        """The channel's own liveness test (a process that exited, an actor that died)."""
        return True

    def _died(self, why: object) -> None:
        if self._dead is None:
            if not self._closed:
                log.warning("relay %s died: %s", self.relay_id, why)
            self._dead = str(why)

    def _check(self) -> None:
        if self._dead is not None:
            raise RelayDied(f"relay {self.relay_id} is dead: {self._dead}")

    def is_alive(self) -> bool:
        return self._dead is None and self._alive()

    @property
    def alive(self) -> bool:
        return self.is_alive()

    # --- the tier's calls (relay.protocol.HostHandle) -----------------------------------------

    async def open(self) -> Any:
        return await self._call("open")

    async def connect(self, peers: dict[int, Any]) -> None:
        await self._call("connect", peers)

    async def receive(
        self, version: int, count: int, pred: int, nxt: int | None, attempt: int = 0
    ) -> int:
        got = await self._call("receive", version, count, pred, nxt, attempt)
        self.events.emit(RelayEventKind.COMMITTED, got)  # before the trainer hears of it
        return got

    async def offer_manifest(self, manifest: WeightManifest, attempt: int = 0) -> None:
        await self._call("offer_manifest", manifest_to_json(manifest), attempt)

    async def drain(self, version: int) -> None:
        try:
            written = await self._call("drain", version)
        except ForwardFailed:
            self._shared(version, None)  # good here; the tier repairs the rest of the chain
            raise
        self._shared(version, written)

    async def cancel(self, version: int, attempt: int = 0) -> None:
        await self._call("cancel", version, attempt)

    async def serve(self, version: int, nxt: int) -> None:
        await self._call("serve", version, nxt)

    async def probe(self, pred: int, count: int) -> None:
        await self._call("probe", pred, count)

    async def status(self) -> int:
        held = await self._call("status")
        self._shared(held, None)
        return held

    async def expect_layout(self, specs: list[tuple[str, tuple[int, ...], str]]) -> None:
        await self._call("expect_layout", specs)

    async def close(self) -> None:
        self._closed = True
        if self.is_alive():
            await self._call("close")

    def _shared(self, version: int, written: dict[str, Any] | None) -> None:
        if version < 0:
            return
        if written is not None:
            self.written[version] = written
        self.events.emit(RelayEventKind.SHARED, version)

    # --- the node relay the manager watches -------------------------------------------------

    @property
    def version(self) -> int:
        """The newest version the relay holds and shares on its node (-1: none yet)."""
        return self.events.shared

    def weights(self) -> SharedWeights:
        """The newest shared version, as a reference a replica on the node maps itself."""
        if self.version < 0:
            raise LookupError(f"relay {self.relay_id} holds no version yet")
        if self.shm_root is None:
            raise LookupError(f"relay {self.relay_id} shares no versions with its node")
        return SharedWeights(self.shm_root, self.relay_id, self.version)

"""The relay side of a relay hosted outside the driver (a spawned process, a Ray actor).

``RelayServer`` holds one node's relay: its ``NodeRelay``, a ``RelayHost`` on its transport
endpoint, and the ``SharedVersionStore`` through which the node's replicas load each version.
The hosting process answers the tier's calls with ``await server.call(method, *args)``; the
driver-side proxy is a ``relay.remote.RemoteRelay``. Arguments and results are small and
plain (the manifest travels as JSON): bucket bytes only ever travel on the transport.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from laminar_core.interfaces import WeightTransport
from laminar_core.relay.host import RelayHost
from laminar_core.relay.node import NodeRelay, VersionData
from laminar_core.relay.shm import SharedVersionStore, remove_shared
from laminar_core.types import manifest_from_json

log = logging.getLogger(__name__)

# the calls a server answers: the tier's (relay.protocol) and the node-side extras
CALLS = frozenset(
    {
        "open",
        "connect",
        "receive",
        "offer_manifest",
        "drain",
        "cancel",
        "serve",
        "probe",
        "status",
        "close",
        "expect_layout",
        "written",
    }
)


class RelayServer:
    """One node's relay, served to a ``RemoteRelay`` (see module docstring).

    With ``shm_root`` every committed version is written once into the node's shared memory
    (off the event loop); ``drain`` then returns where it was written. ``die_at=(version,
    index)`` is fault injection: the process exits when that bucket arrives.
    """

    def __init__(
        self,
        relay_id: int,
        node: int,
        rank: int,
        transport: WeightTransport,
        shm_root: str | None = None,
        die_at: tuple[int, int] | None = None,
    ) -> None:
        self.relay = NodeRelay(relay_id, node)
        self.shm_root = shm_root
        self.store = SharedVersionStore(shm_root, relay_id) if shm_root else None
        self._written: dict[int, dict[str, Any]] = {}  # version -> where and how big
        self.host = RelayHost(
            self.relay,
            transport,
            rank,
            die_at=die_at,
            on_commit=self._share if self.store is not None else None,
        )

    def _share(self, relay: NodeRelay) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(None, self._write, relay.read())

    def _write(self, data: VersionData) -> None:
        assert self.store is not None
        path = self.store.write(data)
        self._written[data.version] = {
            "version": data.version,
            "path": str(path),
            "bytes": path.stat().st_size,
            "manifest_bytes": data.manifest.total_bytes,
        }
        for v in [v for v in self._written if v < data.version - 1]:
            del self._written[v]

    async def call(self, method: str, *args: Any) -> Any:
        """Answer one call of the tier (or the driver); raises what the relay raised."""
        if method not in CALLS:
            raise AttributeError(f"a relay server has no call {method!r}")
        if method == "offer_manifest":
            return await self.host.offer_manifest(manifest_from_json(args[0]), *args[1:])
        if method == "drain":
            await self.host.drain(*args)
            return self._written.get(args[0])
        if method == "expect_layout":
            return self.relay.expect_layout(args[0])
        if method == "written":
            return dict(self._written)
        if method == "close":
            return await self.close()
        return await getattr(self.host, method)(*args)

    async def close(self) -> None:
        """Close the transport and delete what this relay shared (tmpfs is RAM)."""
        try:
            await self.host.close()
        finally:
            if self.shm_root:
                remove_shared(self.shm_root, self.relay.relay_id)

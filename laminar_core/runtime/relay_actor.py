"""Node relays as Ray actors: one per node that hosts replicas, fed over the real transport.

``RelayActorHost`` is the actor: it hosts one ``RelayHost`` (its ``NodeRelay``, its endpoint
of the configured ``relay.transport``, built from the plugin registry inside the actor) and
writes every committed version once into the node's shared memory (``SharedVersionStore``),
where the replicas on the node load it from (``SharedWeights``). It is what
``relay.process.RelayProcess`` is for a spawned process, with Ray's actor calls as the
control channel: the manifest, version numbers and ranks travel as actor calls, bucket bytes
only on the transport.

``RayRelayHost`` is the driver-side handle the ``RelayTier`` drives (its ``HostHandle``
protocol). An actor that dies fails its pending calls with ``RelayDied`` and turns
``is_alive()`` False (a never-returning ``watch`` call notices a death even between calls),
which is how the tier cuts a dead relay out and repairs the chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayTaskError

from laminar_core.config.loader import resolve
from laminar_core.interfaces import BuildContext, build
from laminar_core.plugins import default_manager
from laminar_core.relay.host import RelayHost
from laminar_core.relay.node import NodeRelay, VersionData
from laminar_core.relay.process import RelayDied
from laminar_core.relay.shm import SharedVersionStore, remove_shared
from laminar_core.relay.wire import manifest_from_json, manifest_to_json
from laminar_core.runtime.hosts import _threads
from laminar_core.runtime.proxies import _GONE, _cause
from laminar_core.types import WeightManifest

log = logging.getLogger(__name__)

# Concurrent calls one relay actor takes: receive, drain, offer_manifest, cancel, serve,
# probe and the watch call of one version overlap; a few versions' worth is plenty.
MAX_CONCURRENCY = 64


class RelayActorHost:
    """One node's relay (run as an async Ray actor with ``num_cpus=0``, pinned to its node).

    ``die_at=(version, index)`` is fault injection for tests: the actor's process exits the
    moment that bucket arrives, as a crashed relay would.
    """

    def __init__(
        self,
        config_yaml: str,
        relay_id: int,
        node: int,
        rank: int,
        shm_root: str,
        die_at: tuple[int, int] | None = None,
    ) -> None:
        import yaml

        _threads()
        resolved = resolve(yaml.safe_load(config_yaml), source="driver")
        cfg = resolved.cfg
        factory = default_manager().get("transport", cfg.relay.transport)
        ctx = BuildContext(
            cfg, resolved.engine_options.get("relay"), rank, f"relay{relay_id}", 1, {}
        )
        self.relay_id = relay_id
        self.shm_root = shm_root
        self.relay = NodeRelay(relay_id, node)
        self.store = SharedVersionStore(shm_root, relay_id)
        self.written: dict[int, dict[str, Any]] = {}  # version -> where and how big
        self._writing: dict[int, asyncio.Future] = {}  # shm writes, by version
        self.host = RelayHost(
            self.relay, build(factory, ctx), rank, die_at=die_at, on_commit=self._on_commit
        )
        self._closed: asyncio.Event | None = None

    def _on_commit(self, relay: NodeRelay) -> asyncio.Future:
        # the shm write runs off the event loop; ``drain`` awaits it
        loop = asyncio.get_running_loop()
        data = relay.read()
        fut = self._writing[data.version] = loop.run_in_executor(None, self._write, data)
        for v in [v for v in self._writing if v < data.version]:
            self._writing.pop(v)
        return fut

    def _write(self, data: VersionData) -> None:
        path = self.store.write(data)
        self.written[data.version] = {
            "version": data.version,
            "path": str(path),
            "bytes": path.stat().st_size,
            "manifest_bytes": data.manifest.total_bytes,
        }

    def _event(self) -> asyncio.Event:
        if self._closed is None:
            self._closed = asyncio.Event()
        return self._closed

    # --- the HostHandle surface (the tier's calls) ---------------------------------------------

    async def open(self) -> Any:
        self._event()
        return await self.host.open()

    async def connect(self, peers: dict[int, Any]) -> None:
        await self.host.connect(peers)

    async def receive(
        self, version: int, count: int, pred: int, nxt: int | None, attempt: int = 0
    ) -> int:
        return await self.host.receive(version, count, pred, nxt, attempt)

    async def offer_manifest(self, manifest_json: str, attempt: int = 0) -> None:
        await self.host.offer_manifest(manifest_from_json(manifest_json), attempt)

    async def drain(self, version: int) -> dict[str, Any] | None:
        """Forwarded and shared; returns where the version was written (None: not here)."""
        await self.host.drain(version)
        return self.written.get(version)

    async def cancel(self, version: int, attempt: int = 0) -> None:
        await self.host.cancel(version, attempt)

    async def serve(self, version: int, nxt: int) -> None:
        await self.host.serve(version, nxt)

    async def probe(self, pred: int, count: int) -> None:
        await self.host.probe(pred, count)

    async def status(self) -> int:
        """The version the relay holds, once its write to shared memory (if one is in flight)
        has ended: what the tier's repair round reads as "ready on this node"."""
        held = await self.host.status()
        writing = self._writing.get(held)
        if writing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(writing)
        return held

    async def expect_layout(self, specs: list[tuple[str, tuple[int, ...], str]]) -> None:
        self.relay.expect_layout(specs)

    async def close(self) -> None:
        """Close the transport and delete this relay's shared versions (tmpfs is RAM)."""
        try:
            await self.host.close()
        finally:
            remove_shared(self.shm_root, self.relay_id)
            self._event().set()

    # --- for the driver ------------------------------------------------------------------------

    async def watch(self) -> None:
        """Returns only once the relay is closed: a death fails it (liveness for the driver)."""
        await self._event().wait()

    async def shared(self) -> dict[int, dict[str, Any]]:
        """Every version written to shared memory: ``version -> {path, bytes, ...}``."""
        return dict(self.written)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayRelayHost:
    """The tier's handle on a ``RelayActorHost`` actor (``relay.tier.HostHandle``).

    ``shared`` collects, per version, what the actor reported writing to its node's shared
    memory (from ``drain``). ``on_committed`` callbacks get each version the relay committed
    (``receive`` returned), before the version is shared; that it is shared (loadable on
    the node) is the tier's ``on_ready(rank, version)``.
    """

    def __init__(self, handle: Any, relay_id: int, node: int) -> None:
        self.handle = handle
        self.relay_id = relay_id
        self.node = node
        self.shared: dict[int, dict[str, Any]] = {}
        self.on_committed: list[Callable[[int], None]] = []
        self._dead: str | None = None
        self._closed = False
        self._watch: asyncio.Future | None = None

    def is_alive(self) -> bool:
        return self._dead is None

    def _died(self, why: Any) -> None:
        if self._dead is None and not self._closed:
            log.warning("relay %s (Ray actor) died: %s", self.relay_id, why)
        if self._dead is None:
            self._dead = str(why)

    async def _watcher(self) -> None:
        try:
            await self.handle.watch.remote()
        except _GONE as e:
            self._died(e)
        except Exception as e:  # a watch that fails otherwise says nothing about liveness
            log.debug("relay %s: watch ended: %r", self.relay_id, e)

    async def _call(self, method: str, *args: Any) -> Any:
        if self._dead is not None:
            raise RelayDied(f"relay {self.relay_id} is dead: {self._dead}")
        try:
            return await getattr(self.handle, method).remote(*args)
        except _GONE as e:
            self._died(e)
            raise RelayDied(f"relay {self.relay_id} (Ray actor) died: {e}") from e
        except RayTaskError as e:
            raise _cause(e) from None

    async def open(self) -> Any:
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watcher())
        return await self._call("open")

    async def connect(self, peers: dict[int, Any]) -> None:
        await self._call("connect", peers)

    async def receive(
        self, version: int, count: int, pred: int, nxt: int | None, attempt: int = 0
    ) -> int:
        got = await self._call("receive", version, count, pred, nxt, attempt)
        for cb in self.on_committed:  # before the tier hears of it (and the trainer resumes)
            cb(got)
        return got

    async def offer_manifest(self, manifest: WeightManifest, attempt: int = 0) -> None:
        await self._call("offer_manifest", manifest_to_json(manifest), attempt)

    async def drain(self, version: int) -> None:
        got = await self._call("drain", version)
        if got is not None:
            self.shared[version] = got

    async def cancel(self, version: int, attempt: int = 0) -> None:
        await self._call("cancel", version, attempt)

    async def serve(self, version: int, nxt: int) -> None:
        await self._call("serve", version, nxt)

    async def probe(self, pred: int, count: int) -> None:
        await self._call("probe", pred, count)

    async def status(self) -> int:
        return await self._call("status")

    async def expect_layout(self, specs: list[tuple[str, tuple[int, ...], str]]) -> None:
        await self._call("expect_layout", specs)

    async def close(self) -> None:
        self._closed = True
        if self._dead is None:
            await self._call("close")
        if self._watch is not None:
            self._watch.cancel()


def spawn_relay(
    config_yaml: str,
    relay_id: int,
    node: int,
    rank: int,
    shm_root: str,
    ray_node_id: str,
    die_at: tuple[int, int] | None = None,
) -> RayRelayHost:
    """Start a relay actor on Ray node ``ray_node_id`` (no CPU reserved: it mostly waits on
    the transport) and return the tier's handle on it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    handle = (
        ray.remote(RelayActorHost)
        .options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
            max_concurrency=MAX_CONCURRENCY,
        )
        .remote(config_yaml, relay_id, node, rank, shm_root, die_at)
    )
    return RayRelayHost(handle, relay_id, node)

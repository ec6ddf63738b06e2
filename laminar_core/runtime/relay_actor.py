"""Node relays as Ray actors: one per node that hosts replicas, fed over the real transport.

``RelayActor`` is the actor: it hosts one ``relay.server.RelayServer`` (its ``NodeRelay``, its
endpoint of the configured ``relay.transport`` built from the plugin registry inside the
actor, and the node's shared-memory store the replicas load from). ``RayRelay`` is the
driver's ``relay.remote.RemoteRelay`` for it: the tier's calls travel as actor calls (the
manifest, version numbers, ranks); bucket bytes only on the transport. An actor that dies
fails its pending calls with ``RelayDied`` and turns ``is_alive()`` False (a never-returning
``watch`` call notices a death even between calls), which is how the tier cuts a dead relay
out and repairs the chain.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from laminar_core.interfaces import BuildContext, build
from laminar_core.plugins import default_manager
from laminar_core.relay.protocol import RelayDied
from laminar_core.relay.remote import RemoteRelay
from laminar_core.relay.server import RelayServer
from laminar_core.runtime.ray_calls import (
    ACTOR_GONE,
    RayTaskError,
    engine_error,
    limit_threads,
    log_to,
)
from laminar_core.runtime.resolve import resolve
from laminar_core.runtime.startup_gc import startup_gc

log = logging.getLogger(__name__)

# Concurrent calls one relay actor takes: receive, drain, offer_manifest, cancel, serve,
# probe and the watch call of one version overlap; a few versions' worth is plenty.
MAX_CONCURRENCY = 64


class RelayActor:
    """One node's relay (an async Ray actor with ``num_cpus=0``, pinned to its node).

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
        log_path: str | None = None,
    ) -> None:
        import yaml

        with startup_gc():
            log_to(log_path)
            limit_threads()
            resolved = resolve(yaml.safe_load(config_yaml), source="driver")
            cfg = resolved.cfg
            factory = default_manager().get("transport", cfg.relay.transport)
            ctx = BuildContext(cfg, resolved.engine_options.get("relay"), rank, f"relay{relay_id}")
            transport = build(factory, ctx)
            self.server = RelayServer(relay_id, node, rank, transport, shm_root, die_at)
        self._closed: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._closed is None:  # made on the actor's event loop
            self._closed = asyncio.Event()
        return self._closed

    async def call(self, method: str, *args: Any) -> Any:
        self._event()
        try:
            return await self.server.call(method, *args)
        finally:
            if method == "close":
                self._event().set()

    async def watch(self) -> None:
        """Returns only once the relay is closed: a death fails it (liveness for the driver)."""
        await self._event().wait()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This actor's process id (for operators, and the chaos tests' ``kill -9``)."""
        return os.getpid()

    def process_state(self) -> tuple[str, bool, int, list[list[int]]]:
        """``(class, *actor_process.process_state())`` of this actor's process."""
        from laminar_core.runtime.actor_process import process_state

        return (type(self).__name__, *process_state())


class RayRelay(RemoteRelay):
    """The driver's handle on a ``RelayActor`` (see module docstring)."""

    def __init__(self, handle: Any, relay_id: int, node: int, shm_root: str) -> None:
        super().__init__(relay_id, node, shm_root)
        self.handle = handle
        self._watch: asyncio.Future | None = None

    async def _watcher(self) -> None:
        try:
            await self.handle.watch.remote()
        except ACTOR_GONE as e:
            self._died(e)
        except Exception as e:  # a watch that fails otherwise says nothing about liveness
            log.debug("relay %s: watch ended: %r", self.relay_id, e)

    async def _call(self, method: str, *args: Any) -> Any:
        self._check()
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watcher())
        try:
            return await self.handle.call.remote(method, *args)
        except ACTOR_GONE as e:
            self._died(e)
            raise RelayDied(f"relay {self.relay_id} (Ray actor) died: {e}") from e
        except RayTaskError as e:
            raise engine_error(e) from None

    def rebind(self, handle: Any) -> None:
        """Drive a new actor in place of a dead one (same relay id, node and chain rank):
        the proxy, its event stream and what it wrote so far stay; the tier's ``rejoin``
        then opens the new endpoint and catches the relay up."""
        if self._watch is not None:
            self._watch.cancel()
        self.handle, self._watch = handle, None
        self._dead, self._closed = None, False

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self._watch is not None:
                self._watch.cancel()


def relay_actor(
    config_yaml: str,
    relay_id: int,
    node: int,
    rank: int,
    shm_root: str,
    ray_node_id: str,
    die_at: tuple[int, int] | None = None,
    log_path: str | None = None,
) -> Any:
    """Start a relay actor on Ray node ``ray_node_id`` (no CPU reserved: it mostly waits on
    the transport); returns its actor handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(RelayActor)
        .options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
            max_concurrency=MAX_CONCURRENCY,
        )
        .remote(config_yaml, relay_id, node, rank, shm_root, die_at, log_path)
    )


def spawn_relay(
    config_yaml: str,
    relay_id: int,
    node: int,
    rank: int,
    shm_root: str,
    ray_node_id: str,
    die_at: tuple[int, int] | None = None,
    log_path: str | None = None,
) -> RayRelay:
    """A relay actor on ``ray_node_id`` and the driver's handle on it."""
    handle = relay_actor(config_yaml, relay_id, node, rank, shm_root, ray_node_id, die_at, log_path)
    return RayRelay(handle, relay_id, node, shm_root)

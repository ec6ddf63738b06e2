"""What runs inside the trainer and replica actors: one engine per actor, from the registry.

The actor gets the resolved config as YAML (plain text crosses processes cleanly), builds its
engine with the same ``BuildContext`` the local runtime uses, and forwards calls to it.
Nothing here knows the loop; the driver-side proxies (``runtime.proxies``) make these actors
look like a ``RolloutEngine`` and a ``TrainerGroup`` to the controller and the manager.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from laminar_core.interfaces import (
    BuildContext,
    TensorWeights,
    TrainerContext,
    build,
    shm_files_of,
)
from laminar_core.net import free_port
from laminar_core.plugins import default_manager
from laminar_core.runtime.ray_calls import (
    detach_resource_tracker,
    limit_threads,
    log_to,
    pin_cores,
)
from laminar_core.runtime.resolve import resolve
from laminar_core.runtime.startup_gc import hold_gc, release_gc


def _engine(config_yaml: str, kind: str, index: int, name: str, gpus: int) -> Any:
    import yaml

    resolved = resolve(yaml.safe_load(config_yaml), source="driver")
    cfg = resolved.cfg
    # before the engine starts threads and processes: they inherit the cores
    cores = "replica_cores" if kind == "rollout" else "trainer_cores"
    pin_cores(getattr(cfg.runtime, cores), f"runtime.{cores}")
    engine_name = cfg.rollout.engine if kind == "rollout" else cfg.trainer.engine
    factory = default_manager().get(kind, engine_name)
    # one engine per actor: the process is the engine's own
    options = resolved.engine_options.get(kind)
    ctx = BuildContext(cfg, options, index, name, gpus, {}, own_process=True)
    return build(factory, ctx), resolved


class RolloutHost:
    """A rollout replica's actor: ``call(method, *args)`` forwards to the engine; ``start``
    starts it (the end of this process's start-up)."""

    def __init__(
        self, config_yaml: str, index: int, name: str, gpus: int, log_path: str | None = None
    ) -> None:
        self._gc_was_on = hold_gc()  # until the engine has started (``startup_gc``)
        log_to(log_path)
        limit_threads()
        # before the engine starts processes: what they leave must outlive this actor
        detach_resource_tracker()
        self.engine, _ = _engine(config_yaml, "rollout", index, name, gpus)

    async def start(self) -> None:
        try:
            await self.engine.start()
        finally:
            release_gc(self._gc_was_on)

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.engine, method)(*args)

    def pid(self) -> int:
        """This actor's process id (for operators, and the chaos tests' ``kill -9``)."""
        return os.getpid()

    def shm_files(self) -> list[str]:
        """Shared-memory files (``/dev/shm``) this actor's engine processes have mapped: what
        a replica killed without a goodbye leaves behind (vLLM's message queues)."""
        return shm_files_of(os.getpid())

    async def load(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """``update_weights`` with tensors that came through Ray's object store."""
        await self.engine.update_weights(TensorWeights(version, tensors))

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class TrainerHost:
    """One trainer rank's actor. ``export`` runs the (collective) export on every rank and
    returns the tensors from rank 0 only. Rank 0 can also host the relay tier's trainer
    endpoint (``push_*``: ``runtime.proxies.RemotePush`` drives it), so a new version goes
    from here to the master relay, not through the driver; the other ranks then only take
    part in the export (``export_drain``)."""

    def __init__(
        self, config_yaml: str, rank: int, world: int, gpus: int, log_path: str | None = None
    ) -> None:
        self._gc_was_on = hold_gc()  # until ``setup`` is done (``startup_gc``)
        log_to(log_path)
        limit_threads()
        self.rank, self.world = rank, world
        self.engine, resolved = _engine(config_yaml, "trainer", rank, "trainer", gpus)
        self.resolved = resolved
        self.cfg = resolved.cfg
        self.options = resolved.engine_options.get("trainer")
        self.push: Any = None  # rank 0's relay endpoint (TrainerPush), once opened
        self.outgoing: dict[int, Any] = {}  # version -> its Outgoing (the newest two)

    def pid(self) -> int:
        """This actor's process id (for operators, and the chaos tests' ``kill -9``)."""
        return os.getpid()

    def ping(self) -> bool:
        return True

    def rendezvous(self) -> str:
        """``tcp://ip:port`` on this node for torch.distributed's rendezvous (rank 0)."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"

    async def setup(self, init_method: str, options: dict) -> None:
        ctx = TrainerContext(
            self.rank,
            self.world,
            self.options,
            self.cfg.algorithm,
            {"init_method": init_method, **options},
        )
        try:
            await self.engine.setup(ctx)
        finally:
            release_gc(self._gc_was_on)

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.engine, method)(*args)

    async def export_drain(self) -> None:
        """Take part in a collective export whose tensors another rank keeps."""
        async for _ in self.engine.export_weights():
            pass

    # --- the relay tier's trainer endpoint, on rank 0 ------------------------------------------

    async def push_open(self) -> Any:
        from laminar_core.relay.push import TrainerPush

        factory = default_manager().get("transport", self.cfg.relay.transport)
        ctx = BuildContext(self.cfg, self.resolved.engine_options.get("relay"), 0, "trainer")
        self.push = TrainerPush(build(factory, ctx))
        return await self.push.open()

    async def push_connect(self, peers: dict[int, Any]) -> None:
        await self.push.connect(peers)

    async def push_close(self) -> None:
        if self.push is not None:
            await self.push.close()
        self.outgoing.clear()

    async def push_probe(self, rank: int, size: int, reps: int) -> None:
        await self.push.send_probe(rank, size, reps)

    async def push_prepare(
        self, version: int, endpoints: int, settings: dict[str, Any]
    ) -> tuple[int, int, bool]:
        """Stage (or set up the stream of) this rank's export as ``version``; returns
        ``(bytes, chunk, staged)``. Collective: the other ranks run ``export_drain``."""
        push = self.push
        push.configure(**settings["configure"])
        push.model_bytes = settings["model_bytes"]
        out = await push.prepare(
            version,
            self.engine.export_weights(),
            endpoints,
            settings["model_bytes"],
            settings["stage"],
        )
        self.outgoing = {v: o for v, o in self.outgoing.items() if v >= version - 1}
        self.outgoing[version] = out
        return out.nbytes, out.chunk, out.staged

    async def push_send(self, version: int, master_rank: int) -> str:
        """Send the prepared ``version`` to the master; returns its manifest (JSON)."""
        from laminar_core.types import manifest_to_json

        out = self.outgoing[version]
        await out.send(master_rank)
        return manifest_to_json(out.manifest)

    async def push_abort(self, version: int, master_rank: int) -> None:
        await self.outgoing[version].abort(master_rank)

    async def export(self) -> list[tuple[str, torch.Tensor]] | None:
        if self.rank == 0:
            return [item async for item in self.engine.export_weights()]
        async for _ in self.engine.export_weights():  # take part in every gather, keep nothing
            pass
        return None


def remove_files(paths: list[str]) -> int:
    """Unlink ``paths`` that still exist; how many were removed."""
    removed = 0
    for p in paths:
        try:
            os.unlink(p)
            removed += 1
        except OSError:
            pass
    return removed

"""What runs inside the trainer and replica actors: one engine per actor, from the registry.

The actor gets the resolved config as YAML (plain text crosses processes cleanly), builds its
engine with the same ``BuildContext`` the local runtime uses, and forwards calls to it.
Nothing here knows the loop; the driver-side proxies (``runtime.proxies``) make these actors
look like a ``RolloutEngine`` and a ``TrainerGroup`` to the controller and the manager.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from laminar_core.runtime.startup_gc import hold_gc, release_gc

if TYPE_CHECKING:
    import torch

    from laminar_core.runtime.zygote import Forked

log = logging.getLogger(__name__)

# This module is what a thin actor (one whose host runs in a process the zygote forked,
# ``runtime.zygote``) imports: nothing here may import torch, transformers or an engine at
# module level (``tests/test_lazy_imports.py``); building an engine imports them.


def _engine(config_yaml: str, kind: str, index: int, name: str, gpus: int) -> Any:
    import yaml

    from laminar_core.interfaces import BuildContext, build
    from laminar_core.plugins import default_manager
    from laminar_core.runtime.actor_process import pin_cores
    from laminar_core.runtime.resolve import resolve

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


def _prepare_process(log_path: str | None) -> None:
    from laminar_core.runtime.actor_process import limit_threads, log_to

    log_to(log_path)
    limit_threads()


H = TypeVar("H")


def _forwarding(*in_actor: str) -> Callable[[type[H]], type[H]]:
    """Class decorator for a host actor: when the instance forked its host (``_child`` set,
    by ``_fork_host``), each public method but ``in_actor`` runs there (the arguments and
    the result pickled, its exception re-raised as itself); else it runs here, as without a
    zygote. Forwarded methods are coroutines either way (Ray calls them alike)."""

    def wrap(name: str, fn: Callable) -> Callable:
        is_async = inspect.iscoroutinefunction(fn)

        @functools.wraps(fn)
        async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            child: Forked | None = self._child
            if child is not None:
                return await child.call(name, args, kwargs)
            result = fn(self, *args, **kwargs)
            return await result if is_async else result

        return method

    def decorate(cls: type[H]) -> type[H]:
        for name, fn in list(vars(cls).items()):
            if name.startswith("_") or name in in_actor or not inspect.isfunction(fn):
                continue
            setattr(cls, name, wrap(name, fn))
        return cls

    return decorate


def _fork_host(
    host: Any, zygote: tuple | None, kind: str, args: tuple, log_path: str | None
) -> bool:
    """Ask the driver's zygote for a process that builds ``type(host)(*args)`` and serves
    it (``runtime.zygote``); True if it did (``host._child`` is then set). False where there
    is no zygote for this actor (none, another node) or it cannot fork (said once, in the
    log): the caller builds the host in this process."""
    host._child = None
    if not zygote:
        return False
    path, node, engine = zygote
    import ray

    if ray.get_runtime_context().get_node_id() != node:
        return False  # another node of the cluster: its actors start as without a zygote
    from laminar_core.runtime.actor_process import log_to
    from laminar_core.runtime.zygote import Forked, ZygoteUnavailable

    log_to(log_path)  # the child gets this process's output: the actor's log
    cls = type(host)
    try:
        host._child = Forked.open(
            path,
            f"{cls.__module__}:{cls.__qualname__}",
            args,
            {"log_path": log_path},
            kind=kind,
            engine=engine,
            name=cls.__qualname__,
        )
    except ZygoteUnavailable as e:
        if e.by_design:
            return False
        log.warning("%s: building the engine in this process, not forked: %s", cls.__name__, e)
        print(f"laminar: {cls.__name__} not forked from the zygote: {e}", flush=True)
        return False
    return True


@_forwarding("node_id")
class RolloutHost:
    """A rollout replica's actor: ``call(method, *args)`` forwards to the engine; ``start``
    starts it (the end of this process's start-up). With ``zygote`` (``(socket path, node
    id, engine name)``: ``runtime.zygote``) the engine is built in a process forked from
    the node's zygote, and every method but ``node_id`` runs there."""

    _child: Forked | None = None

    def __init__(
        self,
        config_yaml: str,
        index: int,
        name: str,
        gpus: int,
        log_path: str | None = None,
        zygote: tuple | None = None,
    ) -> None:
        if _fork_host(self, zygote, "rollout", (config_yaml, index, name, gpus), log_path):
            return
        self._gc_was_on = hold_gc()  # until the engine has started (``startup_gc``)
        _prepare_process(log_path)
        from laminar_core.runtime.actor_process import detach_resource_tracker

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
        """The engine's process id (for operators, and the chaos tests' ``kill -9``): this
        actor's, or the forked host's (its death ends this actor too)."""
        return os.getpid()

    def process_state(self) -> tuple[str, bool, int, list[list[int]]]:
        """``(host class, *actor_process.process_state())`` of the engine's process."""
        from laminar_core.runtime.actor_process import process_state

        return (type(self).__name__, *process_state())

    def shm_files(self) -> list[str]:
        """Shared-memory files (``/dev/shm``) this actor's engine processes have mapped: what
        a replica killed without a goodbye leaves behind (vLLM's message queues)."""
        from laminar_core.interfaces import shm_files_of

        return shm_files_of(os.getpid())

    async def load(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """``update_weights`` with tensors that came through Ray's object store (a thin
        actor imports torch to receive them, and pickles them on to its host)."""
        from laminar_core.interfaces import TensorWeights

        await self.engine.update_weights(TensorWeights(version, tensors))

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


@_forwarding("rendezvous")
class TrainerHost:
    """One trainer rank's actor. ``export`` runs the (collective) export on every rank and
    returns the tensors from rank 0 only. Rank 0 can also host the relay tier's trainer
    endpoint (``push_*``: ``runtime.proxies.RemotePush`` drives it), so a new version goes
    from here to the master relay, not through the driver; the other ranks then only take
    part in the export (``export_drain``). With ``zygote`` (``(socket path, node id,
    engine name)``: ``runtime.zygote``) the rank's engine is built in a process forked from
    the node's zygote, and every method but ``rendezvous`` runs there."""

    _child: Forked | None = None

    def __init__(
        self,
        config_yaml: str,
        rank: int,
        world: int,
        gpus: int,
        log_path: str | None = None,
        zygote: tuple | None = None,
    ) -> None:
        if _fork_host(self, zygote, "trainer", (config_yaml, rank, world, gpus), log_path):
            return
        self._gc_was_on = hold_gc()  # until ``setup`` is done (``startup_gc``)
        _prepare_process(log_path)
        self.rank, self.world = rank, world
        self.engine, resolved = _engine(config_yaml, "trainer", rank, "trainer", gpus)
        self.resolved = resolved
        self.cfg = resolved.cfg
        self.options = resolved.engine_options.get("trainer")
        self.push: Any = None  # rank 0's relay endpoint (TrainerPush), once opened
        self.outgoing: dict[int, Any] = {}  # version -> its Outgoing (the newest two)

    def pid(self) -> int:
        """The rank's process id (for operators, and the chaos tests' ``kill -9``): this
        actor's, or the forked host's (its death ends this actor too)."""
        return os.getpid()

    def ping(self) -> bool:
        return True

    def process_state(self) -> tuple[str, bool, int, list[list[int]]]:
        """``(host class, *actor_process.process_state())`` of the engine's process."""
        from laminar_core.runtime.actor_process import process_state

        return (type(self).__name__, *process_state())

    def rendezvous(self) -> str:
        """``tcp://ip:port`` on this node for torch.distributed's rendezvous (rank 0)."""
        import ray

        from laminar_core.net import free_port

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"

    async def setup(self, init_method: str, options: dict) -> None:
        from laminar_core.interfaces import TrainerContext

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
        from laminar_core.interfaces import BuildContext, build
        from laminar_core.plugins import default_manager
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

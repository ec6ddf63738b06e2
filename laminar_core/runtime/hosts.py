"""What runs inside the Ray actors: one engine per actor, built from the plugin registry.

The actor gets the resolved config as YAML (plain text crosses processes cleanly), builds its
engine with the same ``BuildContext`` the local runtime uses, and forwards calls to it.
Nothing here knows the loop; the driver-side proxies (``runtime.proxies``) make these actors
look like ordinary engines to the controller and the rollout manager.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from laminar_core.config.loader import resolve
from laminar_core.interfaces import BuildContext, TrainerContext, build
from laminar_core.plugins import default_manager


def _engine(config_yaml: str, section: str, kind: str, index: int, name: str, gpus: int) -> Any:
    import yaml

    resolved = resolve(yaml.safe_load(config_yaml), source="driver")
    cfg = resolved.cfg
    engine_name = cfg.rollout.engine if kind == "rollout" else cfg.trainer.engine
    factory = default_manager().get(kind, engine_name)
    ctx = BuildContext(cfg, resolved.engine_options.get(section), index, name, gpus, {})
    return build(factory, ctx), resolved


def _threads() -> None:
    # Ray gives each worker the node's full CPU count by default; with several engines on
    # one small machine that oversubscription makes torch many times slower.
    n = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, n))


class RolloutHost:
    """A rollout replica's actor: ``call(method, *args)`` forwards to the engine."""

    def __init__(self, config_yaml: str, index: int, name: str, gpus: int) -> None:
        _threads()
        self.engine, _ = _engine(config_yaml, "rollout", "rollout", index, name, gpus)

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.engine, method)(*args)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class TrainerHost:
    """One trainer rank's actor. ``export`` runs the (collective) export on every rank and
    returns the tensors from rank 0 only."""

    def __init__(self, config_yaml: str, rank: int, world: int, gpus: int) -> None:
        _threads()
        self.rank, self.world = rank, world
        self.engine, resolved = _engine(config_yaml, "trainer", "trainer", rank, "trainer", gpus)
        self.cfg = resolved.cfg
        self.options = resolved.engine_options.get("trainer")

    def rendezvous(self) -> str:
        return rendezvous()

    async def setup(self, init_method: str, options: dict) -> None:
        ctx = TrainerContext(
            self.rank,
            self.world,
            self.options,
            self.cfg.algorithm,
            {"init_method": init_method, **options},
        )
        await self.engine.setup(ctx)

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.engine, method)(*args)

    def export(self) -> list[tuple[str, torch.Tensor]] | None:
        tensors = self.engine.export_weights()
        if self.rank == 0:
            return list(tensors)
        for _ in tensors:  # the other ranks take part in every all-gather, keep nothing
            pass
        return None


def rendezvous() -> str:
    """``tcp://ip:port`` on this node for torch.distributed's rendezvous (rank 0's actor)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"

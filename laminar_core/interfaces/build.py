"""How the runtime constructs engines from config.

A plugin registers a *class*. If it has an ``Options`` dataclass, the engine's section of the
config (``rollout.<name>``, ``trainer.<name>``, ``relay.<name>``) is validated against it
(unknown keys and wrong types are config errors; an engine without ``Options`` takes no
section). When the config is resolved, the chosen class is also checked against its
interface (it subclasses it, or has each of its abstract methods): a missing method is a
one-line config error before anything starts. Each process of the run then builds its
instance with ``cls.from_config(ctx)`` when the class defines it, else ``cls(ctx)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BuildContext:
    """What an engine factory gets.

    ``config``: the whole validated ``LaminarConfig``; ``options``: this engine's validated
    ``Options`` instance (or ``None``); ``index``: replica index / trainer rank / endpoint
    rank; ``name``: replica id or endpoint name; ``gpus``: GPUs this instance models or
    uses; ``shared``: state shared by all instances built for one run (e.g. a fabric);
    ``own_process``: the instance has its process to itself (the Ray runtime's actor hosts
    one engine), so it may run what sets process-wide state (e.g. vLLM's engine core).
    """

    config: Any
    options: Any = None
    index: int = 0
    name: str = ""
    gpus: int = 1
    shared: dict[str, Any] = field(default_factory=dict)
    own_process: bool = False

    def seed(self, base: int = 0) -> int:
        """A seed for this instance's own random stream (a replica's sampler):
        ``base`` (the engine's ``seed`` option) + 1000 * ``run.seed`` + ``index``, modulo
        2**32 (numpy's range). Two replicas of a run never draw the same stream (up to 1000
        replicas), and ``run.seed`` moves all of them; an instance rebuilt at the same
        index (a replaced replica) draws its predecessor's."""
        run_seed = getattr(getattr(self.config, "run", None), "seed", 0) or 0
        return (base + 1000 * run_seed + self.index) % (1 << 32)


def build(factory: Any, ctx: BuildContext) -> Any:
    """``factory.from_config(ctx)`` if it has one, else ``factory(ctx)``."""
    from_config = getattr(factory, "from_config", None)
    return from_config(ctx) if from_config is not None else factory(ctx)

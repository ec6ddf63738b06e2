"""The runtime seam: a ``Runtime`` starts a run's parts and returns a typed ``Run``.

The loop (controller, rollout manager, buffers, relay tier) is the same code whatever hosts
the engines; a runtime decides where the trainer ranks, the rollout replicas and the node
relays live, starts them, restarts one on demand, and tears everything down:

* ``runtime.local.LocalRuntime``: every part is a plain object in this process (simulated
  engines, the simulator's studies, unit tests);
* ``runtime.ray_run.RayRuntime``: trainer ranks, replicas and node relays are Ray actors.

A runtime object serves one run. ``start`` builds and starts everything (the trainer group is
set up, the engines are not started yet: the rollout manager starts them) and returns the
``Run``; ``close`` releases what ``start`` took. The ``restart_*`` hooks are what in-run
recovery calls: a replica re-initialised in place, a relay replaced, the trainer group
started again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar_core.buffers import ExperienceBuffer
from laminar_core.config.loader import ResolvedConfig
from laminar_core.interfaces import RolloutEngine
from laminar_core.loop.controller import Controller
from laminar_core.loop.manager import NodeRelayLike, RolloutManager
from laminar_core.loop.schedules import Schedule
from laminar_core.loop.trainer_group import TrainerGroup
from laminar_core.relay.tier import RelayTier
from laminar_core.runtime.placement import Placement
from laminar_core.tasks import DataReport
from laminar_core.telemetry import EventLog

if TYPE_CHECKING:
    from laminar_core.buffers.prompts import Prompt


@dataclass
class Started:
    """What a runtime built and started for a run, before the loop is wired around it."""

    trainer: TrainerGroup
    replicas: list[RolloutEngine]
    tier: RelayTier
    relays: Sequence[NodeRelayLike]  # per node (``placement.replica_node``): what replicas load
    placement: Placement
    dataset: Sequence[Prompt] | None = None  # None: data.source without a tokenizer
    data_report: DataReport | None = None
    tokenizer: Any = None  # the model's (multi-turn: observations are tokenised in the driver)
    # algorithm.teacher's replicas (engines with ``score``), not started yet; empty: none
    teachers: list[RolloutEngine] = field(default_factory=list)


@dataclass
class Run:
    """A wired run; ``await run.controller.run(steps)`` drives it, ``await run.close()``
    releases it."""

    resolved: ResolvedConfig
    schedule: Schedule
    placement: Placement
    controller: Controller
    manager: RolloutManager
    buffer: ExperienceBuffer
    tier: RelayTier
    trainer: TrainerGroup
    engines: list[RolloutEngine]  # one per replica, in replica order
    relays: list[NodeRelayLike]  # one per node, what that node's replicas watch and load
    events: EventLog
    runtime: Runtime
    run_dir: Path | None = None
    data_report: DataReport | None = None

    async def close(self) -> None:
        await self.runtime.close(self)


class Runtime(Protocol):
    """Starts and stops one run's parts (see module docstring). ``recovers``: whether its
    ``restart_*`` hooks bring failed parts back (the loop then asks it to)."""

    recovers: bool

    async def start(self) -> Run: ...

    async def close(self, run: Run) -> None:
        """Release everything ``start`` took (the trainer group, actors, shared memory);
        safe to call after a failure and more than once."""

    async def restart_replica(self, run: Run, index: int) -> RolloutEngine:
        """Re-initialise replica ``index`` in place (same slot and node) and start it; its
        weights are loaded by the rollout manager from the node's relay."""

    async def restart_relay(self, run: Run, relay_id: int) -> None:
        """Replace the dead relay ``relay_id`` on its node; the tier catches it up."""

    async def restart_trainer(self, run: Run) -> TrainerGroup:
        """Stop the trainer group and start a new one, set up (the caller restores it from
        the latest checkpoint)."""

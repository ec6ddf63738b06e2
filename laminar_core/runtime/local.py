"""The local runtime: every part of a run as a plain object in this process.

This is what the simulator and the unit tests run: the trainer is one engine (a simulated
trainer models all its GPUs), every replica an engine object, and the node relays
``NodeRelay`` objects chained over ``relay.transport`` endpoints of this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from laminar_core.config.loader import ResolvedConfig
from laminar_core.interfaces import BuildContext, RolloutEngine, TrainerContext, build
from laminar_core.loop.manager import RewardFn
from laminar_core.loop.trainer_group import LocalTrainerGroup, TrainerGroup
from laminar_core.plugins import PluginManager
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.tier import RelayTier
from laminar_core.runtime.run import Run, Started
from laminar_core.runtime.wiring import RunSpec, assemble, relay_tier_options


class LocalRuntime:
    """Builds a run's parts in this process (``runtime.run.Runtime``).

    ``shared`` is the engines' build state (``BuildContext.shared``: e.g. the in-process
    transport's fabric), kept so a part built again later joins the same run. Its parts live
    and die with the driver: a replica that fails here is a machine lost for good (what the
    simulator's failure studies model), so the loop does not ask for restarts (``recovers``);
    the ``restart_*`` hooks work when called.
    """

    recovers = False

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.shared: dict[str, Any] = {}

    def _replica(self, index: int) -> RolloutEngine:
        spec = self.spec
        cfg = spec.resolved.cfg
        factory = spec.pm.get("rollout", cfg.rollout.engine)
        ctx = spec.context("rollout", index, f"r{index}", cfg.cluster.gpus_per_replica, self.shared)
        return build(factory, ctx)

    def _teachers(self) -> list[RolloutEngine]:
        """``algorithm.teacher``'s replicas, built from the teacher's config."""
        teacher = self.spec.resolved.teacher
        if teacher is None:
            return []
        cfg = teacher.cfg
        factory = self.spec.pm.get("rollout", cfg.rollout.engine)
        return [
            build(
                factory,
                BuildContext(
                    cfg,
                    teacher.engine_options.get("rollout"),
                    i,
                    f"t{i}",
                    cfg.cluster.gpus_per_replica,
                    self.shared,
                ),
            )
            for i in range(self.spec.resolved.cfg.algorithm.teacher.replicas)
        ]

    def _trainer(self) -> TrainerGroup:
        spec = self.spec
        cfg = spec.resolved.cfg
        factory = spec.pm.get("trainer", cfg.trainer.engine)
        ctx = spec.context("trainer", 0, "trainer", spec.placement.trainer_gpus, self.shared)
        setup = TrainerContext(0, 1, ctx.options, cfg.algorithm, {"seed": cfg.run.seed})
        return LocalTrainerGroup(build(factory, ctx), setup)

    def build(self) -> Run:
        """Every part, wired (the trainer is not set up yet; ``start`` does that)."""
        spec = self.spec
        place = spec.placement
        relays = [NodeRelay(n, n) for n in range(place.nodes)]
        transport = spec.pm.get("transport", spec.resolved.cfg.relay.transport)
        tier = RelayTier.in_process(
            relays,
            lambda rank: build(transport, spec.context("relay", rank, f"ep{rank}", 1, self.shared)),
            **relay_tier_options(spec.resolved),
        )
        replicas = [self._replica(i) for i in range(place.replicas)]
        started = Started(self._trainer(), replicas, tier, relays, place, teachers=self._teachers())
        return assemble(spec, started, self)

    async def start(self) -> Run:
        run = self.build()
        await run.trainer.setup()
        return run

    async def close(self, run: Run) -> None:
        await run.trainer.close()

    async def restart_replica(self, run: Run, index: int) -> RolloutEngine:
        engine = self._replica(index)
        await engine.start()
        return engine

    async def restart_relay(self, run: Run, relay_id: int) -> None:
        raise NotImplementedError("relays of the local runtime live and die with the driver")

    async def restart_trainer(self, run: Run) -> TrainerGroup:
        await run.trainer.close()
        trainer = self._trainer()
        await trainer.setup()
        return trainer


def build_local_run(
    resolved: ResolvedConfig,
    schedule_spec: str | None = None,
    pm: PluginManager | None = None,
    run_dir: Path | None = None,
    reward_fn: RewardFn | None = None,
    record_events: bool | None = None,
) -> Run:
    """Every part of a local run for ``schedule_spec`` (default: the config's schedule),
    wired; its trainer is not set up (simulated trainers need none; ``LocalRuntime.start``
    does it). Must be called inside a running event loop (parts create asyncio primitives).
    ``record_events`` overrides ``telemetry.events`` (studies keep no timeline)."""
    spec = RunSpec.of(
        resolved,
        schedule_spec,
        pm,
        run_dir=run_dir,
        reward_fn=reward_fn,
        record_events=record_events,
    )
    return LocalRuntime(spec).build()

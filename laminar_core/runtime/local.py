"""The local runtime: every component as a plain object in this process.

This is what the simulator and the unit tests run. A distributed runtime builds the same
components as actors and hands the controller and manager proxies with the same async
methods; the loop code does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar_core.buffers import ExperienceBuffer, PromptPool
from laminar_core.buffers.prompts import Prompt
from laminar_core.config.loader import ResolvedConfig, make_schedule
from laminar_core.interfaces import BuildContext, RolloutEngine, TrainerEngine, build
from laminar_core.loop.controller import Controller
from laminar_core.loop.manager import (
    ManagerOptions,
    NodeRelayLike,
    ReplicaSlot,
    RewardFn,
    RolloutManager,
)
from laminar_core.loop.schedules import Schedule
from laminar_core.plugins import PluginManager, default_manager
from laminar_core.relay.node import NodeRelay
from laminar_core.relay.tier import RelayTier
from laminar_core.runtime.placement import Placement, plan_placement
from laminar_core.tasks import build_prompts
from laminar_core.telemetry import EventLog, MetricsWriter
from laminar_core.types import SamplingParams


@dataclass
class LocalRun:
    """A fully wired run; ``await run.controller.run(steps)`` drives it."""

    resolved: ResolvedConfig
    schedule: Schedule
    placement: Placement
    controller: Controller
    manager: RolloutManager
    buffer: ExperienceBuffer
    tier: RelayTier
    trainers: list[TrainerEngine]
    engines: list[RolloutEngine]
    events: EventLog
    run_dir: Path | None = None
    shared: dict = field(default_factory=dict)
    relays: list[NodeRelayLike] = field(default_factory=list)  # per node, what replicas read


def relay_tier_options(resolved: ResolvedConfig) -> dict[str, Any]:
    """``RelayTier`` keyword arguments from ``relay.*`` (chunking, link, bounds, staging).

    ``t_byte_s``/``t_start_s`` (both > 0) fix the link the chunk count is derived from;
    ``calibrate`` is left to the caller (it measures a real trainer -> master link).
    """
    r = resolved.cfg.relay
    return {
        "bucket_bytes": max(1, int(r.bucket_mb * (1 << 20))),
        "chunks": r.chunks,
        "link": (r.t_byte_s, r.t_start_s) if r.t_byte_s > 0 and r.t_start_s > 0 else None,
        "max_chunks": r.max_chunks,
        "timeout_s": r.timeout_s,
        "stage": r.stage_push,  # phantom (simulated) versions are never staged
    }


def build_dataset(resolved: ResolvedConfig, tokenizer=None):
    """The prompt dataset of ``data.source`` (no tokenizer: simulated lengths, no ids)."""
    return build_prompts(resolved, tokenizer)[0]


def build_local_run(
    resolved: ResolvedConfig,
    schedule_spec: str | None = None,
    pm: PluginManager | None = None,
    run_dir: Path | None = None,
    reward_fn: RewardFn | None = None,
    record_events: bool | None = None,
) -> LocalRun:
    """Construct every component for ``schedule_spec`` (default: the config's schedule).

    Must be called inside a running event loop (components create asyncio primitives).
    ``record_events`` overrides ``telemetry.events`` (studies keep no timeline).
    """
    pm = pm or default_manager()
    cfg = resolved.cfg
    schedule = make_schedule(schedule_spec or cfg.schedule, cfg, pm)
    place = plan_placement(cfg, schedule)
    shared: dict = {}

    def ctx(section: str, index: int, name: str, gpus: int) -> BuildContext:
        return BuildContext(cfg, resolved.engine_options.get(section), index, name, gpus, shared)

    rollout_cls = pm.get("rollout", cfg.rollout.engine)
    engines: list[RolloutEngine] = [
        build(rollout_cls, ctx("rollout", i, f"r{i}", cfg.cluster.gpus_per_replica))
        for i in range(place.replicas)
    ]
    trainer_cls = pm.get("trainer", cfg.trainer.engine)
    trainers: list[TrainerEngine] = [
        build(trainer_cls, ctx("trainer", 0, "trainer", place.trainer_gpus))
    ]
    return assemble(
        resolved,
        schedule,
        place,
        trainers,
        engines,
        pm,
        shared,
        run_dir=run_dir,
        reward_fn=reward_fn,
        record_events=record_events,
    )


def assemble(
    resolved: ResolvedConfig,
    schedule: Schedule,
    place: Placement,
    trainers: list[TrainerEngine],
    engines: list[RolloutEngine],
    pm: PluginManager,
    shared: dict,
    *,
    dataset: Sequence[Prompt] | None = None,
    run_dir: Path | None = None,
    reward_fn: RewardFn | None = None,
    record_events: bool | None = None,
    tier: RelayTier | None = None,
    relays: Sequence[NodeRelayLike] | None = None,
) -> LocalRun:
    """Wire the loop (relays, buffers, manager, controller) around built engines.

    The engines may be local objects or proxies over remote actors: the loop only awaits
    their methods. ``dataset`` defaults to ``data.source`` without a tokenizer.

    Without ``tier`` the node relays are ``NodeRelay`` objects in this process, chained by
    ``relay.transport`` endpoints of this process. A runtime that hosts relays elsewhere
    passes its own ``tier`` and ``relays``: one per node (index ``place.replica_node[i]``),
    each what that node's replicas watch and load from (e.g. ``relay.view.SharedRelayView``).
    """
    cfg = resolved.cfg
    events = EventLog(enabled=cfg.telemetry.events if record_events is None else record_events)

    def ctx(section: str, index: int, name: str, gpus: int) -> BuildContext:
        return BuildContext(cfg, resolved.engine_options.get(section), index, name, gpus, shared)

    if tier is None:
        local_relays = [NodeRelay(n, n) for n in range(place.nodes)]
        relays = local_relays
        transport_cls = pm.get("transport", cfg.relay.transport)
        tier = RelayTier(
            local_relays,
            lambda rank: build(transport_cls, ctx("relay", rank, f"ep{rank}", 1)),
            **relay_tier_options(resolved),
        )
    elif relays is None or len(relays) != place.nodes:
        raise ValueError(f"a prebuilt relay tier needs one relay view per node ({place.nodes})")
    sampler = schedule.sampler if cfg.buffer.sampler == "auto" else cfg.buffer.sampler
    buffer = ExperienceBuffer(sampler)
    prompts = PromptPool(
        build_dataset(resolved) if dataset is None else dataset,
        cfg.data.samples_per_prompt,
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
    )
    slots = [
        ReplicaSlot(e.replica_id, i, e, relays[place.replica_node[i]])
        for i, e in enumerate(engines)
    ]
    opts = ManagerOptions(
        groups_per_step=cfg.data.prompts_per_step,
        max_concurrent=cfg.rollout.max_concurrent,
        sampling=SamplingParams(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_tokens=cfg.rollout.max_tokens,
        ),
        repack_interval_s=cfg.repack.interval_s,
        heartbeat_s=cfg.rollout.heartbeat_s,
        heartbeat_timeout_s=cfg.rollout.heartbeat_timeout_s,
        partial_sync_s=cfg.rollout.partial_sync_s,
    )
    repack = None
    if cfg.repack.policy != "none":
        repack = build(pm.get("repack", cfg.repack.policy), ctx("repack", 0, "repack", 0))
    manager = RolloutManager(
        slots, prompts, buffer, schedule, opts, repack=repack, reward_fn=reward_fn, events=events
    )
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if run_dir else None)
    controller = Controller(
        trainers,
        manager,
        buffer,
        tier,
        cfg.data.prompts_per_step,
        metrics=metrics,
        events=events,
        needs_logprobs=cfg.algorithm.off_policy != "none",
        run_dir=run_dir,
        checkpoint_every=cfg.run.checkpoint_every,
    )
    return LocalRun(
        resolved,
        schedule,
        place,
        controller,
        manager,
        buffer,
        tier,
        trainers,
        engines,
        events,
        run_dir,
        shared,
        list(relays),
    )

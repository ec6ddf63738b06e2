"""Wiring the loop around started engines: what every runtime shares.

``RunSpec`` is what a run is made from (the config, the schedule, the placement, the plugin
registry, the run directory); ``assemble`` builds the buffers, the rollout manager and the
controller around what a runtime started (``runtime.run.Started``) and returns the ``Run``;
``attach_evaluation`` gives a run's controller its eval rounds (``loop.evaluation``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from laminar_core.algorithms.config import dynamic_sampling
from laminar_core.algorithms.filters import group_filter
from laminar_core.buffers import ExperienceBuffer, PromptPool
from laminar_core.config.loader import ResolvedConfig
from laminar_core.envs.build import make_environment
from laminar_core.interfaces import BuildContext, build
from laminar_core.loop.controller import Controller, ControllerOptions
from laminar_core.loop.episodes import Episodes
from laminar_core.loop.evaluation import Evaluation, build_eval_prompts
from laminar_core.loop.manager import ManagerOptions, ReplicaSlot, RewardFn, RolloutManager
from laminar_core.loop.schedules import Schedule
from laminar_core.loop.teacher import TeacherPool
from laminar_core.plugins import PluginManager, default_manager
from laminar_core.relay.node import NodeRelay
from laminar_core.runtime.placement import Placement, plan_placement
from laminar_core.runtime.resolve import make_schedule
from laminar_core.runtime.run import Run, Runtime, Started
from laminar_core.tasks import build_prompts
from laminar_core.tasks.build import Tokenizer
from laminar_core.telemetry import ROLLOUTS_FILE, EventLog, MetricsWriter, RolloutDump
from laminar_core.types import SamplingParams


@dataclass
class RunSpec:
    """What a run is made from, decided before anything starts."""

    resolved: ResolvedConfig
    schedule: Schedule
    placement: Placement
    pm: PluginManager
    run_dir: Path | None = None
    reward_fn: RewardFn | None = None
    record_events: bool | None = None  # None: telemetry.events (studies keep no timeline)

    @classmethod
    def of(
        cls,
        resolved: ResolvedConfig,
        schedule: str | None = None,
        pm: PluginManager | None = None,
        *,
        run_dir: Path | None = None,
        reward_fn: RewardFn | None = None,
        record_events: bool | None = None,
        allow_colocate: bool = True,
    ) -> RunSpec:
        """The spec for ``schedule`` (default: the config's). ``allow_colocate=False`` for
        real engines: they do not offload to time-share a device."""
        pm = pm or default_manager()
        sched = make_schedule(schedule or resolved.cfg.schedule, resolved.cfg, pm)
        place = plan_placement(resolved.cfg, sched, allow_colocate=allow_colocate)
        return cls(resolved, sched, place, pm, run_dir, reward_fn, record_events)

    def context(
        self, section: str, index: int, name: str, gpus: int, shared: dict[str, Any]
    ) -> BuildContext:
        """How an engine of ``section`` (rollout, trainer, relay, repack) is built."""
        r = self.resolved
        return BuildContext(r.cfg, r.engine_options.get(section), index, name, gpus, shared)


def relay_tier_options(resolved: ResolvedConfig) -> dict[str, Any]:
    """``RelayTier`` keyword arguments from ``relay.*`` (chunking, link, bounds, staging).

    ``t_byte_s``/``t_start_s`` (both > 0) fix the link the chunk count is derived from;
    ``calibrate`` is the runtime's to decide (it measures a real trainer -> master link).
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


def assemble(spec: RunSpec, started: Started, runtime: Runtime) -> Run:
    """Wire the loop (buffers, rollout manager, controller) around ``started``.

    The engines may be local objects or proxies over remote actors: the loop only awaits
    their methods. Without a dataset, ``data.source`` is read without a tokenizer.
    """
    cfg = spec.resolved.cfg
    place = started.placement
    if len(started.relays) != place.nodes:
        raise ValueError(f"a run needs one node relay per node ({place.nodes})")
    record = cfg.telemetry.events if spec.record_events is None else spec.record_events
    events = EventLog(enabled=record)
    dataset = started.dataset
    if dataset is None:
        dataset = build_prompts(spec.resolved, None)[0]
    sampler = spec.schedule.sampler if cfg.buffer.sampler == "auto" else cfg.buffer.sampler
    sampling = dynamic_sampling(cfg.algorithm)
    buffer = ExperienceBuffer(sampler, group_filter(sampling.filter) if sampling else None)
    prompts = PromptPool(
        dataset, cfg.data.samples_per_prompt, seed=cfg.run.seed, shuffle=cfg.data.shuffle
    )
    slots = [
        ReplicaSlot(e.replica_id, i, e, started.relays[place.replica_node[i]])
        for i, e in enumerate(started.replicas)
    ]
    episodes = None
    if cfg.env.name:  # multi-turn: every trajectory talks to the environment between turns
        env = make_environment(cfg.env, spec.pm)
        episodes = Episodes(env, started.tokenizer, cfg.rollout.max_tokens)
    opts = ManagerOptions(
        groups_per_step=cfg.data.prompts_per_step,
        max_concurrent=cfg.rollout.max_concurrent,
        sampling=SamplingParams(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_tokens=cfg.rollout.max_tokens,
            stop=list(episodes.stop) if episodes is not None else [],
        ),
        repack_interval_s=cfg.repack.interval_s,
        heartbeat_s=cfg.rollout.heartbeat_s,
        heartbeat_timeout_s=cfg.rollout.heartbeat_timeout_s,
        partial_sync_s=cfg.rollout.partial_sync_s,
        max_restarts=cfg.rollout.max_restarts,
        restart_window_s=cfg.rollout.restart_window_s,
    )
    repack = build(spec.pm.get("repack", cfg.repack.policy), spec.context("repack", 0, "", 0, {}))
    manager = RolloutManager(
        slots,
        prompts,
        buffer,
        spec.schedule,
        opts,
        repack=repack,
        reward_fn=spec.reward_fn,
        events=events,
        episodes=episodes,
        dynamic_sampling=sampling,
        teacher=TeacherPool(started.teachers) if started.teachers else None,
    )
    if cfg.agent.entrypoint or cfg.agent.command:  # ``runtime.agents.agents_enabled``
        # every rollout is an agent episode through the gateway; imported only here, so a
        # run without agents (and every actor process) skips fastapi and the gateway
        from laminar_core.runtime.agents import attach_agents

        attach_agents(manager, cfg, started.tokenizer)
    run_dir = spec.run_dir
    controller = Controller(
        started.trainer,
        manager,
        buffer,
        started.tier,
        ControllerOptions(
            groups_per_step=cfg.data.prompts_per_step,
            needs_logprobs=cfg.algorithm.off_policy != "none",
            checkpoint_every=cfg.run.checkpoint_every,
            checkpoint_on_stop=cfg.run.checkpoint_on_stop,
            max_staleness=cfg.buffer.max_staleness,
            stale_policy=cfg.buffer.stale_policy,
            max_trainer_restarts=cfg.trainer.max_restarts,
            max_unavailable_s=cfg.relay.max_unavailable_s,
            max_failed_steps=cfg.run.max_failed_steps,
        ),
        metrics=MetricsWriter(run_dir / "metrics.jsonl" if run_dir else None),
        events=events,
        run_dir=run_dir,
        rollouts=(
            RolloutDump(run_dir / ROLLOUTS_FILE) if run_dir and cfg.run.dump_rollouts else None
        ),
    )
    run = Run(
        spec.resolved,
        spec.schedule,
        place,
        controller,
        manager,
        buffer,
        started.tier,
        started.trainer,
        list(started.replicas),
        list(started.relays),
        events,
        runtime,
        run_dir,
        started.data_report,
    )
    if runtime.recovers:  # the runtime re-initialises what fails; the loop asks it to

        async def restart_replica(index: int):
            return await runtime.restart_replica(run, index)

        async def restart_trainer():
            return await runtime.restart_trainer(run)

        async def restart_relay(relay_id: int) -> None:
            await runtime.restart_relay(run, relay_id)

        manager.restart_fn = restart_replica
        controller.restart_trainer = restart_trainer
        if started.tier.relays and not isinstance(started.tier.relays[0], NodeRelay):
            manager.restart_relay_fn = restart_relay  # relays hosted apart from the driver
    return run


def attach_evaluation(run: Run, tokenizer: Tokenizer | None = None) -> Evaluation | None:
    """Give ``run``'s controller its eval rounds when ``run.eval_every`` asks for them.

    Prompts are tokenised like the training prompts: with ``tokenizer``, else (training
    prompts with token ids, i.e. real engines) the model's own, loaded from ``model.path``.
    """
    cfg = run.resolved.cfg
    if cfg.run.eval_every == 0:
        return None
    train = run.manager.prompts.dataset
    if tokenizer is None and len(train) and train[0].ids:
        from transformers import AutoTokenizer

        from laminar_core.models import model_dir

        tokenizer = cast(
            Tokenizer, AutoTokenizer.from_pretrained(str(model_dir(cfg.model.path, "eval")))
        )
    prompts = build_eval_prompts(run.resolved, tokenizer, train)
    d = cfg.data
    greedy = d.eval_temperature == 0
    sampling = SamplingParams(
        temperature=d.eval_temperature,
        top_p=1.0 if greedy else cfg.rollout.top_p,
        max_tokens=d.eval_max_tokens or cfg.rollout.max_tokens,
    )
    evaluation = Evaluation(run.manager, prompts, sampling, cfg.run.eval_every, cfg.run.seed)
    run.controller.evaluation = evaluation
    return evaluation

"""The controller: the driver's step loop.

Per step: ask the experience buffer for a batch (the time spent waiting is trainer idle
time; groups past ``buffer.max_staleness`` are dropped and their prompts handed out again:
``loop.sampling``),
run the trainer group on it, publish the new version through the relay tier (the time until
the master relay holds it is the trainer's weight-sync stall), tell the rollout manager,
write one metrics row (``loop.steps``).

Recovery: a trainer group that fails (``TrainerFailure``: a rank died, a collective timed
out) is restarted by the runtime and restored from the latest checkpoint while the rollouts
keep generating; the prompts it had trained on since that checkpoint are handed out again, so
each prompt still contributes to the final model exactly once. The run stops with the cause
when no new version reaches a relay for ``relay.max_unavailable_s`` (``loop.delivery``) or
when nothing trains: every trajectory of ``max_failed_steps`` consecutive steps failed
(``loop.steps.FailedSteps``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laminar_core.buffers import ExperienceBuffer
from laminar_core.interfaces import TrainerFailure
from laminar_core.loop import checkpoint as ckpt
from laminar_core.loop.delivery import Delivery
from laminar_core.loop.evaluation import Evaluation
from laminar_core.loop.manager import RolloutManager
from laminar_core.loop.sampling import BatchSource
from laminar_core.loop.steps import FailedSteps, StepRecord, metrics_row, tool_metrics
from laminar_core.loop.stopping import StopRequested
from laminar_core.loop.teacher import teacher_metrics
from laminar_core.loop.trainer_group import TrainerGroup
from laminar_core.relay.tier import PublishResult, RelayTier
from laminar_core.telemetry import EventLog, MetricsWriter, RolloutDump
from laminar_core.telemetry.events import (
    CheckpointSaved,
    TrainerRestarted,
    TrainStep,
    WaitData,
    WeightPush,
)
from laminar_core.types import Group, TrainBatch

log = logging.getLogger(__name__)

# Stop the trainer group and start a new one, set up (the runtime's ``restart_trainer``).
RestartTrainerFn = Callable[[], Awaitable[TrainerGroup]]


@dataclass
class ControllerOptions:
    groups_per_step: int
    needs_logprobs: bool = False  # the algorithm needs the current policy's log-probs
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end; -1: never
    checkpoint_on_stop: bool = True  # a stop request (SIGTERM, Ctrl-C) saves one first
    max_staleness: int | None = None  # groups older than this are not trained on
    stale_policy: str = "drop"  # drop: hand the prompt out again; wait: see loop.sampling
    max_trainer_restarts: int = 2
    max_unavailable_s: float = 0.0  # no version delivered for this long: stop (0: never)
    max_failed_steps: int = 3  # every trajectory of this many steps failed: stop (0: never)


class Controller:
    def __init__(
        self,
        trainer: TrainerGroup,
        manager: RolloutManager,
        buffer: ExperienceBuffer,
        tier: RelayTier,
        options: ControllerOptions,
        metrics: MetricsWriter | None = None,
        events: EventLog | None = None,
        run_dir: Path | None = None,
        restart_trainer: RestartTrainerFn | None = None,
        rollouts: RolloutDump | None = None,
    ) -> None:
        self.trainer = trainer
        self.manager = manager
        self.buffer = buffer
        self.tier = tier
        self.opt = options
        self.metrics = metrics or MetricsWriter(None)
        self.events = events or EventLog(enabled=False)
        self.run_dir = run_dir
        self.restart_trainer = restart_trainer
        self.rollouts = rollouts  # run.dump_rollouts: every trained trajectory, as trained
        self.records: list[StepRecord] = []
        self.batches: list[TrainBatch] = []  # consumed batches, kept only with keep_batches
        self.keep_batches = False
        self.step = 0  # steps the trainer's current weights went through, as the loop counts
        self.version = 0  # the newest version published (versions only grow)
        self.held_version = 0  # the version the trainer's weights were published as
        self.t_start = 0.0
        self.consumed_prompts: set[int] = set()  # prompt indices trained into the weights
        self.trainer_restarts = 0
        self._since_checkpoint: list[int] = []  # prompts trained since the last checkpoint
        self._republish = False  # after a restore: replicas must get the restored weights
        self.delivery = Delivery(options.max_unavailable_s)
        self.failed_steps = FailedSteps(options.max_failed_steps)
        self._stop = asyncio.Event()
        self.batches_in = BatchSource(
            buffer,
            manager,
            self._stop,
            options.groups_per_step,
            options.max_staleness,
            options.stale_policy,
        )
        self.evaluation: Evaluation | None = None  # eval rounds (loop.evaluation), if any
        self.eval_seconds = 0.0  # eval rounds' wall time so far, kept out of the loop clock
        self._steps = 0  # the step count run() was asked to reach

    # --- checkpoints ---------------------------------------------------------------------------

    async def save_checkpoint(self) -> Path:
        """Trainer state on every rank, then the loop's state, then the ``latest`` marker
        (atomically: ``loop.checkpoint``)."""
        assert self.run_dir is not None, "checkpoints need a run directory"
        final = ckpt.checkpoint_dir(self.run_dir, self.step)
        tmp = ckpt.begin(final)
        (tmp / ckpt.TRAINER_DIR).mkdir()
        await self.trainer.save_checkpoint(str(tmp / ckpt.TRAINER_DIR))
        prompts = self.manager.prompts
        # a prompt dynamic sampling dropped was sampled and counted: it is owed to nobody
        pending = set(range(prompts.position)) - self.consumed_prompts
        pending -= self.manager.filtered_prompts
        state = {
            "step": self.step,
            "version": self.held_version,
            "prompts": prompts.state_dict(pending=pending),
        }
        ckpt.commit(tmp, final, state)
        self._since_checkpoint = []
        self.events.record(
            CheckpointSaved(t=asyncio.get_running_loop().time(), actor="trainer", step=self.step)
        )
        return final

    async def restore(self, path: str | Path) -> Path:
        """Continue from a checkpoint (or a run directory's latest): trainer state, step,
        prompt position; the restored weights are published before rollouts start."""
        d = ckpt.find_checkpoint(path)
        state = ckpt.read_loop_state(d)
        try:
            await self.trainer.load_checkpoint(str(d / ckpt.TRAINER_DIR))
        except (FileNotFoundError, ValueError, RuntimeError, KeyError) as e:
            raise ckpt.CheckpointError(
                f"checkpoint {d} is damaged: the trainer could not load it "
                f"({type(e).__name__}: {e}); resume from an earlier checkpoint"
            ) from e
        self.step = int(state["step"])
        self.version = self.held_version = int(state.get("version", self.step))
        self.batches_in.taken = self.step
        self.manager.prompts.load_state_dict(state["prompts"])
        self.manager.resume_at(self.step)
        self._republish = self.version > 0
        return d

    # --- the loop ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """End the run after the current step (a checkpoint first, if configured)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    async def run(self, steps: int) -> list[StepRecord]:
        """Train until ``steps`` steps are done (counting from ``self.step``) or a stop is
        requested (``request_stop``: SIGTERM, Ctrl-C); a stopped run saves a checkpoint
        first (``run.checkpoint_on_stop``)."""
        loop = asyncio.get_running_loop()
        self._steps = steps
        await self.tier.open()
        if self._republish:
            await self.trainer.publish(self.version, self.tier)
            # nothing runs yet: let every relay hold the restored version, so no replica
            # starts generating with the weights it loaded from disk
            await self.tier.wait_broadcast()
            self._republish = False
        await self.manager.start()
        # wall_seconds count from here: engines started (vLLM start-up is not loop time)
        self.t_start = loop.time()
        try:
            while self.step < steps and not self._stop.is_set():
                try:
                    if not await self._one_step(loop):
                        continue
                except StopRequested:
                    break
                every = self.opt.checkpoint_every
                if self.run_dir is not None and (
                    (every > 0 and self.step % every == 0) or (every >= 0 and self.step == steps)
                ):
                    await self._checkpoint_or_recover()
            if self._stop.is_set() and self.run_dir is not None and self.opt.checkpoint_on_stop:
                log.warning("stop requested: saving a checkpoint at step %s", self.step)
                await self._checkpoint_or_recover()
        finally:
            await self.manager.stop()
            await self.tier.close()
            self.metrics.close()
            if self.rollouts is not None:
                self.rollouts.close()
        return self.records

    async def _checkpoint_or_recover(self) -> None:
        """``save_checkpoint``; a trainer rank that dies while saving is recovered like one
        that dies in a step (the half-written checkpoint is never marked ``latest``, so the
        restart goes back to the previous one and redoes the steps since)."""
        try:
            await self.save_checkpoint()
        except TrainerFailure as e:
            await self._recover_trainer(None, e)

    async def _one_step(self, loop: asyncio.AbstractEventLoop) -> bool:
        """One trainer step; False if it was lost with a failed trainer (recovered)."""
        self.delivery.check(loop.time())
        step = self.step
        t0 = loop.time()
        batch = await self.batches_in.next(self.held_version)
        t1 = loop.time()
        trajs = batch.trajectories
        self.failed_steps.check(trajs)
        if self.keep_batches:
            self.batches.append(batch)
        try:
            if self.opt.needs_logprobs:
                await self.trainer.compute_logprobs(batch)
            metrics = await self.trainer.train_step(batch)
            version = self.version + 1
            pub = await self.delivery.publish(self.trainer, version, self.tier)
        except TrainerFailure as e:
            await self._recover_trainer(batch, e)
            return False
        t2 = loop.time()
        self.step += 1
        self.version = self.held_version = version
        prompts = [g.prompt_index for g in batch.groups]
        self.consumed_prompts.update(prompts)
        self._since_checkpoint += prompts
        filtered = self._filtered(batch)
        if self.rollouts is not None:
            self.rollouts.write(step, version, batch.groups)
            if filtered:
                self.rollouts.write(step, version, filtered, trained=False)
        self._tell_manager(pub, version, self.manager.consumed_groups + len(batch.groups))
        rewards = [t.reward for t in trajs if t.reward is not None]
        rec = StepRecord(
            step=step,
            version=version,
            start=t0,
            train_start=t1,
            end=t2,
            tokens=batch.num_tokens,
            trajectories=len(trajs),
            staleness=[batch.version - t.version for t in trajs],
            stall=pub.stall_seconds,
            metrics=dict(metrics),
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            rollout={
                **tool_metrics(trajs),
                **self._filter_metrics(batch, filtered),
                **teacher_metrics(trajs),
            },
        )
        self.records.append(rec)
        self.events.record(WaitData(t=t1, actor="trainer", duration=t1 - t0, step=step))
        self.events.record(
            TrainStep(
                t=t2 - pub.stall_seconds,
                actor="trainer",
                duration=t2 - t1 - pub.stall_seconds,
                step=step,
                prompts=prompts,
            )
        )
        self.events.record(
            WeightPush(t=t2, actor="trainer", duration=pub.stall_seconds, version=version)
        )
        prev = self.records[-2] if len(self.records) > 1 else None
        # the loop clock resumes where the previous step's eval round (if any) ended
        prev_end = prev.end + prev.eval_seconds if prev is not None else self.t_start
        row = metrics_row(
            rec,
            prev_end,
            rec.end - self.t_start - self.eval_seconds,
            {s.replica_id: s.version for s in self.manager.slots if s.alive},
            {
                "replicas_alive": self.manager.replicas_alive,
                "replica_restarts": self.manager.replica_restarts,
                "trainer_restarts": self.trainer_restarts,
                "stale_dropped": self.batches_in.stale_dropped,
                **self.manager.agent_counters(),
            },
        )
        if self.evaluation is not None and self.evaluation.due(self.step, self.step >= self._steps):
            row.update(await self._evaluate(rec))
        self.metrics.write(row)
        return True

    def _filtered(self, batch: TrainBatch) -> list[Group]:
        """The groups dynamic sampling dropped since the previous step."""
        return self.buffer.take_filtered() if self.manager.filter_watch is not None else []

    def _filter_metrics(self, batch: TrainBatch, filtered: list[Group]) -> dict[str, float]:
        """``groups_filtered`` since the previous step and ``filter_rate``: their share of the
        groups that finished in that time (dynamic sampling on; else nothing)."""
        if self.manager.filter_watch is None:
            return {}
        n = len(filtered)
        return {
            "groups_filtered": float(n),
            "filter_rate": n / max(1, n + len(batch.groups)),
            "sampled_trajectories": float(
                len(batch.trajectories) + sum(len(g.trajectories) for g in filtered)
            ),
        }

    async def _evaluate(self, rec: StepRecord) -> dict[str, Any]:
        """An eval round on the version this step published; its ``eval_*`` row keys.

        The trainer waits (the round needs replicas on exactly this version) and the round's
        wall time is taken out of the loop clock (``wall_seconds``, the next step's rates),
        so a run's speed figures do not depend on how often it evaluates.
        """
        assert self.evaluation is not None
        result = await self.evaluation.run(rec.version)
        rec.eval_reward, rec.eval_seconds = result.reward, result.seconds
        self.eval_seconds += result.seconds
        return result.row()

    def _tell_manager(self, pub: PublishResult, version: int, consumed: int) -> None:
        if pub.pushed is None or pub.pushed.done():
            self.manager.on_trainer_step(version, consumed)
        else:
            # A staged push: the trainer resumes now, but the rollouts hear of the step once
            # the master relay holds it (as without staging), so they do not fill up with
            # work for the old version in the moment before the new one reaches them.
            pub.pushed.add_done_callback(lambda _f: self.manager.on_trainer_step(version, consumed))

    # --- the trainer's failures ---------------------------------------------------------------

    async def _recover_trainer(self, batch: TrainBatch | None, error: BaseException) -> None:
        """Restart the trainer group from the latest checkpoint; hand out again the prompts
        whose updates were lost with it (trained since that checkpoint, and ``batch``, the
        one being trained when it failed, if any)."""
        loop = asyncio.get_running_loop()
        self.trainer_restarts += 1
        limit = self.opt.max_trainer_restarts
        if self.restart_trainer is None or self.trainer_restarts > limit:
            raise RuntimeError(
                f"the trainer failed ({error}) and was restarted {self.trainer_restarts - 1} "
                f"time(s) already (trainer.max_restarts={limit}); see the trainer ranks' logs"
            ) from error
        t0 = loop.time()
        log.warning("trainer failed (%s): restarting it from the latest checkpoint", error)
        lost = list(self._since_checkpoint)
        if batch is not None:
            lost += [g.prompt_index for g in batch.groups]
        self.trainer = await self.restart_trainer()
        where = ckpt.latest(self.run_dir) if self.run_dir is not None else None
        step, held = 0, 0
        if where is not None:
            state = ckpt.read_loop_state(where)
            await self.trainer.load_checkpoint(str(where / ckpt.TRAINER_DIR))
            step, held = int(state["step"]), int(state.get("version", state["step"]))
        lost_steps = self.step - step
        self.step = step
        self.consumed_prompts.difference_update(lost)
        self._since_checkpoint = []
        self.manager.reissue(lost)
        # the restored weights go out as a new version: the replicas leave the lost line
        version = self.version + 1
        pub = await self.delivery.publish(self.trainer, version, self.tier)
        self.version = self.held_version = version
        self._tell_manager(pub, version, self.manager.consumed_groups)
        took = loop.time() - t0
        log.warning(
            "trainer restarted in %.1fs from %s: %d step(s) and %d prompt(s) are redone",
            took,
            where or "its initial weights",
            lost_steps,
            len(lost),
        )
        self.events.record(
            TrainerRestarted(
                t=loop.time(),
                actor="trainer",
                duration=took,
                from_step=step,
                restored_version=held,
                lost_prompts=lost,
                lost_steps=lost_steps,
            )
        )

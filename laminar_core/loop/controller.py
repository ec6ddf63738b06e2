"""The controller: the driver's step loop.

Per step: ask the experience buffer for a batch (the time spent waiting is trainer idle
time), run the trainer group on it, publish the new version through the relay tier (the
time until the master relay holds it is the trainer's weight-sync stall), tell the rollout
manager, write one metrics row.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar_core.buffers import ExperienceBuffer
from laminar_core.loop import checkpoint as ckpt
from laminar_core.loop.evaluation import Evaluation
from laminar_core.loop.manager import RolloutManager
from laminar_core.loop.trainer_group import TrainerGroup
from laminar_core.relay.tier import RelayTier
from laminar_core.telemetry import EventLog, MetricsWriter
from laminar_core.types import TrainBatch


@dataclass
class StepRecord:
    step: int
    version: int  # published after this step
    start: float
    train_start: float
    end: float  # when the trainer may resume (new version at the master relay)
    tokens: int
    trajectories: int
    staleness: list[int]
    stall: float
    metrics: dict[str, float] = field(default_factory=dict)
    reward_mean: float | None = None
    eval_reward: float | None = None  # the eval round after this step, if one ran
    eval_seconds: float = 0.0  # its wall time (not loop time: see ``Controller._evaluate``)


class Controller:
    def __init__(
        self,
        trainer: TrainerGroup,
        manager: RolloutManager,
        buffer: ExperienceBuffer,
        tier: RelayTier,
        groups_per_step: int,
        metrics: MetricsWriter | None = None,
        events: EventLog | None = None,
        needs_logprobs: bool = False,
        keep_batches: bool = False,
        run_dir: Path | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        self.trainer = trainer
        self.manager = manager
        self.buffer = buffer
        self.tier = tier
        self.groups_per_step = groups_per_step
        self.metrics = metrics or MetricsWriter(None)
        self.events = events or EventLog(enabled=False)
        self.needs_logprobs = needs_logprobs
        self.records: list[StepRecord] = []
        self.batches: list[TrainBatch] = []  # consumed batches, kept only with keep_batches
        self.keep_batches = keep_batches
        self.step = 0
        self.t_start = 0.0
        self.run_dir = run_dir
        self.checkpoint_every = checkpoint_every
        self.consumed_prompts: set[int] = set()  # prompt indices whose groups were trained on
        self._republish = False  # after a restore: replicas must get the restored weights
        self.evaluation: Evaluation | None = None  # eval rounds (loop.evaluation), if any
        self.eval_seconds = 0.0  # eval rounds' wall time so far, kept out of the loop clock
        self._steps = 0  # the step count run() was asked to reach

    async def save_checkpoint(self) -> Path:
        """Trainer state on every rank, then the loop's state, then the ``latest`` marker."""
        assert self.run_dir is not None, "checkpoints need a run directory"
        d = ckpt.checkpoint_dir(self.run_dir, self.step)
        d.mkdir(parents=True, exist_ok=True)
        await self.trainer.save_checkpoint(str(d / ckpt.TRAINER_DIR))
        prompts = self.manager.prompts
        pending = set(range(prompts.position)) - self.consumed_prompts
        ckpt.write_loop_state(
            d,
            {"step": self.step, "prompts": prompts.state_dict(pending=pending)},
        )
        ckpt.mark_latest(d)
        self.events.record(
            asyncio.get_running_loop().time(), "checkpoint", "trainer", step=self.step
        )
        return d

    async def restore(self, path: str | Path) -> Path:
        """Continue from a checkpoint (or a run directory's latest): trainer state, step,
        prompt position; the restored weights are published before rollouts start."""
        d = ckpt.find_checkpoint(path)
        state = ckpt.read_loop_state(d)
        await self.trainer.load_checkpoint(str(d / ckpt.TRAINER_DIR))
        self.step = int(state["step"])
        self.manager.prompts.load_state_dict(state["prompts"])
        self.manager.resume_at(self.step)
        self._republish = self.step > 0
        return d

    async def run(self, steps: int) -> list[StepRecord]:
        """Train until ``steps`` steps are done (counting from ``self.step``)."""
        loop = asyncio.get_running_loop()
        self._steps = steps
        await self.tier.open()
        if self._republish:
            await self.trainer.publish(self.step, self.tier)
            # nothing runs yet: let every relay hold the restored version, so no replica
            # starts generating with the weights it loaded from disk
            await self.tier.wait_broadcast()
            self._republish = False
        await self.manager.start()
        # wall_seconds count from here: engines started (vLLM start-up is not loop time)
        self.t_start = loop.time()
        try:
            while self.step < steps:
                await self._one_step(loop)
                every = self.checkpoint_every
                if self.run_dir is not None and (
                    (every > 0 and self.step % every == 0) or (every >= 0 and self.step == steps)
                ):
                    await self.save_checkpoint()
        finally:
            await self.manager.stop()
            await self.tier.close()
            self.metrics.close()
        return self.records

    async def _one_step(self, loop: asyncio.AbstractEventLoop) -> None:
        step = self.step
        t0 = loop.time()
        batch = await self._sample(step)
        t1 = loop.time()
        trajs = batch.trajectories
        if self.keep_batches:
            self.batches.append(batch)
        if self.needs_logprobs:
            await self.trainer.compute_logprobs(batch)
        metrics = await self.trainer.train_step(batch)
        version = step + 1
        pub = await self.trainer.publish(version, self.tier)
        t2 = loop.time()
        self.step = version
        self.consumed_prompts.update(g.prompt_index for g in batch.groups)
        consumed = self.manager.consumed_groups + len(batch.groups)
        if pub.pushed is None or pub.pushed.done():
            self.manager.on_trainer_step(version, consumed)
        else:
            # A staged push: the trainer resumes now, but the rollouts hear of the step once
            # the master relay holds it (as without staging), so they do not fill up with
            # work for the old version in the moment before the new one reaches them.
            pub.pushed.add_done_callback(lambda _f: self.manager.on_trainer_step(version, consumed))
        rewards = [t.reward for t in trajs if t.reward is not None]
        rec = StepRecord(
            step=step,
            version=version,
            start=t0,
            train_start=t1,
            end=t2,
            tokens=batch.num_tokens,
            trajectories=len(trajs),
            staleness=[step - t.version for t in trajs],
            stall=pub.stall_seconds,
            metrics=dict(metrics),
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
        )
        self.records.append(rec)
        self.events.record(t1, "wait_data", "trainer", duration=t1 - t0, step=step)
        self.events.record(
            t2 - pub.stall_seconds,
            "train_step",
            "trainer",
            duration=t2 - t1 - pub.stall_seconds,
            step=step,
        )
        self.events.record(
            t2, "weight_push", "trainer", duration=pub.stall_seconds, version=version
        )
        prev = self.records[-2] if len(self.records) > 1 else None
        # the loop clock resumes where the previous step's eval round (if any) ended
        prev_end = prev.end + prev.eval_seconds if prev is not None else self.t_start
        row = self._row(rec, prev_end)
        if self.evaluation is not None and self.evaluation.due(version, version >= self._steps):
            row.update(await self._evaluate(rec))
        self.metrics.write(row)

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

    async def _sample(self, step: int) -> TrainBatch:
        """The next batch, unless the rollout manager breaks first (then raise)."""
        sample = asyncio.ensure_future(self.buffer.sample(step, self.groups_per_step))
        fatal = self.manager.fatal
        if fatal is None:
            return await sample
        await asyncio.wait({sample, fatal}, return_when=asyncio.FIRST_COMPLETED)
        if fatal.done():
            sample.cancel()
            raise RuntimeError(f"rollout manager failed: {fatal.exception()!r}") from (
                fatal.exception()
            )
        return sample.result()

    def _row(self, rec: StepRecord, prev_end: float) -> dict[str, Any]:
        period = max(rec.end - prev_end, 1e-12)
        replicas = {s.replica_id: s.version for s in self.manager.slots if s.alive}
        return {
            "step": rec.step,
            "weight_version": rec.version,
            "wall_seconds": rec.end - self.t_start - self.eval_seconds,
            "reward_mean": rec.reward_mean,
            "trajectories": rec.trajectories,
            "tokens": rec.tokens,
            "tokens_per_second": rec.tokens / period,
            "samples_per_second": rec.trajectories / period,
            "staleness_mean": sum(rec.staleness) / max(1, len(rec.staleness)),
            "staleness_max": max(rec.staleness, default=0),
            "wait_seconds": rec.train_start - rec.start,
            "stall_seconds": rec.stall,
            "replica_versions": replicas,
            **rec.metrics,
        }

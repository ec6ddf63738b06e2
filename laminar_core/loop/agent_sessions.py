"""Agent episodes as the rollout manager's rollouts: ``AgentRollouts``.

With ``agent.entrypoint`` or ``agent.command`` set, the manager admits groups as usual (the
schedule's admission rule, ``buffer.max_ahead_batches``, reissued prompts first), but a
group is ``samples_per_prompt`` *sessions* of the run's gateway instead of generate calls:
each session runs the agent once on the prompt's row (``gateway.runners``), and its model
calls are placed on replicas by ``ManagerTurnBackend``. At most ``max_sessions`` sessions
run at once; a group is admitted only when all of its sessions fit.

Exactly once. Sample ``j`` of a group is one *episode*: it is written to the experience
buffer exactly once, as the session's samples or as one failed trajectory, never both and
never twice:

* the agent returned (a reward, or ``None``: ``reward_fn`` scores the session's final
  answer, the last call's completion of its last sample) and made at least one call: the
  session is closed and its samples are written, each with the episode's reward. Samples
  after the first (forks: the agent rewrote its history) raise the group's expected count
  (``forks: train``), or only the last sample is written (``forks: last``);
* the agent crashed, ran past its wall clock (it is cancelled; a command's process group is
  killed) or made no call: its session is closed (its key is refused from then on, a call
  still running is not recorded) and nothing of it is written; the episode runs again on
  the same row in a new session, up to ``max_attempts`` runs in all; after the last, one
  trajectory with ``finish_reason`` ``failed`` and the error is written, so the group
  completes and the step's metrics (and ``run.max_failed_steps``) see it.

Every written trajectory's ``metadata["agent"]`` says how its episode went (``attempts``,
the ``failures`` before it with their kind and message, ``session``, ``samples``), which
``run.dump_rollouts`` writes to ``rollouts.jsonl``. If the run stops, running episodes
are cancelled (their groups were not complete: a resumed run hands those prompts out again).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from laminar_core.buffers import ExperienceBuffer, PromptGroup
from laminar_core.gateway import Gateway, GatewayServer, SessionBudget
from laminar_core.gateway.runners import AgentFailed, AgentRunner
from laminar_core.loop.placement import RewardFn
from laminar_core.loop.tasks import ManagerTasks
from laminar_core.telemetry import EventLog
from laminar_core.telemetry.events import TrajectoryDone
from laminar_core.types import FinishReason, Trajectory

log = logging.getLogger(__name__)

__all__ = ["AgentOptions", "AgentRollouts"]


@dataclass
class AgentOptions:
    """``agent.*`` as the manager uses them (``config.schema.AgentConfig``)."""

    max_sessions: int = 64
    timeout_s: float = 300.0
    max_attempts: int = 2
    forks: str = "train"  # train | last
    budget: SessionBudget | None = None  # per session; max_wall_s is timeout_s


class AgentRollouts:
    """Runs a run's agent episodes (module docstring). ``start`` serves the gateway on
    ``host:port``; ``stop`` cancels what runs and stops the server."""

    def __init__(
        self,
        gateway: Gateway,
        runner: AgentRunner,
        options: AgentOptions,
        buffer: ExperienceBuffer,
        tasks: ManagerTasks,
        events: EventLog,
        reward_fn: RewardFn | None = None,
        on_done: Callable[[], None] = lambda: None,
        version: Callable[[], int] = lambda: 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.gateway = gateway
        self.runner = runner
        self.opt = options
        self.buffer = buffer
        self.tasks = tasks
        self.events = events
        self.reward_fn = reward_fn
        self.on_done = on_done  # a session ended: room for more (the manager dispatches)
        self.version = version  # the newest version the replicas hold (a failed episode's)
        self.server = GatewayServer(gateway, host=host, port=port)
        self.base_url = ""
        self.running = 0  # sessions of admitted groups not yet written
        self.written = 0  # trajectories written (samples and failed episodes)
        self.failed = 0  # episodes written as failed after max_attempts
        self.retried = 0  # agent runs that failed and were run again
        self.forks = 0  # samples after a session's first
        self.first_trajectory_at: float | None = None

    async def start(self) -> str:
        self.base_url = await self.server.start()
        log.warning("agent gateway serving at %s", self.base_url)
        return self.base_url

    async def stop(self) -> None:
        await self.server.stop()

    def has_room(self, sessions: int) -> bool:
        return self.running + sessions <= self.opt.max_sessions

    def admit(self, group: PromptGroup, tag: int) -> None:
        """Start the group's sessions (``group.samples`` episodes of the prompt's row)."""
        self.buffer.expect(group.group_id, group.index, group.samples, batch_tag=tag)
        base_key = group.index * group.samples
        for j in range(group.samples):
            row = {
                **group.prompt.metadata,  # first: a dataset column must not replace the loop's keys
                "sample_key": base_key + j,
                "prompt_index": group.index,
                "batch_tag": tag,
            }
            self.running += 1
            self.tasks.spawn(self._episode(group.group_id, f"{group.group_id}-{j}", row))

    async def evaluate(
        self, rows: list[dict[str, Any]], version: int
    ) -> tuple[list[float], int, list[int]]:
        """An eval round: one episode per row (one run each, at most ``max_sessions`` at
        once), every call on a replica holding exactly ``version``; nothing is written to
        the buffer. Returns the scores, the episodes that failed (crashed, timed out, no
        call, unscored) and each scored episode's completion tokens."""
        gate = asyncio.Semaphore(self.opt.max_sessions)
        group = f"eval{version}"

        async def one(i: int, row: dict[str, Any]) -> tuple[float | None, int]:
            async with gate:
                meta = {**row, "sample_key": -(i + 1), "eval": True, "eval_version": version}
                outcome = await self._attempt(group, meta)
            if isinstance(outcome, AgentFailed):
                log.warning("eval episode %d: %s: %s", i, outcome.kind, outcome)
                return None, 0
            _, reward, samples = outcome
            last = max(samples, key=lambda t: (t.finish_time, t.traj_id))
            if reward is None:
                reward, error = await self._score(last)
                if error is not None:
                    log.warning("eval episode %d: %s", i, error)
            return reward, last.metadata["gateway"]["calls"][-1]["completion_tokens"]

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
        scores = [r for r, _ in results if r is not None]
        tokens = [n for r, n in results if r is not None]
        return scores, len(results) - len(scores), tokens

    # -- one episode ---------------------------------------------------------------------------
    async def _episode(self, group_id: str, episode_id: str, row: dict[str, Any]) -> None:
        failures: list[dict[str, Any]] = []
        try:
            for attempt in range(1, self.opt.max_attempts + 1):
                outcome = await self._attempt(group_id, row)
                if isinstance(outcome, AgentFailed):
                    why = {"attempt": attempt, "kind": outcome.kind, "error": str(outcome)}
                    failures.append(why)
                    log.warning(
                        "agent episode %s, run %d of %d: %s: %s",
                        episode_id,
                        attempt,
                        self.opt.max_attempts,
                        outcome.kind,
                        outcome,
                    )
                    if attempt < self.opt.max_attempts:
                        self.retried += 1
                    continue
                session_id, reward, samples = outcome
                await self._deliver(episode_id, session_id, reward, samples, attempt, failures)
                return
            self._deliver_failed(group_id, episode_id, row, failures)
        finally:
            self.running -= 1
            self.on_done()

    async def _attempt(
        self, group_id: str, row: dict[str, Any]
    ) -> AgentFailed | tuple[str, float | None, list[Trajectory]]:
        """Run the agent once in a new session; the session is closed however it ends."""
        budget = self.opt.budget or self.gateway.settings.budget
        budget = SessionBudget(**{**budget.__dict__, "max_wall_s": self.opt.timeout_s})
        handle = self.gateway.open_session(group_id, metadata=row, budget=budget)
        try:
            reward = await self.runner.run(handle.base_url, handle.api_key, row, self.opt.timeout_s)
        except AgentFailed as e:
            await self.gateway.close_session(handle.session_id)
            return e
        except BaseException:
            await asyncio.shield(self.gateway.close_session(handle.session_id))
            raise
        samples = await self.gateway.close_session(handle.session_id)
        if not samples:
            return AgentFailed("no_calls", "the agent returned without calling the model")
        return handle.session_id, reward, samples

    async def _deliver(
        self,
        episode_id: str,
        session_id: str,
        reward: float | None,
        samples: list[Trajectory],
        attempts: int,
        failures: list[dict[str, Any]],
    ) -> None:
        last = max(samples, key=lambda t: (t.finish_time, t.traj_id))
        error = None
        if reward is None:
            reward, error = await self._score(last)
        if self.opt.forks == "last":
            samples = [last]
        else:
            samples = sorted(samples, key=lambda t: t.metadata["gateway"]["sample"])
        self.forks += len(samples) - 1
        if len(samples) > 1:
            self.buffer.expect_more(samples[0].group_id, len(samples) - 1)
        for k, t in enumerate(samples):
            t.traj_id = episode_id if k == 0 else f"{episode_id}.{k}"
            t.reward = reward
            if error is not None:
                t.finish_reason, t.error = FinishReason.FAILED, error
            t.metadata["agent"] = {
                "session": session_id,
                "attempts": attempts,
                "failures": list(failures),
                "samples": len(samples),
            }
            self._write(t)

    def _deliver_failed(
        self, group_id: str, episode_id: str, row: dict[str, Any], failures: list[dict[str, Any]]
    ) -> None:
        self.failed += 1
        last = failures[-1] if failures else {"kind": "?", "error": "?"}
        traj = Trajectory(
            episode_id,
            group_id,
            self.version(),
            finish_reason=FinishReason.FAILED,
            error=f"agent: {last['kind']}: {last['error']} ({len(failures)} run(s))",
            metadata={
                **row,
                "agent": {"attempts": len(failures), "failures": list(failures), "samples": 0},
            },
        )
        now = self.tasks.now()
        traj.start_time = traj.finish_time = now
        self._write(traj)

    async def _score(self, last: Trajectory) -> tuple[float | None, str | None]:
        """``reward_fn`` on the session's final answer: the last call's completion."""
        if self.reward_fn is None:
            return None, "agent: the agent returned no reward and the run has no reward.fn"
        calls = last.metadata["gateway"]["calls"]
        n = calls[-1]["completion_tokens"] if calls else 0
        final = Trajectory(
            last.traj_id,
            last.group_id,
            last.version,
            prompt_ids=[*last.prompt_ids, *last.response_ids[: len(last.response_ids) - n]],
            response_ids=last.response_ids[len(last.response_ids) - n :],
            num_prompt_tokens=last.num_prompt_tokens,
            num_response_tokens=n,
            finish_reason=last.finish_reason,
            metadata=last.metadata,
        )
        try:
            reward = self.reward_fn(final)
            if inspect.isawaitable(reward):
                reward = await reward
            return float(reward), None
        except Exception as e:
            return None, f"reward: {type(e).__name__}: {e}"

    def _write(self, traj: Trajectory) -> None:
        self.events.record(
            TrajectoryDone(
                t=self.tasks.now(),
                actor=traj.replicas[-1] if traj.replicas else "agent",
                duration=max(0.0, traj.finish_time - traj.start_time),
                id=traj.traj_id,
                version=traj.version,
                versions=traj.versions or [traj.version],
                tokens=traj.num_response_tokens,
            )
        )
        self.buffer.write(traj)
        self.written += 1
        if self.first_trajectory_at is None:
            self.first_trajectory_at = self.tasks.now()

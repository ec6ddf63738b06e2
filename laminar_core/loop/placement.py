"""Placement: which replica a trajectory's next ``generate`` runs on, and what its end does.

Every generate call of the rollout manager goes through here. A trajectory (an ``InFlight``
of the partial-response pool) is *launched* on a replica, which bumps its ``attempt``: only
the current attempt's result counts, so a trajectory is written to the experience buffer
exactly once however often it was moved or redirected. When the call returns, the turn is
over: a multi-turn trajectory's next turn is *placed* (``place_turn``, by
:func:`choose_call_replica`: the newest open version with room, then the replica that ran
the last turn, where its prefix is cached, then the least loaded), and a finished
trajectory is scored and written to the buffer. A trajectory whose
replica failed is *redirected* (``redirect``): resumed from its partial response on a live
replica of the version that generated it, else restarted from its prompt as an *orphan*,
which dispatch places on the least-loaded open replica before any new group.

An agent gateway places its sessions' calls by the same rule: ``ManagerTurnBackend`` and
``place_turn`` (which the simulator's ``sim_agent`` workload runs through) both call
:func:`choose_call_replica`, so a simulated agent run places its calls as a real one does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

from laminar_core.buffers import ExperienceBuffer, InFlight, PartialPool
from laminar_core.interfaces import ReplicaFailure
from laminar_core.loop.dispatch import load
from laminar_core.loop.episodes import EpisodeRestart, Episodes
from laminar_core.loop.supervisor import ReplicaSlot, ReplicaSupervisor
from laminar_core.loop.tasks import ManagerTasks
from laminar_core.loop.teacher import TeacherPool
from laminar_core.telemetry import EventLog
from laminar_core.telemetry.events import TrajectoryDone
from laminar_core.types import FinishReason, GenerationRequest, PartialTrajectory, Trajectory

log = logging.getLogger(__name__)

# A reward is a plain or async callable; async rewards (thread-offloaded, timed out) keep the
# manager's event loop free while they run.
RewardFn = Callable[[Trajectory], "float | Awaitable[float]"]


def choose_call_replica(
    candidates: Iterable[ReplicaSlot],
    limit: int,
    home: str | None = None,
    min_version: int | None = None,
    version: int | None = None,
) -> ReplicaSlot | None:
    """The replica for a session's (or a multi-turn trajectory's) next call, or None.

    Among ``candidates`` (the OPEN replicas) with room (fewer than ``limit`` calls in flight)
    that hold at least ``min_version`` (exactly ``version``, when given): the newest version
    (what it samples is the least stale, and an older replica with a newer one open is about
    to drain and pull anyway), then ``home`` (the replica of the session's last call: its KV
    cache may hold the session's prefix, so the call re-prefills only its new tokens), then
    the fewest calls in flight, then the one that opened first. Pure: the gateway's
    ``ManagerTurnBackend`` and the loop's ``place_turn`` (the simulator's agent workload)
    both place by it.
    """
    best, best_key = None, None
    for i, s in enumerate(candidates):
        n = len(s.inflight)
        if n >= limit or (min_version is not None and s.version < min_version):
            continue
        if version is not None and s.version != version:
            continue
        key = (s.version, s.replica_id == home, -n, -i)
        if best_key is None or key > best_key:
            best, best_key = s, key
    return best


class Placement:
    """Launches, finishes, places and redirects trajectories (module docstring).

    ``kick`` asks the manager to dispatch (room was freed, orphans wait); ``fail`` reports a
    replica whose engine raised ``ReplicaFailure``.
    """

    def __init__(
        self,
        supervisor: ReplicaSupervisor,
        pool: PartialPool,
        buffer: ExperienceBuffer,
        tasks: ManagerTasks,
        events: EventLog,
        max_concurrent: int,
        kick: Callable[[], None],
        fail: Callable[[ReplicaSlot, str], None],
        reward_fn: RewardFn | None = None,
        episodes: Episodes | None = None,
        teacher: TeacherPool | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.pool = pool
        self.buffer = buffer
        self.tasks = tasks
        self.events = events
        self.max_concurrent = max_concurrent
        self.kick = kick
        self.fail = fail
        self.reward_fn = reward_fn
        self.episodes = episodes  # multi-turn: the environment's episodes (None: single-turn)
        self.teacher = teacher  # on-policy distillation: scores each finished trajectory
        # need a replica of any version: from scratch (None), or a multi-turn trajectory's
        # next turn whose own replica is not taking work
        self.orphans: deque[tuple[InFlight, PartialTrajectory | None]] = deque()
        self.redirected = 0  # resumed on another replica of their version
        self.restarted = 0  # started over from their prompt
        self.discarded = 0  # results of superseded attempts (moved, redirected) ignored
        self.first_trajectory_at: float | None = None  # loop time the first one finished
        self.finished = asyncio.Event()  # set whenever a trajectory finished
        # set on every dispatch of the manager (a call or trajectory ended, a replica opened,
        # pulled, failed or came back): agent calls waiting for a replica look again
        self.changed = asyncio.Event()

    # -- choosing and launching ------------------------------------------------------------------
    def least_loaded(
        self, need: int, min_version: int = -(1 << 62), version: int | None = None
    ) -> ReplicaSlot | None:
        """The open replica with the fewest trajectories in flight that has room for ``need``
        more and holds at least ``min_version`` (exactly ``version``, if given; ties: the one
        that opened first). Used for orphans; groups go through the schedule's dispatch
        policy."""
        best, best_load, limit = None, 1 << 62, self.max_concurrent - need
        for s in self.supervisor.open.values():
            n = load(s)
            ok = n < best_load and n <= limit and s.version >= min_version
            if ok and (version is None or s.version == version):
                best, best_load = s, n
        return best

    def place_orphans(self) -> bool:
        """Launch waiting orphans: a turn by :func:`choose_call_replica` (its last replica
        as home), a trajectory from scratch on the least-loaded open replica; False if some
        are left (no open replica has room)."""
        while self.orphans:
            item, resume = self.orphans[0]
            if resume is None:
                slot = self.least_loaded(1)
            else:
                opened = self.supervisor.open.values()
                slot = choose_call_replica(opened, self.max_concurrent, item.replica)
            if slot is None:
                return False
            self.orphans.popleft()
            if resume is None:
                item.version = slot.version
            self.launch(slot, item, resume)
        return True

    def launch(self, slot: ReplicaSlot, item: InFlight, resume: PartialTrajectory | None) -> None:
        """Run ``item`` on ``slot`` from its prompt (``resume`` None) or from ``resume``."""
        item.attempt += 1
        item.replica = slot.replica_id
        item.replicas = (*item.replicas, slot.replica_id)
        item.partial = resume
        req = item.request if resume is None else dataclasses.replace(item.request, resume=resume)
        slot.inflight.add(req.traj_id)
        self.tasks.spawn(self._run(slot, req, item.attempt, slot.incarnation))

    def place_turn(self, item: InFlight, resume: PartialTrajectory, prefer: ReplicaSlot) -> None:
        """A trajectory's next turn: on the replica :func:`choose_call_replica` picks with
        ``prefer`` (the last turn's) as home, else, none having room, as soon as one has."""
        opened = self.supervisor.open.values()
        slot = choose_call_replica(opened, self.max_concurrent, prefer.replica_id)
        if slot is not None:
            self.launch(slot, item, resume)
        else:
            self.orphans.append((item, resume))
            self.kick()

    def redirect(self, item: InFlight, partial: PartialTrajectory | None) -> None:
        """Resume ``item`` from ``partial`` on a live replica of the same version, else
        restart it from its prompt on whichever replica frees up first."""
        version = partial.version if partial is not None else item.version
        if partial is None:
            partial = PartialTrajectory(item.request.traj_id, version, versions=[version])
        same = [
            s for s in self.supervisor.slots if s.alive and not s.updating and s.version == version
        ]
        if same:
            target = min(same, key=lambda s: (len(s.inflight), s.index))
            self.redirected += 1
            self.launch(target, item, partial)
        else:
            self.restarted += 1
            item.partial = None
            self.restart_episode(item)
            self.orphans.append((item, None))

    def redirect_all(self, slot: ReplicaSlot) -> None:
        """``slot`` failed: redirect everything it had in flight."""
        ids = sorted(slot.inflight)
        slot.inflight.clear()
        for tid in ids:
            item = self.pool.get(tid)
            if item is not None:
                self.redirect(item, item.partial)

    def restart_episode(self, item: InFlight) -> None:
        """``item`` starts over from its prompt: its episode ends (a new one at its first
        turn)."""
        if item.episode is not None and self.episodes is not None:
            self.tasks.spawn(self.episodes.forget(item.episode))
        item.episode = None

    # -- a turn ends ---------------------------------------------------------------------------
    async def _run(
        self, slot: ReplicaSlot, req: GenerationRequest, attempt: int, incarnation: int
    ) -> None:
        tid = req.traj_id
        try:
            traj = await slot.engine.generate(req)
        except ReplicaFailure as e:
            if slot.incarnation == incarnation:  # not the engine a restart replaced
                self.fail(slot, str(e))
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an engine error fails this trajectory, not the run
            item = self.pool.get(tid)
            if item is None or item.attempt != attempt:
                return
            traj = Trajectory(
                tid,
                req.group_id,
                slot.version,
                prompt_ids=req.prompt_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                finish_reason=FinishReason.FAILED,
                error=f"engine {slot.replica_id}: {type(e).__name__}: {e}",
            )
        item = self.pool.get(tid)
        if item is None or item.attempt != attempt:
            self.discarded += 1  # superseded by a move or a redirect: the new attempt counts
            return
        if traj.finish_reason is FinishReason.ABORTED:
            return  # whoever aborted it (repack, partial rollout) resumes it
        multi_turn = self.episodes is not None and traj.finish_reason is not FinishReason.FAILED
        if multi_turn and await self._next_turn(slot, item, traj):
            return
        self.pool.pop(tid)
        slot.inflight.discard(tid)
        if item.episode is not None:  # failed mid-episode: end the episode too
            self.restart_episode(item)
        traj.replicas = list(item.replicas)
        await self._score(traj)
        self.events.record(
            TrajectoryDone(
                t=traj.finish_time,
                actor=slot.replica_id,
                duration=traj.finish_time - traj.start_time,
                id=tid,
                version=traj.version,
                versions=traj.versions or [traj.version],
                tokens=traj.num_response_tokens,
            )
        )
        self.buffer.write(traj)
        if self.first_trajectory_at is None:
            self.first_trajectory_at = self.tasks.now()
        self.finished.set()
        if not slot.inflight:
            slot.wake.set()
        self.kick()

    async def _score(self, traj: Trajectory) -> None:
        """The reward and, with a teacher, the teacher's log-probs, at once (both wait on
        other workers: reward threads, teacher replicas). A reward or a teacher score that
        raises fails the trajectory, not the run. Without a reward, a trajectory the teacher
        scored gets reward 0 (reward-free distillation: its tokens' advantages are the
        distillation term alone)."""
        if self.teacher is None or traj.finish_reason is FinishReason.FAILED:
            await self._reward(traj)
            return
        _, err = await asyncio.gather(self._reward(traj), self._teacher_score(traj))
        if err is not None and traj.finish_reason is not FinishReason.FAILED:
            traj.finish_reason = FinishReason.FAILED
            traj.error = err
        elif traj.reward is None and self.reward_fn is None and "env_reward" not in traj.metadata:
            traj.reward = 0.0

    async def _teacher_score(self, traj: Trajectory) -> str | None:
        assert self.teacher is not None
        try:
            await self.teacher.score(traj)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return f"teacher: {type(e).__name__}: {e}"
        return None

    async def _reward(self, traj: Trajectory) -> None:
        """The environment's reward if it scored the episode, else the run's reward; a reward
        that raises fails the trajectory, not the run."""
        env_reward = traj.metadata.get("env_reward")
        if env_reward is not None:
            traj.reward = float(env_reward)
        elif self.reward_fn is not None and traj.finish_reason is not FinishReason.FAILED:
            try:
                reward = self.reward_fn(traj)
                if inspect.isawaitable(reward):
                    reward = await reward
                traj.reward = float(reward)
            except Exception as e:
                traj.finish_reason = FinishReason.FAILED
                traj.error = f"reward: {type(e).__name__}: {e}"

    async def _next_turn(self, slot: ReplicaSlot, item: InFlight, traj: Trajectory) -> bool:
        """A model turn ended: the trajectory leaves the replica while its tool runs, then
        its next turn is placed (``loop.episodes``). False: it is done."""
        assert self.episodes is not None
        tid = traj.traj_id
        slot.inflight.discard(tid)  # no batch slot held while the tool runs
        if not slot.inflight:
            slot.wake.set()  # the replica may load a newer version meanwhile
        slot.tooling.add(tid)
        try:
            item.episode, resume = await self.episodes.after_turn(
                item.episode, dict(item.request.metadata), traj
            )
        except EpisodeRestart as e:
            slot.tooling.discard(tid)
            log.warning("trajectory %s starts over: %s", tid, e)
            self.restarted += 1
            self.restart_episode(item)
            self.orphans.append((item, None))
            self.kick()
            return True
        slot.tooling.discard(tid)
        if resume is None:
            item.episode = None  # done: the episode ended with it
            return False
        self.place_turn(item, resume, prefer=slot)
        return True

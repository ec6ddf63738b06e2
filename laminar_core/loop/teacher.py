"""The teacher pool of on-policy distillation: teacher replicas that score finished
trajectories token by token (``algorithm.teacher``; ``RolloutEngine.score``).

A trajectory is scored as soon as it finishes, in its own task, while the replicas go on
generating the rest (``loop.placement`` awaits the score beside the reward before writing the
trajectory to the experience buffer): the trainer takes trajectories whose scores are ready,
and waits for scoring only when the last trajectories of a step are still being scored.
Each score goes to the teacher with the fewest scores in flight; a teacher that fails
(``ReplicaFailure``) is left out and the trajectory is scored on another; when none is left,
the trajectory fails (the run's failed-step bound stops a run that cannot train).
"""

from __future__ import annotations

import asyncio
import logging

from laminar_core.interfaces import ReplicaFailure, RolloutEngine
from laminar_core.types import Trajectory

log = logging.getLogger(__name__)

__all__ = ["TeacherPool", "teacher_metrics"]

#: ``Trajectory.metadata`` key: the seconds its teacher score took (finished -> scored)
SCORE_SECONDS = "teacher_score_s"


def teacher_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """A step's scoring figures: ``teacher_score_s_mean`` / ``_max`` (seconds from a
    trajectory's end to its teacher score, which its write to the buffer waits for) and
    ``teacher_tokens`` (response tokens scored); empty without a teacher."""
    secs = [t.metadata[SCORE_SECONDS] for t in trajs if SCORE_SECONDS in t.metadata]
    if not secs:
        return {}
    return {
        "teacher_score_s_mean": sum(secs) / len(secs),
        "teacher_score_s_max": max(secs),
        "teacher_tokens": float(sum(len(t.teacher_logprobs) for t in trajs)),
    }


class TeacherPool:
    """Teacher replicas (``RolloutEngine`` with ``scores_tokens``), started and stopped with
    the rollout replicas (``RolloutManager.start`` / ``stop``)."""

    def __init__(self, engines: list[RolloutEngine]) -> None:
        if not engines:
            raise ValueError("a teacher pool needs at least one teacher replica")
        self.engines = list(engines)
        self.load = [0] * len(self.engines)
        self.alive = [True] * len(self.engines)

    async def start(self) -> None:
        await asyncio.gather(*(e.start() for e in self.engines))

    async def stop(self) -> None:
        await asyncio.gather(
            *(e.stop() for e, ok in zip(self.engines, self.alive, strict=True) if ok),
            return_exceptions=True,
        )

    def _pick(self) -> int | None:
        live = [i for i, ok in enumerate(self.alive) if ok]
        return min(live, key=lambda i: (self.load[i], i)) if live else None

    async def score(self, traj: Trajectory) -> None:
        """Fill ``traj.teacher_logprobs`` (one per response token).

        Raises:
            RuntimeError: every teacher replica failed, or a teacher's answer has the wrong
                length (the caller fails the trajectory).
        """
        if not traj.response_ids:
            traj.teacher_logprobs = []
            return
        clock = asyncio.get_running_loop()  # the loop's clock: virtual in the simulator
        t0 = clock.time()
        while True:
            i = self._pick()
            if i is None:
                raise RuntimeError("every teacher replica failed (algorithm.teacher)")
            self.load[i] += 1
            try:
                got = await self.engines[i].score(list(traj.prompt_ids), list(traj.response_ids))
            except ReplicaFailure as e:
                if self.alive[i]:
                    self.alive[i] = False
                    log.warning("teacher %s failed, scoring on the others: %s", i, e)
                continue
            finally:
                self.load[i] -= 1
            break
        if len(got) != len(traj.response_ids):
            raise RuntimeError(
                f"teacher {self.engines[i].replica_id} returned {len(got)} log-probs for "
                f"{len(traj.response_ids)} response tokens"
            )
        traj.teacher_logprobs = [float(x) for x in got]
        traj.metadata[SCORE_SECONDS] = clock.time() - t0

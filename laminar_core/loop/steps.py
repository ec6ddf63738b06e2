"""A trainer step's record and its row of ``metrics.jsonl``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laminar_core.types import FinishReason, Trajectory


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
    rollout: dict[str, float] = field(default_factory=dict)  # e.g. tool calls (multi-turn)
    eval_reward: float | None = None  # the eval round after this step, if one ran
    eval_seconds: float = 0.0  # its wall time (not loop time: see ``Controller._evaluate``)


def tool_metrics(trajs: list[Any]) -> dict[str, float]:
    """Per-step figures of multi-turn trajectories (``metadata["env"]``): tool calls and
    turns per trajectory, tool latency p50 / p99 (s), tool errors and timeouts."""
    envs = [t.metadata["env"] for t in trajs if "env" in t.metadata]
    if not envs:
        return {}
    lat = sorted(x for e in envs for x in e.get("tool_seconds", []))

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

    errors = [e.get("errors", {}) for e in envs]
    return {
        "tool_calls_mean": sum(e.get("tool_calls", 0) for e in envs) / len(envs),
        "turns_mean": sum(e.get("turns", 0) for e in envs) / len(envs),
        "tool_latency_p50": pct(0.5),
        "tool_latency_p99": pct(0.99),
        "tool_errors": float(sum(sum(v.values()) for v in errors)),
        "tool_timeouts": float(sum(v.get("timeout", 0) + v.get("no_answer", 0) for v in errors)),
    }


def metrics_row(
    rec: StepRecord,
    prev_end: float,
    wall_seconds: float,
    replica_versions: dict[str, int],
    counters: dict[str, int],
) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of step ``rec``: rates over the time since the previous
    step ended (``prev_end``), the loop's ``counters`` (replicas alive, restarts, groups
    dropped), then the rollout's and the trainer's own figures."""
    period = max(rec.end - prev_end, 1e-12)
    return {
        "step": rec.step,
        "weight_version": rec.version,
        "wall_seconds": wall_seconds,
        "reward_mean": rec.reward_mean,
        "trajectories": rec.trajectories,
        "tokens": rec.tokens,
        "tokens_per_second": rec.tokens / period,
        "samples_per_second": rec.trajectories / period,
        "staleness_mean": sum(rec.staleness) / max(1, len(rec.staleness)),
        "staleness_max": max(rec.staleness, default=0),
        "wait_seconds": rec.train_start - rec.start,
        "stall_seconds": rec.stall,
        "replica_versions": replica_versions,
        **counters,
        **rec.rollout,
        **rec.metrics,
    }


class FailedSteps:
    """Stops a run in which nothing trains: once every trajectory of ``max_failed_steps``
    consecutive steps failed (rewards raising, engines erroring), :meth:`check` raises a
    ``RuntimeError`` naming the first error, instead of "training" on nothing until the end."""

    def __init__(self, max_failed_steps: int) -> None:
        self.max_failed_steps = max_failed_steps  # 0: never
        self._steps: list[list[Trajectory]] = []  # trailing steps whose every one failed

    def check(self, trajs: list[Trajectory]) -> None:
        """Count the trailing steps whose every trajectory failed; raise at the limit."""
        if not trajs or any(t.finish_reason is not FinishReason.FAILED for t in trajs):
            self._steps.clear()
            return
        self._steps.append(trajs)
        n = self.max_failed_steps
        if n <= 0 or len(self._steps) < n:
            return
        failed = [t for step in self._steps for t in step]
        errors = [t.error or "no error recorded" for t in failed]
        first = errors[0]
        others = len(set(errors)) - 1
        msg = (
            f"every trajectory of the last {n} steps failed ({len(failed)} trajectories), so "
            f"nothing trains; the first error: {first}"
        )
        if others:
            msg += f" ({others} other distinct error(s))"
        if first.startswith("reward:"):
            msg += (
                ". When every reward fails, check that the rollout engine copies "
                "request.metadata into Trajectory.metadata (rewards read the prompt's row "
                "from it; laminar_core.testing.check_rollout_engine checks it)"
            )
        raise RuntimeError(f"{msg}. run.max_failed_steps={n} sets this limit (0: never)")

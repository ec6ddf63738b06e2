"""``rollouts.jsonl``: every trajectory the trainer learned from, one JSON line each (and,
with dynamic sampling, every trajectory of a dropped group, marked ``"filtered": true``).

Written by the controller after each step that trained (``run.dump_rollouts``), in batch
order: what a user reads to see what the policy produced and was rewarded for, and what a
replay needs to retake the run's updates offline (ids, behaviour log-probs, rewards, groups).
Lines are formatted and written on a worker thread of their own: a batch of thousands of
long trajectories takes seconds to serialise, and the controller's event loop also runs
the rollout manager.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROLLOUTS_FILE = "rollouts.jsonl"


class RolloutDump:
    """Appends one line per trajectory of each trained batch to ``path``, in ``write`` order
    (one writer thread); ``close`` returns once every batch is on disk."""

    def __init__(self, path: str | Path) -> None:
        self._f = open(path, "a")  # noqa: SIM115 - lives as long as the run
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="rollout-dump")
        self._pending: list[Future] = []

    def write(
        self, step: int, weight_version: int, groups: list[Any], trained: bool = True
    ) -> None:
        """Queue a trained batch. ``groups``: its ``Group``s (not changed afterwards);
        ``weight_version``: the version the step published (the trajectories were generated
        by older ones: ``versions``). ``trained=False``: groups dynamic sampling dropped
        before that step (their lines say ``"filtered": true``: sampled, never trained). A
        failed write surfaces here, at the next call."""
        for done in [f for f in self._pending if f.done()]:
            self._pending.remove(done)
            done.result()  # a disk error stops the run instead of losing lines silently
        self._pending.append(
            self._writer.submit(self._write, step, weight_version, groups, trained)
        )

    def _write(self, step: int, weight_version: int, groups: list[Any], trained: bool) -> None:
        for g in groups:
            for t in g.trajectories:
                row = {
                    "step": step,
                    "weight_version": weight_version,
                    "group_id": g.group_id,
                    "prompt_index": g.prompt_index,
                    "traj_id": t.traj_id,
                    "versions": list(t.versions) or [t.version],
                    "finish_reason": t.finish_reason.value,
                    "reward": t.reward,
                    "prompt_ids": list(t.prompt_ids),
                    "response_ids": list(t.response_ids),
                    "logprobs": [round(x, 7) for x in t.logprobs],
                }
                if t.loss_mask:
                    row["loss_mask"] = list(t.loss_mask)
                if not trained:
                    row["filtered"] = True
                meta = {k: v for k, v in t.metadata.items() if _plain(v)}
                if meta:
                    row["metadata"] = meta
                self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        if not self._f.closed:
            self._f.close()
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()


def _plain(v: Any) -> bool:
    """JSON-safe values only (scalars, and lists and string-keyed dicts of them, such as an
    agent episode's record): metadata can carry arbitrary task objects."""
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain(x) for k, x in v.items())
    return isinstance(v, (str, int, float, bool)) or v is None

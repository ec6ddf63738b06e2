"""``repeat``: the procedural task that ships with Laminar (the quickstart's task).

Prompt ``"c*13="``, target response ``"ccccccccccccc"`` then end-of-sequence. The repeat count
is drawn from a clipped lognormal, so target response lengths are long-tailed (p99/p50 ~ 8 by
default): a few prompts ask for many more tokens than most, which is the shape of real
reasoning workloads and what trajectory-level asynchrony is for.

Why this task: a randomly initialised character-level model samples the prompt's letter now
and then, so the shaped reward (:func:`repeat_reward`) has signal from the first step and
rises within a few dozen GRPO steps on a laptop CPU; getting the count right (stopping at the
right time) takes longer, so the curve keeps rising instead of saturating at once.

Rows are a pure function of ``(seed, index)``: the same options give the same dataset.

Held-out prompts: ``holdout`` reserves that share of the ``(letter, count)`` pairs for
evaluation, chosen by a hash of the pair alone (so every seed agrees on it). ``split="train"``
rows never use a reserved pair and ``split="eval"`` rows only use reserved pairs (a row
redraws until it fits its split), so a model evaluated on the eval split is tested on
prompts it was never trained on -- counts it must generalise to, not recall.
"""

from __future__ import annotations

import hashlib
import math
import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RepeatOptions:
    """``data.task_options`` of the ``repeat`` task.

    ``median_count`` / ``p99_over_p50`` shape the lognormal of the repeat count, clipped to
    ``[min_count, max_count]``; ``letters`` are the characters to repeat.
    """

    seed: int = 0
    size: int = 10_000
    letters: str = "abc"
    min_count: int = 1
    max_count: int = 48
    median_count: float = 6.0
    p99_over_p50: float = 8.0
    holdout: float = 0.0  # share of (letter, count) pairs reserved for eval
    split: str = "train"  # train: never a reserved pair; eval: only reserved pairs

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1 (got {self.size})")
        if not self.letters or any(c not in string.ascii_letters for c in self.letters):
            raise ValueError(f"letters must be ASCII letters (got {self.letters!r})")
        if not 1 <= self.min_count <= self.max_count:
            raise ValueError(
                f"need 1 <= min_count <= max_count (got {self.min_count}, {self.max_count})"
            )
        if self.median_count <= 0 or self.p99_over_p50 < 1:
            raise ValueError(
                f"need median_count > 0 and p99_over_p50 >= 1 "
                f"(got {self.median_count}, {self.p99_over_p50})"
            )
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"holdout must be in [0, 1) (got {self.holdout})")
        if self.split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval' (got {self.split!r})")
        if self.split == "eval" and self.holdout == 0:
            raise ValueError("split='eval' needs holdout > 0 (the share of pairs held out)")


_MAX_REDRAWS = 100_000


def held_out(letter: str, count: int, holdout: float) -> bool:
    """Is the pair ``(letter, count)`` reserved for eval at share ``holdout``? A pure
    function of its arguments (no seed), so training and eval rows agree on it."""
    if holdout <= 0:
        return False
    h = hashlib.blake2b(f"{letter}*{count}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64 < holdout


class RepeatTask(Sequence[dict[str, Any]]):
    """A deterministic, indexable dataset of ``repeat`` rows.

    Each row: ``{"prompt": "c*13=", "answer": "ccccccccccccc", "letter": "c", "count": 13,
    "task": "repeat"}``.
    """

    name = "repeat"
    Options = RepeatOptions  # validates data.task_options before the run starts

    def __init__(self, **options: Any) -> None:
        self.options = self.Options(**options)
        # lognormal sigma such that p99 / p50 = exp(z_0.99 * sigma)
        self._sigma = math.log(self.options.p99_over_p50) / 2.3263478740408408

    def __len__(self) -> int:
        return self.options.size

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        o = self.options
        if not -o.size <= i < o.size:
            raise IndexError(i)
        i %= o.size
        rng = random.Random(o.seed * 1_000_003 + i)
        want = o.split == "eval"
        for _ in range(_MAX_REDRAWS):
            letter = rng.choice(o.letters)
            raw = o.median_count * math.exp(rng.gauss(0.0, 1.0) * self._sigma)
            count = min(o.max_count, max(o.min_count, round(raw)))
            if held_out(letter, count, o.holdout) == want:
                break
        else:
            raise ValueError(
                f"{self.name}: no {o.split} pair in {_MAX_REDRAWS} draws at holdout="
                f"{o.holdout}; raise holdout or widen letters / counts"
            )
        return repeat_row(letter, count, self.name)

    @staticmethod
    def reward(response: str, row: dict[str, Any]) -> float:
        return repeat_reward(response, row)


def repeat_row(letter: str, count: int, task: str) -> dict[str, Any]:
    """The row asking for ``letter`` repeated ``count`` times (the ``repeat`` format, shared
    by the tasks scored with :func:`repeat_reward`)."""
    return {
        "prompt": f"{letter}*{count}=",
        "answer": letter * count,
        "letter": letter,
        "count": count,
        "task": task,
    }


def repeat_reward(response: str, row: dict[str, Any]) -> float:
    """Shaped reward in ``[0, 1]``: correct characters over the longer of response and target.

    ``matches / max(len(target), len(response))`` where ``matches`` counts positions at which
    response and target agree. 1.0 exactly when the response is the target; too long a
    response is penalised as much as too short a one; partial credit exists from the start.
    """
    target = str(row["answer"])
    if not target and not response:
        return 1.0
    matches = sum(a == b for a, b in zip(response, target, strict=False))
    return matches / max(len(target), len(response))

"""``longtail``: the repeat task with a heavy-tailed count, built to stay long-tailed as a
model learns it (the real-engine benchmark's workload, ``examples/longtail.yaml``).

Prompt ``"b*64="``, target ``"bbbb...b"`` (64 times) then end-of-sequence, scored by
:func:`~laminar_core.tasks.repeat.repeat_reward`. The count is one of a few powers of two
(``counts``, default 2 to 256) drawn with decaying ``weights``: target responses run from 3
to 257 tokens, median 9, p99 257 (p99/p50 ~ 28), mean ~ 33.

Why discrete counts: with a continuous count (``repeat`` with a lognormal up to 256) a small
model first learns one length near the median, which earns ~0.4 of the reward for any
count, and its responses stop being long-tailed (measured: p99/p50 fell from 10 to 2 between
steps 30 and 120 with the 3.2M model). A handful of count classes, told apart by the
prompt's first digits, is a lookup the model learns early, so its response lengths follow the
targets' long tail through training -- the workload a trajectory-level asynchronous system
is for.

Held-out prompts (``split``): for count class ``j`` the pair ``(letters[j % len(letters)],
counts[j])`` is reserved for eval. ``split="train"`` rows never use a reserved pair (their
letter is drawn among the others), ``split="eval"`` rows only use them: every count class
and every letter is trained on, the eval asks for combinations never trained on, and both
splits have the same length distribution. Rows are a pure function of ``(seed, index)``.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from laminar_core.tasks.repeat import repeat_reward, repeat_row


@dataclass(frozen=True)
class LongTailOptions:
    """``data.task_options`` of ``longtail``."""

    seed: int = 0
    size: int = 10_000
    letters: str = "abc"
    counts: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)
    weights: tuple[float, ...] = (0.14, 0.18, 0.18, 0.17, 0.14, 0.10, 0.06, 0.03)
    split: str = "train"  # train: never a reserved (letter, count) pair; eval: only those

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple(int(c) for c in self.counts))
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if self.size < 1:
            raise ValueError(f"size must be >= 1 (got {self.size})")
        if len(self.letters) < 2 or any(c not in string.ascii_letters for c in self.letters):
            raise ValueError(f"letters must be 2+ ASCII letters (got {self.letters!r})")
        if not self.counts or len(self.counts) != len(self.weights):
            raise ValueError(
                f"counts and weights must be non-empty and as long as each other "
                f"(got {len(self.counts)} and {len(self.weights)})"
            )
        if min(self.counts) < 1 or min(self.weights) <= 0:
            raise ValueError("counts must be >= 1 and weights > 0")
        if self.split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval' (got {self.split!r})")


class LongTailTask(Sequence[dict[str, Any]]):
    """A deterministic, indexable dataset of ``longtail`` rows (see module docstring):
    ``{"prompt": "b*64=", "answer": "b" * 64, "letter": "b", "count": 64, "task":
    "longtail"}``."""

    name = "longtail"
    Options = LongTailOptions

    def __init__(self, **options: Any) -> None:
        self.options = LongTailOptions(**options)

    def __len__(self) -> int:
        return self.options.size

    def held_out_letter(self, j: int) -> str:
        """The letter reserved for eval with count class ``j``."""
        letters = self.options.letters
        return letters[j % len(letters)]

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        o = self.options
        if not -o.size <= i < o.size:
            raise IndexError(i)
        i %= o.size
        rng = random.Random(o.seed * 1_000_003 + i)
        j = rng.choices(range(len(o.counts)), weights=o.weights)[0]
        reserved = self.held_out_letter(j)
        if o.split == "eval":
            letter = reserved
        else:
            letter = rng.choice([c for c in o.letters if c != reserved])
        return repeat_row(letter, o.counts[j], self.name)

    @staticmethod
    def reward(response: str, row: dict[str, Any]) -> float:
        return repeat_reward(response, row)

"""The prompt pool: an endless, seeded, resumable stream of prompt groups."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Prompt:
    """One dataset row as the loop needs it. ``num_tokens`` is used when ``ids`` is empty."""

    ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    metadata: dict = field(default_factory=dict)


class SyntheticPrompts:
    """Prompts of uniformly random length in ``[min_tokens, max_tokens]``, no token ids.

    What the simulator feeds on; lengths are a pure function of ``(seed, index)``.
    """

    def __init__(self, size: int, min_tokens: int, max_tokens: int, seed: int = 0) -> None:
        if size < 1 or min_tokens < 1 or max_tokens < min_tokens:
            raise ValueError(
                f"synthetic prompts need size >= 1 and 1 <= min_tokens <= max_tokens "
                f"(got size={size}, min={min_tokens}, max={max_tokens})"
            )
        self._size, self._lo, self._hi, self._seed = size, min_tokens, max_tokens, seed

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: int) -> Prompt:
        rng = random.Random(self._seed * 1_000_003 + i)
        return Prompt(num_tokens=rng.randint(self._lo, self._hi))


@dataclass(slots=True)
class PromptGroup:
    """One sampled prompt and how many samples (trajectories) to draw from it."""

    index: int  # global position in the stream, across epochs
    group_id: str
    prompt: Prompt
    samples: int


class PromptPool:
    """Walks a dataset in a seeded random order, epoch after epoch.

    ``state_dict()`` / ``load_state_dict()`` capture the position so a resumed run continues
    with the very next prompt; prompts handed out but never consumed (in flight when the run
    stopped) are passed as ``pending`` and handed out again first, under the same index.

    ``reissue(indices)`` hands prompts out again within a run (their group was dropped, or its
    update was lost with a failed trainer): first, under the same prompt index and a new
    group id (``g12.1``, ``g12.2``: each trajectory id is accepted once per run).
    """

    def __init__(
        self,
        dataset: Sequence[Prompt],
        samples_per_prompt: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("the prompt dataset is empty")
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1 (got {samples_per_prompt})")
        self.dataset = dataset
        self.samples = samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0  # prompts handed out so far
        self._epoch = -1
        self._order: list[int] = []
        self._reissue: deque[int] = deque()
        self._retries: dict[int, int] = {}  # prompt index -> times handed out again in this run

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    @property
    def epoch(self) -> int:
        return self.position // len(self.dataset)

    def next_group(self) -> PromptGroup:
        if self._reissue:
            i = self._reissue.popleft()
        else:
            i = self.position
            self.position += 1
        epoch, k = divmod(i, len(self.dataset))
        row = self._order_for(epoch)[k]
        retry = self._retries.get(i, 0)
        group_id = f"g{i}.{retry}" if retry else f"g{i}"
        return PromptGroup(i, group_id, self.dataset[row], self.samples)

    def reissue(self, indices: Iterable[int]) -> None:
        """Hand ``indices`` out again, before any new prompt, under new group ids."""
        for i in indices:
            self._retries[i] = self._retries.get(i, 0) + 1
            self._reissue.append(i)

    def state_dict(self, pending: Iterable[int] = ()) -> dict:
        """The position, plus ``pending``: indices handed out whose groups were not consumed."""
        return {
            "position": self.position,
            "seed": self.seed,
            "reissue": sorted({*pending, *self._reissue}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.seed = int(state.get("seed", self.seed))
        self._reissue = deque(int(i) for i in state.get("reissue", ()))

"""Turning a ``TrainBatch`` into micro-batches: which trajectories train, mini-batches, the
split over data-parallel groups, then packed or padded rows of at most a token budget.

Every rank sees the whole batch and computes the same split, so no rank has to tell another
what it holds. Engines whose collectives run per micro-batch (FSDP) need every rank in every
forward/backward: with ``BatchLayout.lockstep`` the groups with fewer micro-batches run empty
(zero-weight) ones; otherwise (megatron syncs gradients once per optimiser step) a group with
no trajectories runs one empty micro-batch.

Two layouts, the same numbers:

- **packed**: the micro-batch is ONE row, its trajectories concatenated; position ids restart
  at 0 for each trajectory (``cu_seqlens`` mark the segments) so attention that reads them
  does not cross trajectories. A micro-batch holds up to ``token_budget`` real tokens: no
  padding is computed.
- **padded**: one right-padded row per trajectory, ``token_budget`` bounding rows x longest.

In both, column ``j`` of a row is scored against ``labels[j]``, the next token of the same
trajectory; ``spans`` say where each trajectory's response log-probs sit, and
:func:`responses` turns per-position values ``[R, L]`` into per-trajectory response values
``[k, T]`` (the shape every loss input has).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laminar_core.interfaces.trainer import to_device
from laminar_core.types import FinishReason, Trajectory

__all__ = [
    "BatchLayout",
    "MicroBatch",
    "assign_ranks",
    "collate",
    "collate_packed",
    "empty_micro_batch",
    "pack_bins",
    "pack_micro_batches",
    "padded",
    "plan_micro_batches",
    "response_mask",
    "responses",
    "split_mini_batches",
    "trainable",
]


@dataclass(frozen=True)
class BatchLayout:
    """How an engine wants its micro-batches (``ModelTrainerEngine.batch_layout``).

    ``device``: where the loss inputs and metric sums go. ``pad_id``: the token padding rows.
    ``token_budget``: per micro-batch, real tokens (packed) or rows x longest (padded).
    ``packed``: one concatenated row per micro-batch (else one padded row per trajectory);
    ``row_multiple``: a packed row's length is padded to a multiple of it (a sequence-parallel
    degree). ``dp_size`` / ``dp_rank``: the data-parallel groups the trajectories are split
    over and this rank's (ranks of one group get the same micro-batches). ``lockstep``: every
    group runs as many micro-batches (per-micro-batch collectives). ``reports``: this rank's
    figures count -- exactly one rank of each data-parallel group reports, so a sum over
    ranks counts each figure once.
    """

    device: torch.device
    pad_id: int
    token_budget: int
    packed: bool = False
    row_multiple: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    lockstep: bool = True
    reports: bool = True

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"BatchLayout.token_budget must be >= 1, got {self.token_budget}")
        if self.row_multiple < 1:
            raise ValueError(f"BatchLayout.row_multiple must be >= 1, got {self.row_multiple}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(
                f"BatchLayout.dp_rank {self.dp_rank} is not one of dp_size={self.dp_size} groups"
            )


@dataclass(eq=False)
class MicroBatch:
    """Rows of token ids, where each trajectory's response log-probs are, and (for training)
    what the loss needs for each of them.

    ``spans[k] = (row, col, n)``: trajectory ``index[k]``'s ``n`` response log-probs are
    ``logprobs[row, col : col + n]`` (``col`` is the last prompt token's column: it predicts
    the first response token). ``attention_mask`` is ``None`` for a packed row. ``cu_seqlens``
    (packed only) are the row's segment boundaries, trailing padding included.

    Loss inputs, host tensors aligned with :func:`responses` (``[k, T]``, ``T`` the longest
    response; ``None`` on forward-only micro-batches): ``loss_mask`` (1 where a token counts:
    ``Trajectory.loss_mask``), ``advantages`` (``[k]``), ``behaviour_logprobs`` (the rollout
    engine's), ``old_logprobs`` (the trainer's recomputation before the step, when the
    off-policy correction uses it), ``teacher_logprobs`` (on-policy distillation's teacher,
    ``Trajectory.teacher_logprobs``; ``advantages`` are then per token, ``[k, T]``).
    """

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    labels: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor | None  # [R, L] or None (packed)
    index: list[int]
    spans: list[tuple[int, int, int]]
    cu_seqlens: list[int] | None = None
    loss_mask: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Response tokens (the ones the loss can count)."""
        return sum(n for _, _, n in self.spans)

    @property
    def real_tokens(self) -> int:
        """Prompt + response tokens of the trajectories held (no padding)."""
        if self.attention_mask is not None:
            return int(self.attention_mask.sum())
        return self.cu_seqlens[len(self.index)] if self.cu_seqlens else 0

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    @property
    def width(self) -> int:
        """``T``: the longest response held (1 for an empty micro-batch)."""
        return max((n for _, _, n in self.spans), default=1)


def trainable(trajs: list[Trajectory]) -> list[Trajectory]:
    """Trajectories a step can learn from: not failed, with a reward, a response, a log-prob
    per response token and (when it has one) a loss mask of the response's length. The rest
    are left out of the step (``trained_trajectories`` counts the ones kept)."""
    return [
        t
        for t in trajs
        if t.finish_reason != FinishReason.FAILED
        and t.response_ids
        and len(t.logprobs) == len(t.response_ids)
        and (not t.loss_mask or len(t.loss_mask) == len(t.response_ids))
        and t.reward is not None
    ]


def split_mini_batches(n: int, mini_batches: int) -> list[list[int]]:
    """``range(n)`` in ``min(mini_batches, n)`` (at least one) contiguous chunks of
    near-equal size: one optimiser step each."""
    parts = max(1, min(mini_batches, n))
    size, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(list(range(start, end)))
        start = end
    return out


def assign_ranks(lengths: list[int], world: int) -> list[list[int]]:
    """Longest-first greedy split of sequence indices over ranks, balancing tokens."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(x) for x in out]


def pack_micro_batches(lengths: list[int], indices: list[int], budget: int) -> list[list[int]]:
    """Padded layout: group ``indices`` so each group's rows x longest stays within ``budget``.

    A single sequence longer than the budget gets a micro-batch of its own.
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        new_longest = max(longest, lengths[i])
        if cur and new_longest * (len(cur) + 1) > budget:
            groups.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        groups.append(cur)
    return groups


def pack_bins(lengths: list[int], indices: list[int], budget: int) -> list[list[int]]:
    """Packed layout: first-fit decreasing of ``indices`` into bins of ``budget`` real tokens.

    A sequence longer than the budget gets a bin of its own. Deterministic (ties by index),
    so every rank computes the same bins.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def _sequence(t: Trajectory) -> list[int]:
    return list(t.prompt_ids) + list(t.response_ids)


def collate(trajs: list[Trajectory], index: list[int], pad_id: int) -> MicroBatch:
    """Padded layout: one right-padded row per trajectory."""
    rows = [trajs[i] for i in index]
    seqs = [_sequence(t) for t in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    spans = []
    for r, (t, s) in enumerate(zip(rows, seqs, strict=True)):
        ids[r, : len(s)] = torch.tensor(s)
        attn[r, : len(s)] = 1
        spans.append((r, len(t.prompt_ids) - 1, len(t.response_ids)))
    labels = torch.full_like(ids, pad_id)
    labels[:, :-1] = ids[:, 1:]
    pos = torch.arange(width).expand(len(rows), width).contiguous()
    return MicroBatch(ids, pos, labels, attn, list(index), spans)


def collate_packed(
    trajs: list[Trajectory], index: list[int], pad_id: int, multiple: int = 1
) -> MicroBatch:
    """Packed layout: ``index``'s trajectories in one row, padded at the end to a multiple of
    ``multiple`` (the sequence-parallel degree) with a segment of its own."""
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    spans: list[tuple[int, int, int]] = []
    cu = [0]
    for i in index:
        t = trajs[i]
        s = _sequence(t)
        spans.append((0, len(ids) + len(t.prompt_ids) - 1, len(t.response_ids)))
        ids += s
        pos += range(len(s))
        labels += [*s[1:], pad_id]
        cu.append(len(ids))
    pad = -len(ids) % multiple
    if pad:
        ids += [pad_id] * pad
        pos += range(pad)
        labels += [pad_id] * pad
        cu.append(len(ids))
    as_row = lambda x: torch.tensor(x, dtype=torch.long)[None]  # noqa: E731
    return MicroBatch(as_row(ids), as_row(pos), as_row(labels), None, list(index), spans, cu)


def empty_micro_batch(pad_id: int, packed: bool = True, multiple: int = 1) -> MicroBatch:
    """A short row with nothing to learn: keeps a rank in step with the others."""
    n = max(2, multiple)
    ids = torch.full((1, n), pad_id, dtype=torch.long)
    pos = torch.arange(n)[None]
    attn = None if packed else torch.ones_like(ids)
    return MicroBatch(ids, pos, ids.clone(), attn, [], [], [0, n] if packed else None)


def plan_micro_batches(
    trajs: list[Trajectory], chunk: list[int], layout: BatchLayout
) -> list[MicroBatch]:
    """This rank's micro-batches over ``chunk`` (indices into ``trajs``): the chunk split over
    the data-parallel groups by token balance, this group's share packed into micro-batches
    of ``layout.token_budget``, then empty ones so that every group runs as many
    (``lockstep``), or one empty one for a group with nothing (otherwise)."""
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    per_group = assign_ranks([lengths[i] for i in chunk], layout.dp_size)
    group = pack_bins if layout.packed else pack_micro_batches
    plans = [group(lengths, [chunk[j] for j in mine], layout.token_budget) for mine in per_group]
    if layout.packed:
        mine = [
            collate_packed(trajs, idx, layout.pad_id, layout.row_multiple)
            for idx in plans[layout.dp_rank]
        ]
    else:
        mine = [collate(trajs, idx, layout.pad_id) for idx in plans[layout.dp_rank]]
    count = max(len(p) for p in plans) if layout.lockstep else 1
    empty = [
        empty_micro_batch(layout.pad_id, layout.packed, layout.row_multiple)
        for _ in range(count - len(mine))
    ]
    return mine + empty


def responses(values: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Per-position ``values [R, L]`` -> per-trajectory response values ``[k, T]`` (T = the
    longest response; zeros past each response's end). One gather; differentiable."""
    width = max((n for _, _, n in spans), default=1)
    if not spans:
        return values.new_zeros(0, width)
    cols = values.shape[-1]
    start = torch.tensor([r * cols + c for r, c, _ in spans])[:, None]
    steps = torch.arange(width)[None]
    valid = steps < torch.tensor([n for _, _, n in spans])[:, None]
    idx = to_device(torch.where(valid, start + steps, start), values.device)
    out = values.reshape(-1)[idx]
    return out.masked_fill(~to_device(valid, values.device), 0.0)


def response_mask(spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """``[k, T]`` float mask of the response tokens, aligned with :func:`responses`."""
    width = max((n for _, _, n in spans), default=1)
    mask = torch.zeros(len(spans), width)
    for k, (_, _, n) in enumerate(spans):
        mask[k, :n] = 1.0
    return mask


def padded(rows: Sequence[Sequence[float] | torch.Tensor], width: int) -> torch.Tensor:
    """``[k, width]`` float32 from ragged rows (zeros past each row's end)."""
    out = torch.zeros(len(rows), width)
    for k, r in enumerate(rows):
        out[k, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out

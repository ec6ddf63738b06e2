"""Turning a ``TrainBatch`` into micro-batches: split over ranks, then packed or padded.

Every rank sees the whole batch and computes the same split, so no rank has to tell another
what it holds; FSDP needs every rank in every forward/backward, so ranks with fewer
micro-batches run empty (zero-weight) ones to keep the collectives in step.

Two layouts, the same numbers:

- **packed** (default): the micro-batch is ONE row, its trajectories concatenated; position
  ids restart at 0 for each trajectory and attention does not cross them (transformers reads
  the restarts from ``position_ids``: a block-diagonal mask for SDPA, ``cu_seqlens`` for
  FlashAttention-2; the sequence-parallel path builds them from ``cu_seqlens`` itself). A
  micro-batch holds up to ``budget`` real tokens: no padding is computed.
- **padded**: one right-padded row per trajectory, ``budget`` bounding rows x longest.

In both, column ``j`` of a row is scored against ``labels[j]``, the next token of the same
trajectory; ``spans`` say where each trajectory's response log-probs sit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laminar_core import Trajectory, to_device


@dataclass(eq=False)
class MicroBatch:
    """Rows of token ids and where each trajectory's response log-probs are.

    ``spans[k] = (row, col, n)``: trajectory ``index[k]``'s ``n`` response log-probs are
    ``logprobs[row, col : col + n]`` (``col`` is the last prompt token's column: it predicts
    the first response token). ``attention_mask`` is ``None`` for a packed row. ``cu_seqlens``
    (packed only) are the row's segment boundaries, trailing padding included.
    """

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    labels: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor | None  # [R, L] or None (packed)
    index: list[int]
    spans: list[tuple[int, int, int]]
    cu_seqlens: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        """Response tokens (the ones the loss counts)."""
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


def trainable(trajs: list[Trajectory]) -> list[Trajectory]:
    """Trajectories a step can learn from: not failed, with a response, its log-probs and
    (when it has one) a loss mask of the response's length."""
    return [
        t
        for t in trajs
        if t.finish_reason.value != "failed"
        and t.response_ids
        and len(t.logprobs) == len(t.response_ids)
        and (not t.loss_mask or len(t.loss_mask) == len(t.response_ids))
        and t.reward is not None
    ]


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


def padded(rows: list[list[float] | torch.Tensor], width: int) -> torch.Tensor:
    """``[k, width]`` float32 from ragged rows (zeros past each row's end)."""
    out = torch.zeros(len(rows), width)
    for k, r in enumerate(rows):
        out[k, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out

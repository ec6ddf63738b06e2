"""Turning a ``TrainBatch`` into padded tensors, split over data-parallel ranks and
micro-batches (the same split as laminar-fsdp's, so the two engines see the same batches).

Every rank sees the whole batch and computes the same split, so no rank has to tell another
what it holds: the ranks of one model replica (its TP and PP ranks) run the same
micro-batches. Megatron syncs gradients once per optimiser step, so data-parallel ranks may
run different numbers of micro-batches; a rank with no trajectories runs one empty
(zero-weight) micro-batch, since the step's collectives need every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laminar_core import Trajectory


@dataclass
class MicroBatch:
    """Right-padded sequences, shifted so column ``j`` predicts token ``j + 1``.

    ``mask`` marks response tokens; ``behaviour`` holds the rollout engine's log-probs at
    those positions; ``index`` is each row's position in the mini-batch's trajectory list.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, L-1]
    mask: torch.Tensor  # [B, L-1] float
    behaviour: torch.Tensor  # [B, L-1]
    index: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())


def trainable(trajs: list[Trajectory]) -> list[Trajectory]:
    """Trajectories a step can learn from: not failed, with a response and its log-probs."""
    return [
        t
        for t in trajs
        if t.finish_reason.value != "failed"
        and t.response_ids
        and len(t.logprobs) == len(t.response_ids)
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
    """Group ``indices`` so each group's padded size (rows x longest) stays within ``budget``.

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


def collate(trajs: list[Trajectory], index: list[int], pad_id: int) -> MicroBatch:
    rows = [trajs[i] for i in index]
    seqs = [list(t.prompt_ids) + list(t.response_ids) for t in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    behaviour = torch.zeros((len(rows), width - 1))
    for r, (t, s) in enumerate(zip(rows, seqs, strict=True)):
        ids[r, : len(s)] = torch.tensor(s)
        attn[r, : len(s)] = 1
        p, n = len(t.prompt_ids), len(t.response_ids)
        # column j predicts token j + 1; only tokens the model generated count (a tool's
        # output appended between turns has ``loss_mask`` 0)
        mask[r, p - 1 : p - 1 + n] = torch.tensor(t.response_mask(), dtype=torch.float32)
        behaviour[r, p - 1 : p - 1 + n] = torch.tensor(t.logprobs, dtype=torch.float32)
    return MicroBatch(ids, attn, ids[:, 1:].clone(), mask, behaviour, list(index))


def empty_micro_batch(pad_id: int) -> MicroBatch:
    """A one-token row with nothing to learn: keeps a rank in step with the others."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long)
    return MicroBatch(
        ids, torch.ones_like(ids), ids[:, 1:].clone(), torch.zeros(1, 1), torch.zeros(1, 1), []
    )

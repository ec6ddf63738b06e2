"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl uses it) for transformers models.

A packed row of ``L`` tokens is split into ``N`` contiguous slices, one per rank of a
sequence-parallel group. Everything outside attention (embeddings, norms, MLPs, the log-prob
head) is per token and runs on the local slice. Attention needs every token of a trajectory,
so around it two all-to-alls swap what is split (:func:`attention`):

- before: ``q, k, v [1, heads, L/N, d]`` -> ``[1, heads/N, L, d]`` (each rank: all positions,
  a slice of the heads; KV heads are repeated first when there are fewer than ``N``);
- packed attention over the whole row for those heads (``attention.packed_attention``);
- after: ``[1, heads/N, L, d]`` -> ``[1, heads, L/N, d]``.

Rotary embeddings are applied by the model before the attention function, from each rank's
own slice of the position ids, so nothing else in the model changes. The all-to-alls are
autograd functions (the backward of one is the other), so gradients and activation
checkpointing's recompute go through them. :func:`gather_sequence` all-gathers the per-token
log-probs afterwards so every rank of the group computes the loss over the whole row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from laminar_fsdp.packed_row import PackedRow


def _a2a(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``all_to_all_single`` over dim 0 (chunk ``i`` goes to rank ``i``)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup | None, n: int) -> Tensor:
    """``[B, H, L/n, d]`` -> ``[B, H/n, L, d]``."""
    b, h, ls, d = x.shape
    send = x.view(b, n, h // n, ls, d).permute(1, 0, 2, 3, 4)  # chunk i: heads of rank i
    recv = _a2a(send, group)  # recv[j]: my heads, rank j's positions
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * ls, d)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup | None, n: int) -> Tensor:
    """``[B, H/n, L, d]`` -> ``[B, H, L/n, d]`` (the inverse of :func:`_seq_to_heads`)."""
    b, hn, seq, d = x.shape
    ls = seq // n
    send = x.view(b, hn, n, ls, d).permute(2, 0, 1, 3, 4)  # chunk j: positions of rank j
    recv = _a2a(send, group)  # recv[i]: rank i's heads, my positions
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * hn, ls, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _seq_to_heads(x, group, n)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, ctx.group, ctx.n), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _heads_to_seq(x, group, n)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, ctx.group, ctx.n), None, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's slice of the gradient.

    Right for a quantity every rank of the group then uses identically (the loss is computed
    on the gathered log-probs on every rank): each rank back-propagates the one loss through
    its own positions only, and FSDP's gradient reduction sums the ranks' shares.
    """

    @staticmethod
    def forward(ctx, x, group, n, rank):
        ctx.rank, ctx.width = rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        w = ctx.width
        return g[..., ctx.rank * w : (ctx.rank + 1) * w].contiguous(), None, None, None


def gather_sequence(x: Tensor, row: PackedRow) -> Tensor:
    """``[..., L/N]`` on every rank -> ``[..., L]`` (differentiable; see :class:`_GatherSeq`)."""
    if row.size == 1:
        return x
    return _GatherSeq.apply(x, row.group, row.size, row.rank)


def kv_repeat(kv_heads: int, heads: int, n: int) -> int:
    """How many times to repeat each KV head so the KV heads split evenly over ``n`` ranks
    (verl does the same for GQA models with fewer KV heads than ranks)."""
    if heads % n:
        raise ValueError(
            f"trainer.fsdp.sequence_parallel={n} must divide the model's attention heads "
            f"({heads}); pick a divisor of {heads}"
        )
    r = n // math.gcd(kv_heads, n)
    if heads % (kv_heads * r):
        return heads // kv_heads  # repeat up to multi-head attention
    return r


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    row: PackedRow,
    scale: float,
    kernel: Callable[[Tensor, Tensor, Tensor, PackedRow, float], Tensor],
) -> Tensor:
    """``query [1, H, L/N, d]``, ``key, value [1, H_kv, L/N, d]`` -> ``[1, H, L/N, d]``:
    all-to-all to head slices over the whole row, ``kernel``, all-to-all back."""
    n, group = row.size, row.group
    r = kv_repeat(key.shape[1], query.shape[1], n)
    if r > 1:
        key = key.repeat_interleave(r, dim=1)
        value = value.repeat_interleave(r, dim=1)
    q = _SeqToHeads.apply(query, group, n)
    k = _SeqToHeads.apply(key, group, n)
    v = _SeqToHeads.apply(value, group, n)
    return _HeadsToSeq.apply(kernel(q, k, v, row, scale), group, n)

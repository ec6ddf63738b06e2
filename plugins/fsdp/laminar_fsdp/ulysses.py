"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as verl uses it) for transformers models.

A packed row of ``L`` tokens is split into ``N`` contiguous slices, one per rank of a
sequence-parallel group. Everything outside attention (embeddings, norms, MLPs, the log-prob
head) is per token and runs on the local slice. Attention needs every token of a trajectory,
so around it two all-to-alls swap what is split:

- before: ``q, k, v [1, heads, L/N, d]`` -> ``[1, heads/N, L, d]`` (each rank: all positions,
  a slice of the heads);
- attention over the whole row for those heads, restricted to each trajectory (varlen
  FlashAttention on GPU when ``flash-attn`` is installed, else SDPA with a block-diagonal
  causal mask);
- after: ``[1, heads/N, L, d]`` -> ``[1, heads, L/N, d]``.

Rotary embeddings are applied by the model before the attention function, from each rank's
own slice of the position ids, so nothing else in the model changes. The all-to-alls are
autograd functions (the backward of one is the other), so gradients and activation
checkpointing's recompute go through them.

The attention function is registered with transformers under :data:`ATTENTION_NAME`; a model
loaded with ``attn_implementation=ATTENTION_NAME`` calls it with a :class:`SPState` passed as
the ``laminar_sp`` keyword of the model's forward (transformers forwards unknown keywords to
the attention function; keeping the state in the call, not in a global, is what lets the
checkpointed recompute in backward see the same state).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

ATTENTION_NAME = "laminar_ulysses"


@dataclass
class SPState:
    """One packed row's sequence-parallel context, the same on every rank of the group.

    ``cu_seqlens`` are the cumulative lengths of the row's segments (trajectories, then the
    padding that makes ``L`` a multiple of ``size``), ``[0, ..., L]``.
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    cu_seqlens: Tensor  # int32 [segments + 1], on the compute device
    max_seqlen: int

    @property
    def total(self) -> int:
        return int(self.cu_seqlens[-1])


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


def gather_sequence(x: Tensor, sp: SPState) -> Tensor:
    """``[..., L/N]`` on every rank -> ``[..., L]`` (differentiable; see :class:`_GatherSeq`)."""
    if sp.size == 1:
        return x
    return _GatherSeq.apply(x, sp.group, sp.size, sp.rank)


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


def _flash_varlen_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def packed_attention(q: Tensor, k: Tensor, v: Tensor, sp: SPState, scaling: float) -> Tensor:
    """Causal attention restricted to each segment of the row. ``q [1, h, L, d]``,
    ``k, v [1, h_kv, L, d]`` with ``h % h_kv == 0``; returns ``[1, h, L, d]``."""
    h, hk = q.shape[1], k.shape[1]
    if _flash_varlen_available(q.device):
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q[0].transpose(0, 1).contiguous(),
            k[0].transpose(0, 1).contiguous(),
            v[0].transpose(0, 1).contiguous(),
            cu_seqlens_q=sp.cu_seqlens,
            cu_seqlens_k=sp.cu_seqlens,
            max_seqlen_q=sp.max_seqlen,
            max_seqlen_k=sp.max_seqlen,
            softmax_scale=scaling,
            causal=True,
        )
        return out.transpose(0, 1).unsqueeze(0)
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    seq = q.shape[2]
    lengths = (sp.cu_seqlens[1:] - sp.cu_seqlens[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)
    pos = torch.arange(seq, device=q.device)
    mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[None, None], scale=scaling
    )


def ulysses_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention interface: ``query [1, H, L/N, d]`` (after rotary) in,
    ``[1, L/N, H, d]`` out. Needs ``laminar_sp`` (an :class:`SPState`) in ``kwargs``."""
    sp: SPState | None = kwargs.get("laminar_sp")
    if sp is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} needs the laminar_sp keyword (the trainer passes it); "
            "load the model with another attn_implementation to run it outside the trainer"
        )
    if dropout:
        raise ValueError("sequence-parallel attention runs without dropout (RL trainers do)")
    if sliding_window is not None:
        raise ValueError("sequence-parallel attention does not support sliding-window layers")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    n, group = sp.size, sp.group
    r = kv_repeat(key.shape[1], query.shape[1], n)
    if r > 1:
        key = key.repeat_interleave(r, dim=1)
        value = value.repeat_interleave(r, dim=1)
    q = _SeqToHeads.apply(query, group, n)
    k = _SeqToHeads.apply(key, group, n)
    v = _SeqToHeads.apply(value, group, n)
    out = packed_attention(q, k, v, sp, scale)
    out = _HeadsToSeq.apply(out, group, n)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`ulysses_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    return ATTENTION_NAME

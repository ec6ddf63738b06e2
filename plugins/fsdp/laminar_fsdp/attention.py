"""Attention over a packed row: causal inside each trajectory, never across, no dense mask.

A packed micro-batch is one row of several trajectories. transformers can run it from
restarting ``position_ids`` alone, but with SDPA it builds a dense ``[L, L]`` mask, which
the CPU kernel turns into a float tensor saved for backward in every layer (``O(L^2)`` per
layer: 205 MB of the 534 MB a 3.7K-token row kept on the ``tiny`` benchmark shape). Instead,
the engine registers :func:`packed_attention_forward` with transformers under
:data:`ATTENTION_NAME` and hands it the row's segment boundaries (``cu_seqlens``):

- ``flash``: one varlen FlashAttention call over the row (CUDA with ``flash-attn``);
- ``flex``: one compiled ``flex_attention`` call over the row under a document block mask
  (causal inside each segment), built once per micro-batch from the segment boundaries
  (``packed_row.document_block_mask``): the kernel skips the tiles no segment spans and
  evaluates the mask only on tiles a boundary or the diagonal crosses. The GPU default
  without flash-attn;
- ``sdpa``: one causal SDPA call per segment (no mask at all: SDPA's own flash kernels,
  ``O(L)`` saved per layer), GQA through ``enable_gqa``: a kernel launch (and its share of
  host time) per trajectory per layer. The CPU default: uncompiled ``flex_attention`` on CPU
  evaluates the dense ``[L, L]`` scores, and compiling it there costs a C++ build per shape.

``resolve_kernel`` picks among them (``trainer.fsdp.packed_attention``); all three give the
same numbers to rounding (``tests/test_fsdp_packed_attention.py``).

Under Ulysses sequence parallelism (``ulysses.py``) the same kernel runs between the two
all-to-alls, on all positions of the row for a slice of the heads.

The row's state travels as the ``laminar_row`` keyword of the model's forward (transformers
passes unknown keywords down to the attention function): in the call, not in a global, so
activation checkpointing's recompute in backward sees the same state.
"""

from __future__ import annotations

import importlib.util
from itertools import pairwise

import torch
from torch import Tensor

from laminar_fsdp import ulysses
from laminar_fsdp.options import PACKED_KERNELS
from laminar_fsdp.packed_row import PackedRow

ATTENTION_NAME = "laminar_packed"


def flash_varlen_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def resolve_kernel(choice: str, device: torch.device) -> str:
    """``auto``: ``flash`` where flash-attn is installed on CUDA, else ``flex`` on CUDA,
    else ``sdpa`` (see the module docstring for why not ``flex`` on CPU)."""
    if choice not in PACKED_KERNELS:
        raise ValueError(
            f"packed_attention: unknown {choice!r}; known: {', '.join(PACKED_KERNELS)}"
        )
    if choice == "flash" and not flash_varlen_available(device):
        raise ValueError(
            "packed_attention: flash needs CUDA and the flash-attn package "
            "(pip install laminar-fsdp[gpu]); use auto, flex or sdpa"
        )
    if choice != "auto":
        return choice
    if flash_varlen_available(device):
        return "flash"
    return "flex" if device.type == "cuda" else "sdpa"


_compiled_flex = None


def _flex(q: Tensor, k: Tensor, v: Tensor, row: PackedRow, scale: float) -> Tensor:
    """One flex attention call over the row; compiled on CUDA (uncompiled flex attention is
    a dense reference implementation), eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            # dynamic: one kernel for every row length (rows vary per micro-batch)
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    gqa = k.shape[1] != q.shape[1]
    return fn(q, k, v, block_mask=row.block_mask(), scale=scale, enable_gqa=gqa)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, row: PackedRow, scale: float) -> Tensor:
    """Causal attention restricted to each segment of the row. ``q [1, h, L, d]``,
    ``k, v [1, h_kv, L, d]`` with ``h % h_kv == 0``; returns ``[1, h, L, d]``."""
    if row.kernel == "flex":
        return _flex(q, k, v, row, scale)
    if row.kernel == "flash":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q[0].transpose(0, 1).contiguous(),
            k[0].transpose(0, 1).contiguous(),
            v[0].transpose(0, 1).contiguous(),
            cu_seqlens_q=row.cu_seqlens,
            cu_seqlens_k=row.cu_seqlens,
            max_seqlen_q=row.max_seqlen,
            max_seqlen_k=row.max_seqlen,
            softmax_scale=scale,
            causal=True,
        )
        return out.transpose(0, 1).unsqueeze(0)
    gqa = k.shape[1] != q.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    parts = [
        sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale, enable_gqa=gqa)
        for a, b in pairwise(row.bounds)
    ]
    return torch.cat(parts, dim=2)


def packed_attention_forward(
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
    """transformers attention interface: ``query [1, H, L_local, d]`` (after rotary) in,
    ``[1, L_local, H, d]`` out. Needs ``laminar_row`` (a :class:`PackedRow`) in ``kwargs``;
    with ``row.size > 1`` the row is split over a sequence-parallel group (Ulysses)."""
    row: PackedRow | None = kwargs.get("laminar_row")
    if row is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} needs the laminar_row keyword (the trainer passes "
            "it); load the model with another attn_implementation to run it elsewhere"
        )
    if dropout:
        raise ValueError("packed attention runs without dropout (RL trainers do)")
    if sliding_window is not None:
        raise ValueError("packed attention does not support sliding-window layers")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if row.size == 1:
        out = packed_attention(query, key, value, row, scale)
    else:
        out = ulysses.attention(query, key, value, row, scale, packed_attention)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`packed_attention_forward` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
    return ATTENTION_NAME

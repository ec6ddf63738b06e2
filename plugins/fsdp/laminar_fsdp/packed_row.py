"""A packed row's segments (``cu_seqlens``), the kernel that attends over it, and the
sequence-parallel group sharing it: the state that packed attention (``attention.py``) and
Ulysses (``ulysses.py``) both read.

The row is built once per micro-batch and handed to every layer (and to activation
checkpointing's recompute), so what depends only on the segments -- flex attention's
document block mask -- is built here once, on first use, and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from laminar_core import to_device

FLEX_BLOCK = 128  # flex attention's default tile: the block mask's granularity


@dataclass
class PackedRow:
    """One packed row's segments, and the sequence-parallel group sharing it (``size`` 1:
    none). ``cu_seqlens``: int32 ``[0, ..., L]`` on the compute device, trailing padding a
    segment of its own; ``bounds``: the same as Python ints. ``kernel``: ``flash`` (varlen
    FlashAttention), ``flex`` (one flex attention call under a document mask) or ``sdpa``
    (one SDPA call per segment), resolved by :func:`attention.resolve_kernel`."""

    cu_seqlens: Tensor
    bounds: list[int]
    max_seqlen: int
    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0
    kernel: str = "sdpa"
    _block_mask: Any = field(default=None, repr=False)

    @classmethod
    def of(cls, bounds: list[int], device: torch.device, **kw) -> PackedRow:
        lengths = [b - a for a, b in pairwise(bounds)]
        cu = to_device(torch.tensor(bounds, dtype=torch.int32), device)
        return cls(cu, list(bounds), max(lengths, default=1), **kw)

    @property
    def length(self) -> int:
        return self.bounds[-1]

    def block_mask(self):
        """Flex attention's ``BlockMask`` for causal attention inside each segment, built on
        the row's device from the segment boundaries alone (``O((L / 128)^2)`` work, no
        ``[L, L]`` tensor) and cached on the row."""
        if self._block_mask is None:
            self._block_mask = document_block_mask(self.cu_seqlens, self.length)
        return self._block_mask


def document_block_mask(cu_seqlens: Tensor, length: int, block: int = FLEX_BLOCK):
    """A flex-attention ``BlockMask``: position ``q`` attends to ``kv`` iff both lie in the
    same segment of ``cu_seqlens`` and ``kv <= q``.

    Built directly from tiles: a (q-tile, kv-tile) pair is *empty* when no segment spans
    both or the kv tile is after the q tile, *full* (no mask evaluated) when both tiles lie
    inside one segment and the kv tile ends before the q tile starts, and *partial*
    otherwise (the ``mask_mod`` decides per element). ``create_block_mask`` would evaluate
    the mask on all ``L^2`` pairs instead (16 G at 128K tokens, uncompiled).
    """
    from torch.nn.attention.flex_attention import BlockMask

    dev = cu_seqlens.device
    pos = torch.arange(length, device=dev, dtype=torch.int32)
    doc = torch.searchsorted(cu_seqlens[1:], pos, right=True).to(torch.int32)
    n = -(-length // block)
    # the mask may be asked about the last tile's positions past the row: a segment of their own
    doc_ext = torch.cat([doc, doc.new_full((n * block - length,), -1)])
    start = torch.arange(n, device=dev) * block
    end = torch.clamp(start + block, max=length) - 1
    first, last = doc[start], doc[end]  # segments of a tile's first and last position
    qi, kj = torch.arange(n, device=dev)[:, None], torch.arange(n, device=dev)[None, :]
    causal = kj <= qi
    overlap = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    one_doc = first == last
    full = (
        one_doc[:, None]
        & one_doc[None, :]
        & (first[:, None] == first[None, :])
        & (end[None, :] <= start[:, None])
    )
    partial = causal & overlap & ~full

    def tiles(m: Tensor) -> tuple[Tensor, Tensor]:
        count = m.sum(-1, dtype=torch.int32)
        # the tiles of each row first, in kv order (a stable sort of "not in the set")
        order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return count[None, None], order[None, None].contiguous()

    def mask_mod(b, h, q, kv):
        return (doc_ext[q] == doc_ext[kv]) & (kv <= q)

    kv_num, kv_idx = tiles(partial)
    full_num, full_idx = tiles(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
        seq_lengths=(length, length),
    )  # fmt: skip

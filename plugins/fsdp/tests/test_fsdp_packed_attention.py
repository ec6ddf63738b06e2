"""Packed attention in one call per layer: flex attention under the document block mask gives
today's per-trajectory SDPA numbers, and the block mask classifies every tile as the dense
mask says (empty tiles skipped, full tiles unmasked, the rest masked per element).

CPU limits: flex attention has no backward on CPU and runs uncompiled there (a dense
reference implementation), so the CPU checks are forward-only; gradients through the compiled
kernel are checked on a GPU (``benchmarks/trainer_engine.py --check-attention``).
"""

from __future__ import annotations

import warnings
from itertools import pairwise

import pytest
import torch

from laminar_fsdp.attention import packed_attention, resolve_kernel
from laminar_fsdp.packed_row import PackedRow, document_block_mask

ROWS = {
    "mixed": [0, 5, 130, 131, 300, 517],  # segments inside, across and on tile edges
    "one": [0, 256],
    "aligned": [0, 128, 384, 400],
    "tiny_then_long": [0, 1, 2, 3, 700, 1024],
}


def _dense(bounds: list[int]) -> torch.Tensor:
    n = bounds[-1]
    doc = torch.zeros(n, dtype=torch.long)
    for i, (a, b) in enumerate(pairwise(bounds)):
        doc[a:b] = i
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (doc[:, None] == doc[None, :]) & (kv <= q)


def _tile_sets(num: torch.Tensor, idx: torch.Tensor) -> list[set[int]]:
    return [set(idx[0, 0, i, : num[0, 0, i]].tolist()) for i in range(num.shape[-1])]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_block_mask_tiles_match_the_dense_mask(name):
    bounds = ROWS[name]
    dense = _dense(bounds)
    bm = document_block_mask(torch.tensor(bounds, dtype=torch.int32), bounds[-1])
    partial = _tile_sets(bm.kv_num_blocks, bm.kv_indices)
    full = _tile_sets(bm.full_kv_num_blocks, bm.full_kv_indices)
    n = -(-bounds[-1] // 128)
    for i in range(n):
        for j in range(n):
            tile = dense[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            kind = "empty" if not tile.any() else "full" if tile.all() else "partial"
            got = "full" if j in full[i] else "partial" if j in partial[i] else "empty"
            # a full tile may be marked partial (the mask then decides), never the reverse
            assert got == kind or (kind == "full" and got == "partial"), (name, i, j, kind, got)
    assert not any(full[i] & partial[i] for i in range(n))


@pytest.mark.parametrize("name", sorted(ROWS))
def test_flex_attention_equals_per_trajectory_sdpa(name):
    bounds = ROWS[name]
    g = torch.Generator().manual_seed(len(bounds))
    n = bounds[-1]
    q = torch.randn(1, 4, n, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out = {}
    for kernel in ("sdpa", "flex"):
        row = PackedRow.of(bounds, torch.device("cpu"), kernel=kernel)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex's "called without torch.compile" on CPU
            out[kernel] = packed_attention(q, k, v, row, 0.25)
    torch.testing.assert_close(out["flex"], out["sdpa"], atol=1e-12, rtol=1e-12)


def test_kernel_choice():
    cpu = torch.device("cpu")
    assert resolve_kernel("auto", cpu) == "sdpa"
    assert resolve_kernel("flex", cpu) == "flex"
    with pytest.raises(ValueError, match="flash needs CUDA"):
        resolve_kernel("flash", cpu)
    with pytest.raises(ValueError, match="unknown 'dense'"):
        resolve_kernel("dense", cpu)

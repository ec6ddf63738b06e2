"""A packed row's segments (``cu_seqlens``) and the sequence-parallel group sharing it: the
state that packed attention (``attention.py``) and Ulysses (``ulysses.py``) both read."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import Tensor

from laminar_core import to_device


@dataclass
class PackedRow:
    """One packed row's segments, and the sequence-parallel group sharing it (``size`` 1:
    none). ``cu_seqlens``: int32 ``[0, ..., L]`` on the compute device, trailing padding a
    segment of its own; ``bounds``: the same as Python ints."""

    cu_seqlens: Tensor
    bounds: list[int]
    max_seqlen: int
    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0

    @classmethod
    def of(cls, bounds: list[int], device: torch.device, **sp) -> PackedRow:
        lengths = [b - a for a, b in pairwise(bounds)]
        cu = to_device(torch.tensor(bounds, dtype=torch.int32), device)
        return cls(cu, list(bounds), max(lengths, default=1), **sp)

"""What a forward keeps for backward, measured on any device (no CUDA allocator needed).

:func:`saved_activations` counts the bytes autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``) plus the inputs that activation checkpointing
holds on to for its recompute (``torch.utils.checkpoint`` keeps them outside the saved-tensor
machinery, so they are counted from a pre-hook on each checkpointed layer). Storages are
counted once; parameters (leaf tensors that require grad, including FSDP's unsharded ones,
and views of them) are not activations and are left out. This is the memory that grows with
the tokens of a micro-batch -- what ``gradient_checkpointing`` and the chunked log-prob head
exist to cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SavedBytes:
    """Running totals: ``bytes`` over distinct storages, ``largest`` single storage, and the
    ``shapes`` of the tensors counted."""

    bytes: int = 0
    largest: int = 0
    tensors: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list, repr=False)
    _seen: set[int] = field(default_factory=set, repr=False)

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            return
        base = t._base if t._base is not None else t  # a weight's transpose is still a weight
        if base.is_leaf and base.requires_grad:
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        self.bytes += storage.nbytes()
        self.largest = max(self.largest, storage.nbytes())
        self.tensors += 1
        self.shapes.append(tuple(t.shape))


@contextmanager
def saved_activations(layers: Iterable[nn.Module] = ()) -> Iterator[SavedBytes]:
    """Count what the forwards run inside the block keep for backward (see module doc).

    ``layers``: the checkpointable blocks (decoder layers); their first tensor input is
    counted too, once per storage, so a checkpointed layer's held input is not missed and an
    uncheckpointed one's is not counted twice.
    """
    out = SavedBytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        out.add(t)
        return t

    def pre_hook(_module, args, kwargs):
        first = args[0] if args else kwargs.get("hidden_states")
        out.add(first)

    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield out
    finally:
        for h in handles:
            h.remove()

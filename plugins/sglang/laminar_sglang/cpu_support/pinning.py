"""Pinned host memory where there is none: SGLang's LoRA layers on a CPU-only torch.

SGLang 0.5.23's LoRA code asks for page-locked ("pinned") host buffers unconditionally, a
staging hint for host-to-GPU copies: ``sglang/srt/lora/layers.py`` (``torch.tensor(...,
pin_memory=True)`` when every adapted layer is built, lines 145/324/479/723/814, and
``.pin_memory()`` at 594) and ``lora/backend/torch_backend.py`` (``prepare_lora_batch``,
every batch). A CPU-only torch has no pinned allocator and raises ``RuntimeError:
pin_memory=True requires a CUDA or other accelerator backend`` there, so the replica dies
while SGLang builds its LoRA layers.

``install`` turns exactly those errors into what pinning means without an accelerator: the
ordinary host tensor (pinning changes where a tensor lives, never its values). Where an
accelerator exists nothing changes (pinning is real there), so this is a no-op on GPU.
It runs in SGLang's scheduler processes (``laminar_sglang.host`` installs it at import,
which SGLang's spawned children repeat) and only on CPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: torch's factories that take ``pin_memory=`` and that SGLang's LoRA code calls with it.
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "empty_strided")


def _no_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return not acc.is_available()
    return not torch.cuda.is_available()


def install() -> bool:
    """Make pinning a no-op on a torch without an accelerator; True when installed."""
    if not _no_accelerator() or getattr(torch.Tensor.pin_memory, "_laminar", False):
        return False

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    pin_memory._laminar = True  # type: ignore[attr-defined]
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    for name in FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))
    return True


def _unpinned(factory: Any) -> Any:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return make

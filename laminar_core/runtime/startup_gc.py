"""Start-up without the cyclic garbage collector rescanning the import heap.

A process that starts an engine imports torch, transformers (and vLLM) and builds a model:
about a million Python objects that live as long as the process. CPython's collector makes a
full pass over all of them each time allocations cross its oldest generation's threshold,
and none of those passes finds garbage worth the time. So a process holds automatic
collection off while it starts (``hold_gc``), then freezes what it built and turns
collection back on (``release_gc``): ``gc.freeze`` moves every object alive to a generation
the collector never scans again. vLLM freezes its heap the same way once its engine is built
(``vllm.utils.gc_utils.freeze_gc_heap``).

Cost: cycles that became garbage during start-up are frozen with the rest and never freed
(measured: ~14 MB in a vLLM replica's process). Explicit ``gc.collect()`` calls still run
while collection is held.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["hold_gc", "release_gc", "startup_gc"]


def hold_gc() -> bool:
    """Stop automatic collection for the start-up that follows. Returns whether it was on
    (what ``release_gc`` restores)."""
    was_on = gc.isenabled()
    gc.disable()
    return was_on


def release_gc(was_on: bool = True) -> None:
    """Start-up is over: freeze the objects it built, then collect as before ``hold_gc``."""
    gc.freeze()
    if was_on:
        gc.enable()


@contextlib.contextmanager
def startup_gc() -> Iterator[None]:
    """``hold_gc`` for the block, ``release_gc`` after it (also when it raises)."""
    was_on = hold_gc()
    try:
        yield
    finally:
        release_gc(was_on)

"""Run a function as the ranks of a process group, one spawned process each (engine tests
on gloo)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout_s: float = 300) -> dict:
    """``target(rank, world, port, *args, out)`` in ``world`` spawned processes (``port``: a
    free one for their rendezvous; ``target`` module-level, so it pickles); returns ``out``
    (what each rank put there) once all exited cleanly, else ``AssertionError`` with the
    exit codes."""
    import torch.multiprocessing as mp

    from laminar_core.net import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    codes = [p.exitcode for p in procs]
    for p in procs:  # one that hung past the timeout leaves nothing behind
        if p.is_alive():
            p.kill()
            p.join()
    if any(c != 0 for c in codes):
        raise AssertionError(f"rank processes exited with {codes}")
    return dict(out)

"""Calling Ray actors from the driver, and living in one: the pieces every actor kind shares.

``ACTOR_GONE`` are the exceptions that mean the actor (its process or its node) is gone;
``engine_error`` unwraps Ray's ``RayTaskError`` to the engine's own exception, so messages
name the cause, not Ray's wrapper; ``limit_threads`` keeps torch in an actor process to the
threads it was given.
"""

from __future__ import annotations

import os

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

ACTOR_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)

__all__ = ["ACTOR_GONE", "RayTaskError", "engine_error", "limit_threads", "log_to"]


def engine_error(e: RayTaskError) -> BaseException:
    """The exception the actor's code raised (``e`` itself if Ray kept no cause)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def limit_threads() -> None:
    """Ray gives each worker the node's full CPU count by default; with several engines on
    one small machine that oversubscription makes torch many times slower."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, n))


def log_to(path: str | None) -> None:
    """Send this actor process's output (and that of every process it starts: vLLM's engine
    core and workers) to ``path``, appended, instead of Ray's log forwarding to the driver's
    terminal (``telemetry.engine_logs``). ``None``: leave it where Ray puts it."""
    if not path:
        return
    import sys

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)

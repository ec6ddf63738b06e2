"""Calling Ray actors from the driver, and living in one: the pieces every actor kind shares.

``ACTOR_GONE`` are the exceptions that mean the actor (its process or its node) is gone;
``engine_error`` unwraps Ray's ``RayTaskError`` to the engine's own exception, so messages
name the cause, not Ray's wrapper. What an actor's process does to itself (threads, cores,
logs, the resource tracker) is in ``actor_process`` (no Ray there: a host forked from the
zygote uses it too), and named here as well.
"""

from __future__ import annotations

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from laminar_core.runtime.actor_process import (
    detach_resource_tracker,
    limit_threads,
    log_to,
    pin_cores,
)

ACTOR_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)

__all__ = [
    "ACTOR_GONE",
    "RayTaskError",
    "detach_resource_tracker",
    "engine_error",
    "limit_threads",
    "log_to",
    "pin_cores",
]


def engine_error(e: RayTaskError) -> BaseException:
    """The exception the actor's code raised (``e`` itself if Ray kept no cause)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e

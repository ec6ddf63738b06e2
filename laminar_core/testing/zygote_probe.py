"""A host for testing ``runtime.zygote`` without an engine: what a forked child sees.

``ProbeHost`` is a host actor built the way ``runtime.hosts.RolloutHost`` is: given a
``zygote`` it forks its host from it (as the FSDP trainer's engine would: the zygote serves
it only when started for ``("trainer", "fsdp")``) and forwards every method but ``node_id``
and ``actor_pid``. Its methods report the host process's state (pid, environment, which
modules it had before it was built) and misbehave on request (raise, die, fail to build).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from laminar_core.runtime.hosts import _fork_host, _forwarding


class ProbeError(ValueError):
    """What ``boom`` (and a build asked to ``fail``) raises: its type reaches the caller."""


@_forwarding("node_id", "actor_pid")
class ProbeHost:
    def __init__(
        self,
        modules: tuple[str, ...] = (),
        fail: str = "",
        log_path: str | None = None,
        zygote: tuple | None = None,
    ) -> None:
        if _fork_host(self, zygote, "trainer", (modules, fail), log_path):
            return
        if fail:
            raise ProbeError(fail)
        # which of ``modules`` this process had before anything here imported them
        self.had = {m: m in sys.modules for m in modules}

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "had": self.had,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
        }

    def pid(self) -> int:
        return os.getpid()

    def actor_pid(self) -> int:
        """The actor's own process (where a forked host's calls arrive)."""
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def echo(self, x: Any, delay_s: float = 0.0) -> Any:
        await asyncio.sleep(delay_s)
        return x

    def say(self, text: str) -> None:
        print(text, flush=True)

    def boom(self, text: str) -> None:
        raise ProbeError(text)

"""What running one piece of code gave, and the executor interface behind the environment."""

from __future__ import annotations

import abc
import signal
from dataclasses import dataclass

#: ``RunResult.status`` values: ``ok`` (exit 0), ``error`` (the code raised or exited
#: non-zero, a MemoryError included), and the limits the executor observed: ``timeout``
#: (wall clock), ``memory`` (the kernel killed a process at the sandbox's memory budget),
#: ``cpu_time``, ``output_limit`` (printed past the kill bound), ``killed`` (a signal, or the
#: sandbox process died under the code).
STATUSES = ("ok", "error", "timeout", "memory", "cpu_time", "output_limit", "killed")


@dataclass
class RunResult:
    """One run of one piece of code.

    ``stdout``/``stderr`` hold what was kept (the head of stdout, the tail of stderr, each at
    most the executor's ``output_bytes``); ``stdout_bytes``/``stderr_bytes`` what was
    printed in all. ``message`` is a one-line account of any limit hit (empty for ``ok`` and
    plain ``error``).
    """

    status: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    wall_s: float = 0.0
    cpu_s: float | None = None
    message: str = ""

    @property
    def truncated(self) -> bool:
        return self.stdout_bytes > len(self.stdout.encode()) or self.stderr_bytes > len(
            self.stderr.encode()
        )


def signal_name(sig: int | None) -> str:
    try:
        return signal.Signals(sig).name if sig is not None else "?"
    except ValueError:
        return f"signal {sig}"


class CodeExecutor(abc.ABC):
    """Runs code somewhere isolated: the local pool or a remote sandbox service.

    ``await start()`` once (may refuse with ``EnvUnavailable``), then concurrent ``await
    run(code, timeout_s)`` (each waits for a free worker; the wait does not count against
    ``timeout_s``), then ``await close()``. ``run`` reports whatever the code did as a
    :class:`RunResult` and raises ``EnvFailure`` only when the executor itself is broken.
    """

    #: The isolation in force (``bwrap``, ``namespaces``, ``none``, ``remote``).
    isolation: str = ""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def run(self, code: str, timeout_s: float) -> RunResult: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

"""Running one agent episode against a gateway session: a Python entrypoint or a program.

An ``AgentRunner`` runs the agent once for a prompt's row, given the session's base URL and
key, within a wall clock, and returns the episode's reward (``None``: the run's
``reward.fn`` scores the session). A run that does not end well raises ``AgentFailed``
naming what happened (``crashed``, ``timeout``, ``bad_reward``); the caller closes the
session and decides whether the episode runs again.

* ``EntrypointRunner``: ``agent.entrypoint: package.module:function``, an
  ``async def run(base_url, api_key, row) -> float | None`` awaited in the driver's event
  loop (it must not block it: use async clients). Past the wall clock it is cancelled.
* ``CommandRunner``: ``agent.command: [...]``, an unmodified program started per episode in
  a process group of its own with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``LAMINAR_ROW``
  (the row as JSON) and ``LAMINAR_REWARD_FILE`` in its environment. Its reward is the number
  it wrote to ``$LAMINAR_REWARD_FILE``, else the number after the last stdout line starting
  with ``reward_prefix``, else ``None``. A non-zero exit is a crash; past the wall clock (or
  when the run stops) the whole process group is killed (SIGTERM, then SIGKILL after a
  grace period), and it is killed once the program exits too, so nothing it started in its
  group outlives the episode. (A child that puts itself in a new session escapes any
  process group on the host.) With ``agent.sandbox`` the program runs inside
  ``laminar-sandbox`` instead (``laminar_sandbox.command``): its own scratch directory (the
  reward file's), the host's files hidden or read-only, a network that reaches the gateway
  only, a uid and rlimits of its own, and a pid namespace that dies with its group.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import json
import math
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from laminar_core.plugins.manager import import_spec

__all__ = [
    "AgentFailed",
    "AgentRunner",
    "CommandRunner",
    "CommandSandbox",
    "EntrypointRunner",
    "command_sandbox",
    "make_runner",
]

AgentFn = Callable[[str, str, dict[str, Any]], Awaitable[float | None]]


class CommandSandbox(Protocol):
    """What ``CommandRunner`` needs of a sandbox (``laminar_sandbox.command.CommandSandbox``):
    per episode, an async context manager yielding ``.argv`` and ``.env`` to start in a
    process group of its own and ``.reward_file`` (a host path) to read after it exits;
    leaving it removes whatever the episode left."""

    def episode(
        self, command: Sequence[str], base_url: str, env: dict[str, str]
    ) -> contextlib.AbstractAsyncContextManager[Any]: ...


class AgentFailed(Exception):
    """An episode that did not end well: ``kind`` is ``crashed``, ``timeout`` or
    ``bad_reward``; the message says what happened."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class AgentRunner(abc.ABC):
    """Runs one episode (module docstring)."""

    @abc.abstractmethod
    async def run(
        self, base_url: str, api_key: str, row: dict[str, Any], timeout_s: float
    ) -> float | None:
        """The episode's reward, or None; ``AgentFailed`` when it crashed or timed out."""


def _reward(value: Any, where: str) -> float | None:
    if value is None:
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise AgentFailed("bad_reward", f"{where} returned {value!r}, not a number") from None
    if not math.isfinite(reward):
        raise AgentFailed("bad_reward", f"{where} returned {reward}, not a finite number")
    return reward


class EntrypointRunner(AgentRunner):
    """``async def run(base_url, api_key, row) -> float | None`` (module docstring)."""

    def __init__(self, fn: AgentFn, name: str = "") -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))

    @classmethod
    def of(cls, spec: str) -> EntrypointRunner:
        """Import ``package.module:function`` (from the working directory too, as
        ``python -m`` would); ``ValueError`` naming the cause and the fix."""
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            fn = import_spec(spec)
        except Exception as e:
            raise ValueError(
                f"agent.entrypoint: cannot import '{spec}' ({type(e).__name__}: {e}); check "
                "the module is importable (on PYTHONPATH, or run from its directory)"
            ) from None
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"agent.entrypoint: '{spec}' is not an async function; write it as "
                "'async def run(base_url, api_key, row) -> float | None'"
            )
        return cls(fn, spec)

    async def run(
        self, base_url: str, api_key: str, row: dict[str, Any], timeout_s: float
    ) -> float | None:
        try:
            value = await asyncio.wait_for(self.fn(base_url, api_key, dict(row)), timeout_s)
        except asyncio.TimeoutError:
            raise AgentFailed("timeout", f"{self.name} ran past {timeout_s:g} s") from None
        except Exception as e:
            raise AgentFailed("crashed", f"{self.name} raised {type(e).__name__}: {e}") from e
        return _reward(value, self.name)


class CommandRunner(AgentRunner):
    """A program per episode, in its own process group (module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        reward_prefix: str = "LAMINAR_REWARD=",
        cwd: str | None = None,
        grace_s: float = 2.0,
        sandbox: CommandSandbox | None = None,
    ) -> None:
        if not command:
            raise ValueError("agent.command is empty")
        self.command = list(command)
        self.reward_prefix = reward_prefix
        self.cwd = cwd
        self.grace_s = grace_s
        self.sandbox = sandbox

    async def run(
        self, base_url: str, api_key: str, row: dict[str, Any], timeout_s: float
    ) -> float | None:
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "LAMINAR_ROW": json.dumps(row, default=str),
        }
        if self.sandbox is not None:  # the sandbox gives the episode its home and reward file
            async with self.sandbox.episode(self.command, base_url, env) as box:
                return await self._run(box.argv, box.env, Path(box.reward_file), timeout_s)
        with tempfile.TemporaryDirectory(prefix="laminar-agent-") as tmp:
            reward = Path(tmp) / "reward"
            env["LAMINAR_REWARD_FILE"] = str(reward)
            return await self._run(self.command, env, reward, timeout_s)

    async def _run(
        self, argv: Sequence[str], env: dict[str, str], reward_file: Path, timeout_s: float
    ) -> float | None:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group: killed as one
            )
        except OSError as e:
            raise AgentFailed("crashed", f"agent.command could not start: {e}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            raise AgentFailed(
                "timeout", f"{self.command[0]} ran past {timeout_s:g} s and was killed"
            ) from None
        finally:
            await self._kill_group(proc)
        if proc.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise AgentFailed(
                "crashed", f"{self.command[0]} exited with {proc.returncode}: {last[0]}"
            )
        written = reward_file.read_text().strip() if reward_file.is_file() else ""
        if written:
            return _reward(written, "$LAMINAR_REWARD_FILE")
        lines = [
            line[len(self.reward_prefix) :].strip()
            for line in out.decode(errors="replace").splitlines()
            if self.reward_prefix and line.startswith(self.reward_prefix)
        ]
        return _reward(lines[-1], f"the stdout line {self.reward_prefix}") if lines else None

    async def _kill_group(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the program's group, SIGKILL what is left after ``grace_s``; reap it."""
        pgid = proc.pid
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), self.grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # what it left in its group, if anything
        if proc.returncode is None:
            with contextlib.suppress(BaseException):
                await proc.wait()


SANDBOX_SPEC = "laminar_sandbox.command:CommandSandbox"


def command_sandbox(options: dict[str, Any] | None = None) -> CommandSandbox:
    """``agent.sandbox``'s sandbox (the ``laminar-sandbox`` plugin's), checked now:
    ``ValueError`` in one line naming what is missing and the fix."""
    try:
        cls = import_spec(SANDBOX_SPEC)
    except ImportError:
        raise ValueError(
            "agent.sandbox needs the laminar-sandbox plugin, which is not installed; fix: "
            "pip install -e plugins/sandbox, or set agent.sandbox=false"
        ) from None
    try:
        return cls(dict(options or {}))
    except Exception as e:
        raise ValueError(str(e)) from None


def make_runner(
    entrypoint: str = "",
    command: Sequence[str] = (),
    reward_prefix: str = "LAMINAR_REWARD=",
    sandbox: bool = False,
    sandbox_options: dict[str, Any] | None = None,
) -> AgentRunner:
    """The runner for ``agent.entrypoint`` or ``agent.command`` (in the sandbox when
    ``sandbox``; ``ValueError`` when it is set for an entrypoint or cannot run here)."""
    if sandbox and not command:
        raise ValueError(
            "agent.sandbox runs agent.command programs only; an entrypoint runs in the "
            "driver's event loop: set agent.command, or agent.sandbox=false"
        )
    if entrypoint:
        return EntrypointRunner.of(entrypoint)
    if command:
        box = command_sandbox(sandbox_options) if sandbox else None
        return CommandRunner(command, reward_prefix, sandbox=box)
    raise ValueError("set agent.entrypoint or agent.command")

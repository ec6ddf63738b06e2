"""One ``python_sandbox`` environment per isolation mechanism, shared by a module's tests.

Every hostile test goes through the environment as the rollout loop will (a ``<code>`` turn
in, an observation out), then checks that the pool recovered (the next run works) and that
nothing of the sandbox survived (no process of its uids, none killed by the pool's safety
sweep either: the namespace teardown did the work).

The isolated mechanisms need root and, for ``bwrap``, the ``bubblewrap`` package
(``scripts/install.sh`` installs it). Where one is missing the tests of that mechanism skip,
unless ``LAMINAR_REQUIRE_REAL=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from laminar_core import EnvContext, StepResult, make_parser

laminar_sandbox = pytest.importorskip("laminar_sandbox")
from laminar_sandbox import PythonSandboxEnv, SandboxOptions
from laminar_sandbox.isolation import processes_of

#: The wall clock of runs that test it (the fork bomb, the infinite loop); other runs get a
#: generous one, so a loaded machine does not turn their outcome into a timeout.
TIMEOUT_S = 2.0
GENEROUS_S = 30.0
OPTIONS = dict(
    workers=2,
    memory_mb=512,
    cpu_s=10,
    processes=32,
    file_size_mb=8,
    disk_mb=32,
    output_bytes=4096,
    output_kill_bytes=4 << 20,
)


def _missing(isolation: str) -> str | None:
    if os.geteuid() != 0:
        return "the local sandbox needs root"
    if isolation == "bwrap" and shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    if isolation == "namespaces" and shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    return None


class Sandbox:
    """A started environment on its own event loop, driven synchronously by tests."""

    timeout_s = TIMEOUT_S
    options = OPTIONS

    def __init__(self, isolation: str, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        ctx = EnvContext(
            max_turns=100,
            timeout_s=GENEROUS_S,
            parser=make_parser("code"),
            options=SandboxOptions(isolation=isolation, **{**OPTIONS, **options}),
        )
        self.env = PythonSandboxEnv(ctx)
        try:
            self.run(self.env.start())
        except BaseException:
            self.loop.close()
            raise
        self.pool = self.env.executor
        self.uids = list(self.pool.uids())
        assert self.pool.isolation == isolation

    def run(self, aw: Any) -> Any:
        return self.loop.run_until_complete(aw)

    def step(self, code: str, timeout_s: float = GENEROUS_S) -> StepResult:
        """One model turn with ``code`` in a ``<code>`` block, in a fresh episode."""

        async def go() -> StepResult:
            ep = await self.env.reset({"prompt": "hostile"})
            self.env.ctx.timeout_s = timeout_s
            try:
                return await ep.step(f"Let me run this.\n<code>\n{code}\n</code>")
            finally:
                self.env.ctx.timeout_s = GENEROUS_S
                await ep.close()

        return self.run(go())

    def leftovers(self) -> dict[int, list[int]]:
        return {uid: pids for uid in self.uids if (pids := processes_of(uid))}

    def assert_recovered(self) -> None:
        """The pool still works, and nothing of the last run is left behind."""
        r = self.step("print(6 * 7)")
        assert "42" in r.observation and "error" not in r.info, r
        assert not self.leftovers(), f"sandbox processes survived: {self.leftovers()}"
        assert self.pool.stats["strays_killed"] == 0, self.pool.stats

    def close(self) -> None:
        self.run(self.env.close())
        self.loop.close()


def require(isolation: str) -> None:
    """Skip (or, under LAMINAR_REQUIRE_REAL=1, fail) where ``isolation`` cannot run here."""
    reason = _missing(isolation)
    if reason is not None:
        if os.environ.get("LAMINAR_REQUIRE_REAL") == "1":
            pytest.fail(f"sandbox isolation {isolation!r} unavailable: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module", params=["bwrap", "namespaces"])
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    require(request.param)
    box = Sandbox(request.param)
    yield box
    box.close()
    assert not box.leftovers(), f"processes left after close: {box.leftovers()}"


@pytest.fixture(scope="module")
def new_sandbox() -> Iterator[Callable[..., Sandbox]]:
    """``new_sandbox(isolation, **options)``: another started environment, with options of
    its own (skipped where ``isolation`` cannot run here); closed at the module's end."""
    made: list[Sandbox] = []

    def make(isolation: str, **options: Any) -> Sandbox:
        require(isolation)
        box = Sandbox(isolation, **options)
        made.append(box)
        return box

    yield make
    for box in made:
        box.close()
        assert not box.leftovers(), f"processes left after close: {box.leftovers()}"

"""python_sandbox passes core's environment contract, built from config like a run builds it."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from laminar_core import EnvConfig, EnvContext, Environment, make_environment
from laminar_core.testing import check_environment
from laminar_sandbox import PythonSandboxEnv
from laminar_sandbox.isolation import processes_of


def _local_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the local sandbox needs root"
    if shutil.which("bwrap") is None and shutil.which("unshare") is None:
        return "neither bwrap nor unshare(1) is installed"
    return None


@pytest.fixture
def require_local() -> None:
    reason = _local_unavailable()
    if reason is not None:
        if os.environ.get("LAMINAR_REQUIRE_REAL") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def test_python_sandbox_passes_the_environment_contract(require_local: None) -> None:
    built: list[PythonSandboxEnv] = []

    def make(ctx: EnvContext) -> Environment:
        # through the registry (entry point 'sandbox' of laminar-sandbox), as a run does
        env = make_environment(
            EnvConfig(
                name="python_sandbox",
                max_turns=ctx.max_turns,
                timeout_s=ctx.timeout_s,
                parser="code",
                options={"workers": 2, "memory_mb": 512},
            )
        )
        assert isinstance(env, PythonSandboxEnv)
        built.append(env)
        return env

    def leftovers() -> list:
        pool = built[0].executor
        left = [pid for uid in pool.uids() for pid in processes_of(uid)]
        return left + [
            d for d in os.listdir("/tmp") if d.startswith(f"laminar-sandbox-{os.getpid()}-")
        ]

    asyncio.run(
        check_environment(
            make,
            row={"prompt": "What is 6*7?", "answer": "42"},
            tool_turn="<code>\n```python\nprint(6 * 7)\n```\n</code>",
            answer_turn="The answer is \\boxed{42}.",
            slow_turn="<code>import time; time.sleep(60)</code>",
            bad_turn="<code>   </code>",
            max_turns=2,
            timeout_s=5.0,  # the slow turn's sleep(60) times out; others finish well within
            concurrency=3,
            leftovers=leftovers,
        )
    )
    assert built[0].executor.isolation in ("bwrap", "namespaces")

"""The python_sandbox environment's behaviour, and its refusals when isolation is missing."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from laminar_core import ConfigError, EnvConfig, EnvContext, StepResult, make_environment
from laminar_core import make_parser as parser
from laminar_sandbox import IsolationUnavailable, PythonSandboxEnv, SandboxOptions, SandboxPool
from laminar_sandbox import isolation as iso
from laminar_sandbox.env import print_last_value


@pytest.fixture(scope="module")
def local() -> None:
    if os.geteuid() != 0 or (shutil.which("bwrap") is None and shutil.which("unshare") is None):
        if os.environ.get("LAMINAR_REQUIRE_REAL") == "1":
            pytest.fail("the local sandbox needs root and bwrap or unshare(1)")
        pytest.skip("the local sandbox needs root and bwrap or unshare(1)")


class Driver:
    def __init__(self, parser_name: str = "code", timeout_s: float = 10.0, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        ctx = EnvContext(
            max_turns=4,
            timeout_s=timeout_s,
            parser=parser(parser_name),
            options=SandboxOptions(workers=1, memory_mb=512, **options),
        )
        self.env = PythonSandboxEnv(ctx)
        self.run(self.env.start())

    def run(self, aw: Any) -> Any:
        return self.loop.run_until_complete(aw)

    def turns(self, *texts: str) -> list[StepResult]:
        async def go() -> list[StepResult]:
            ep = await self.env.reset({"prompt": "p"})
            results = [await ep.step(t) for t in texts]
            await ep.close()
            return results

        return self.run(go())

    def close(self) -> None:
        self.run(self.env.close())
        self.loop.close()


@pytest.fixture(scope="module")
def driver(local: None) -> Iterator[Driver]:
    d = Driver(output_bytes=4096)
    yield d
    d.close()


def test_retool_turns_and_observations(driver: Driver) -> None:
    (r,) = driver.turns("Compute it.\n<code>\n```python\nprint(sum(range(10)))\n```\n</code>")
    assert r.observation == "\n<interpreter>\n45\n</interpreter>\n"
    assert not r.done and r.reward is None
    assert r.info["tool_calls"] == 1 and "error" not in r.info and r.info["tool_seconds"] > 0


def test_each_call_starts_afresh(driver: Driver) -> None:
    first, second = driver.turns(
        "<code>x = 5\nopen('/tmp/f', 'w').write('x')</code>",
        "<code>import os\nprint(os.path.exists('/tmp/f'))\nprint(x)</code>",
    )
    assert "error" not in first.info
    assert (
        "False" in second.observation and "NameError: name 'x' is not defined" in second.observation
    )
    assert second.info["error"] == "exception"
    assert 'File "<stdin>", line 3' in second.observation  # the code's own traceback only
    assert "_child" not in second.observation and "<string>" not in second.observation
    assert "runner" not in second.observation


def test_truncated_output_says_so(driver: Driver) -> None:
    (r,) = driver.turns("<code>print('y' * 20000)</code>")
    assert "[output truncated: showing 4096 of 20001 bytes of stdout" in r.observation
    assert r.info["truncated"] is True and "error" not in r.info


def test_after_close_step_raises(driver: Driver) -> None:
    async def go() -> None:
        ep = await driver.env.reset({"prompt": "p"})
        await ep.close()
        with pytest.raises(RuntimeError, match=r"finished or closed"):
            await ep.step("<code>print(1)</code>")

    driver.run(go())


def test_json_tool_calls(local: None) -> None:
    d = Driver("tool_call")
    try:
        call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
        (r,) = d.turns(
            call % ("python", '{"code": "print(1)"}')
            + call % ("python", '"{\\"code\\": \\"print(2)\\"}"')
            + call % ("search", '{"q": "x"}')
            + call % ("python", '{"source": "print(3)"}')
        )
        assert r.observation.count("<tool_response>") == 4
        assert "\n1\n" in r.observation and "\n2\n" in r.observation
        assert "[unknown tool 'search'; the only tool is 'python']" in r.observation
        assert "[tool 'python' needs a string argument 'code']" in r.observation
        assert r.info["tool_calls"] == 4 and r.info["error"] == "parse_error"
        spec = d.env.tool_specs()[0]["function"]
        assert spec["name"] == "python" and spec["parameters"]["required"] == ["code"]
        assert d.env.stop == ("</tool_call>",)
    finally:
        d.close()


def test_preloaded_modules_are_warm(local: None) -> None:
    d = Driver(preload=["fractions"])
    try:
        (r,) = d.turns("<code>import sys; print('fractions' in sys.modules)</code>")
        assert "True" in r.observation
    finally:
        d.close()


def test_cpu_limit_and_the_scientific_stack(local: None) -> None:
    """ReTool's code leans on numpy and sympy: they work under the limits; and a busy loop
    stops at its CPU budget (SIGXCPU), well before a generous wall clock."""
    d = Driver(timeout_s=120.0, cpu_s=1, preload=["numpy"])
    try:
        ok, spin = d.turns(
            "<code>import numpy as np, sympy\n"
            "print(np.arange(10).sum(), sympy.factorint(360))</code>",
            "<code>while True:\n    pass</code>",
        )
        assert "45 {2: 3, 3: 2, 5: 1}" in ok.observation and "error" not in ok.info
        assert spin.info["error"] == "cpu_time", spin
        assert "[CPU time limit exceeded (1 s)]" in spin.observation
    finally:
        d.close()


def test_prelude_from_the_row_and_print_last(local: None) -> None:
    """``prelude_key``: the row's hidden code runs before each call (in the sandbox, never
    shown); ``print_last``: a last expression's value is printed, as Jupyter does."""
    d = Driver(prelude_key="setup", print_last=True)
    try:

        async def go() -> list[StepResult]:
            ep = await d.env.reset({"prompt": "p", "setup": "secret = 4821\nimport math"})
            results = [
                await ep.step("<code>secret</code>"),
                await ep.step("<code>x = secret + 4\nmath.isqrt(x)  # a comment</code>"),
                await ep.step("<code>print(secret)\nNone</code>"),
                await ep.step("<code>1/0</code>"),
            ]
            await ep.close()
            plain = await d.env.reset({"prompt": "p"})  # a row without the field
            results.append(await plain.step("<code>'secret' in dir()</code>"))
            await plain.close()
            bad = await d.env.reset({"prompt": "p", "setup": 17})  # a data problem
            results.append(await bad.step("<code>1</code>"))
            await bad.close()
            return results

        value, expr, printed, error, plain, bad = d.run(go())
    finally:
        d.close()
    assert value.observation == "\n<interpreter>\n4821\n</interpreter>\n", value
    assert "\n69\n" in expr.observation and "error" not in expr.info
    assert printed.observation == "\n<interpreter>\n4821\n</interpreter>\n"  # once; None not
    assert "ZeroDivisionError" in error.observation and error.info["error"] == "exception"
    assert "\nFalse\n" in plain.observation
    assert "the task's prelude (row field 'setup', env.options.prelude_key) is a int" in (
        bad.observation
    )
    assert bad.info["error"] == "prelude" and not bad.done


SHOW = "__laminar_v is None or print(repr(__laminar_v))"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("x", f"__laminar_v = (x); {SHOW}"),
        ("(x)", f"__laminar_v = ((x)); {SHOW}"),
        ("a = 1; a + 1  # c", f"a = 1; __laminar_v = (a + 1); {SHOW}  # c"),
        ("f(\n  1)\n", f"__laminar_v = (f(\n  1)); {SHOW}\n"),
        ("print(x)", "print(x)"),
        ("x = 1", "x = 1"),
        ("for i in r:\n    i", "for i in r:\n    i"),
        ("1 +", "1 +"),
        ("", ""),
    ],
)
def test_print_last_rewrites_only_a_last_expression(code: str, expected: str) -> None:
    out = print_last_value(code)
    assert out == expected
    assert out.count("\n") == code.count("\n")  # line numbers kept


def test_options_are_validated_from_config() -> None:
    bad = [
        ({"isolation": "sandboxed"}, "isolation must be one of auto, bwrap, namespaces, none"),
        ({"backend": "sandbox_fusion"}, "backend sandbox_fusion needs url"),
        ({"memory_mb": 0}, "memory_mb must be a positive integer"),
        ({"workers": 0}, "workers must be >= 1"),
        ({"memroy_mb": 1}, "unknown config key 'env.options.memroy_mb'"),
    ]
    for options, message in bad:
        with pytest.raises(ConfigError, match=message):
            make_environment(EnvConfig(name="python_sandbox", options=options))


def test_missing_isolation_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(iso.os, "geteuid", lambda: 0)
    monkeypatch.setattr(iso.shutil, "which", lambda tool: None)
    with pytest.raises(IsolationUnavailable) as err:
        iso.candidates("auto")
    msg = str(err.value)
    assert "bwrap: not installed (fix: apt-get install bubblewrap)" in msg
    assert "namespaces: unshare(1) not found" in msg
    assert "env.options.isolation=none" in msg and "sandbox_fusion" in msg
    with pytest.raises(IsolationUnavailable, match=r"'bwrap' is not available"):
        iso.candidates("bwrap")
    assert iso.candidates("none") == (["none"], [])
    monkeypatch.setattr(iso.os, "geteuid", lambda: 1000)
    with pytest.raises(IsolationUnavailable, match=r"needs root on the host.*uid 1000"):
        iso.candidates("namespaces")


def test_a_failing_bwrap_falls_back_or_is_refused(
    local: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for the fallback")
    real_which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda tool: "/bin/false" if tool == "bwrap" else real_which(tool)
    )

    async def start(isolation: str) -> str:
        pool = SandboxPool(isolation=isolation, workers=1)
        try:
            await pool.start()
            r = await pool.run("print('ran')", 5.0)
            assert r.stdout == "ran\n"
            return pool.isolation
        finally:
            await pool.close()

    assert asyncio.run(start("auto")) == "namespaces"
    with pytest.raises(IsolationUnavailable, match=r"'bwrap' is not available.*bwrap: exited"):
        asyncio.run(start("bwrap"))


def test_isolation_none_says_so_loudly(local: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="laminar.sandbox")

    async def go() -> str:
        pool = SandboxPool(isolation="none", workers=1)
        await pool.start()
        try:
            return (await pool.run("import socket; print(socket.gethostname())", 5.0)).stdout
        finally:
            await pool.close()

    hostname = asyncio.run(go())
    assert hostname.strip() != "sandbox"  # the host's own: no namespaces
    assert "isolation=none: model-written code runs WITHOUT namespaces" in caplog.text

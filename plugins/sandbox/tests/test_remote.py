"""The SandboxFusion client, against a tiny local STAND-IN for a SandboxFusion server.

The stand-in below is not SandboxFusion: it speaks the part of its HTTP API the client uses
(``POST /run_code``, the request and response fields) and runs the tests' own snippets with
a plain subprocess -- no isolation: it only ever runs this file's code. A real service is
not reachable from CI; the request/answer shapes follow SandboxFusion's API documentation.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from laminar_core import EnvConfig, EnvContext, EnvFailure, Environment, make_environment
from laminar_core.testing import check_environment
from laminar_sandbox import SandboxFusionClient


class StandIn:
    """The stand-in server's state: requests seen, failures to inject."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next: list[int] = []  # HTTP statuses to answer with first
        self.sandbox_error = False


def _run(req: dict[str, Any]) -> dict[str, Any]:
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", req["code"]],
            capture_output=True,
            text=True,
            timeout=req.get("run_timeout", 10),
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": out, "stderr": ""}
        return {"status": "Failed", "message": "", "run_result": run}
    run = {
        "status": "Finished",
        "execution_time": 0.01,
        "return_code": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
    }
    status = "Success" if proc.returncode == 0 else "Failed"
    return {"status": status, "message": "", "compile_result": None, "run_result": run}


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[str, StandIn]]:
    state = StandIn()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append(body)
            if self.path != "/run_code":
                return self._answer(404, {"detail": "Not Found"})
            if state.fail_next:
                return self._answer(state.fail_next.pop(0), {"detail": "injected"})
            if state.sandbox_error:
                return self._answer(200, {"status": "SandboxError", "message": "pod died"})
            return self._answer(200, _run(body))

        def _answer(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code", state
    server.shutdown()
    server.server_close()


def _client(url: str, **kw: Any) -> SandboxFusionClient:
    return SandboxFusionClient(url, workers=2, backoff_s=0.01, **kw)


def test_runs_code_and_maps_the_answers(standin: tuple[str, StandIn]) -> None:
    url, state = standin

    async def go() -> None:
        client = _client(url, memory_mb=256)
        await client.start()
        ok = await client.run("print(6 * 7)", 5.0)
        assert (ok.status, ok.stdout, ok.exit_code) == ("ok", "42\n", 0)
        req = state.requests[-1]
        assert req["code"] == "print(6 * 7)" and req["language"] == "python"
        assert req["run_timeout"] == 5.0 and req["memory_limit_MB"] == 256
        err = await client.run("raise ValueError('boom')", 5.0)
        assert err.status == "error" and "ValueError: boom" in err.stderr
        # the service reports no limit but time: a MemoryError is the code's (it could raise one)
        mem = await client.run("raise MemoryError", 5.0)
        assert mem.status == "error" and "MemoryError" in mem.stderr and not mem.message
        slow = await client.run("import time; time.sleep(30)", 0.5)
        assert slow.status == "timeout" and "timed out after 0.5 s" in slow.message
        await client.close()

    asyncio.run(go())


def test_retries_then_fails_clearly(standin: tuple[str, StandIn]) -> None:
    url, state = standin

    async def go() -> None:
        client = _client(url, retries=3)
        await client.start()
        state.fail_next = [503, 504]  # a busy gateway: retried, then it works
        assert (await client.run("print(1)", 5.0)).stdout == "1\n"
        assert client.stats["retries"] == 2
        state.fail_next = [502, 502, 502]
        with pytest.raises(EnvFailure, match=r"unreachable after 3 attempts.*HTTP 502"):
            await client.run("print(1)", 5.0)
        state.fail_next = [400]
        with pytest.raises(EnvFailure, match=r"rejected the request.*HTTP 400"):
            await client.run("print(1)", 5.0)
        state.sandbox_error = True
        try:
            with pytest.raises(EnvFailure, match=r"answered 'SandboxError': pod died"):
                await client.run("print(1)", 5.0)
        finally:
            state.sandbox_error = False
        down = _client("http://127.0.0.1:9/run_code", retries=2)  # nothing listens on 9
        await down.start()
        with pytest.raises(EnvFailure, match=r"unreachable after 2 attempts"):
            await down.run("print(1)", 5.0)

    asyncio.run(go())


def test_bad_url_is_refused_at_start() -> None:
    with pytest.raises(EnvFailure, match=r"options.url must be"):
        asyncio.run(SandboxFusionClient("localhost:8080").start())


def test_python_sandbox_on_sandbox_fusion_passes_the_contract(
    standin: tuple[str, StandIn],
) -> None:
    url, _ = standin

    def make(ctx: EnvContext) -> Environment:
        return make_environment(
            EnvConfig(
                name="python_sandbox",
                max_turns=ctx.max_turns,
                timeout_s=ctx.timeout_s,
                parser="tool_call",
                options={"backend": "sandbox_fusion", "url": url, "workers": 2},
            )
        )

    call = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
    asyncio.run(
        check_environment(
            make,
            row={"prompt": "p"},
            parser="tool_call",
            tool_turn=call % "print(6 * 7)",
            answer_turn="42",
            slow_turn=call % "import time; time.sleep(30)",
            bad_turn="<tool_call>{not json}</tool_call>",
            timeout_s=3.0,
        )
    )

"""A client for a remote SandboxFusion service, the sandbox verl's ReTool recipe uses.

SandboxFusion (github.com/bytedance/SandboxFusion) runs code on a cluster's sandbox servers:
``POST {url}`` (``.../run_code``) with ``{"code", "language", "run_timeout",
"compile_timeout", "memory_limit_MB"?}`` answers ``{"status": "Success" | "Failed" |
"SandboxError", "message", "run_result": {"status": "Finished" | "Error" |
"TimeLimitExceeded", "return_code", "stdout", "stderr", "execution_time"}, ...}``.

Mapping: ``TimeLimitExceeded`` -> ``timeout``; exit 0 -> ``ok``; other exits -> ``error``
(``memory`` when the code died of ``MemoryError``). Connection errors and HTTP 5xx are
retried (``retries`` attempts, backing off); when the service stays unreachable, answers
``SandboxError`` or rejects the request (4xx), the run raises ``EnvFailure``: the service is
broken, not the model's code. The isolation is the service's, not this package's.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from laminar_core import EnvFailure, EnvUnavailable
from laminar_sandbox.result import CodeExecutor, RunResult


class SandboxFusionClient(CodeExecutor):
    """Runs code on a SandboxFusion service; at most ``workers`` requests in flight."""

    isolation = "remote"

    def __init__(
        self,
        url: str,
        workers: int = 4,
        language: str = "python",
        memory_mb: int | None = None,
        output_bytes: int = 16384,
        retries: int = 3,
        backoff_s: float = 0.5,
        request_slack_s: float = 30.0,
    ) -> None:
        self.url = url
        self.language = language
        self.memory_mb = memory_mb
        self.output_bytes = output_bytes
        self.retries = max(1, retries)
        self.backoff_s = backoff_s
        self.request_slack_s = request_slack_s
        self.workers = workers
        self._sem: asyncio.Semaphore | None = None
        self.stats = {"runs": 0, "timeouts": 0, "retries": 0}

    async def start(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise EnvUnavailable(
                f"python_sandbox: options.url must be the service's http(s) run_code address "
                f"(e.g. http://sandbox:8080/run_code), got {self.url!r}"
            )
        self._sem = asyncio.Semaphore(self.workers)

    async def close(self) -> None:
        self._sem = None

    async def run(self, code: str, timeout_s: float) -> RunResult:
        if self._sem is None:
            raise EnvFailure("python_sandbox: the SandboxFusion client is not started")
        payload: dict[str, Any] = {
            "code": code,
            "language": self.language,
            "run_timeout": timeout_s,
            "compile_timeout": timeout_s,
        }
        if self.memory_mb:
            payload["memory_limit_MB"] = self.memory_mb
        async with self._sem:
            answer = await self._post(payload, timeout_s + self.request_slack_s)
        self.stats["runs"] += 1
        return self._result(answer, timeout_s)

    async def _post(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        body = json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return await asyncio.to_thread(self._request, body, timeout)
            except urllib.error.HTTPError as e:
                if e.code < 500:  # the request is wrong: retrying will not help
                    raise EnvFailure(
                        f"python_sandbox: {self.url} rejected the request (HTTP {e.code}: "
                        f"{_body(e)})"
                    ) from None
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = str(getattr(e, "reason", e))
        raise EnvFailure(
            f"python_sandbox: SandboxFusion at {self.url} unreachable after {self.retries} "
            f"attempts (last: {last})"
        )

    def _request(self, body: bytes, timeout: float) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url,
            data=body,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer = json.loads(resp.read())
        if not isinstance(answer, dict):
            raise ValueError(f"answer is not a JSON object: {str(answer)[:100]}")
        return answer

    def _result(self, answer: dict[str, Any], timeout_s: float) -> RunResult:
        status = answer.get("status")
        run = answer.get("run_result") or {}
        if status == "SandboxError" or (status not in ("Success", "Failed")):
            raise EnvFailure(
                f"python_sandbox: SandboxFusion at {self.url} answered {status!r}: "
                f"{str(answer.get('message', ''))[:300]}"
            )
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        out_b, err_b = stdout.encode(), stderr.encode()
        r = RunResult(
            "ok",
            stdout=out_b[: self.output_bytes].decode(errors="replace"),
            stderr=err_b[-self.output_bytes :].decode(errors="replace"),
            exit_code=run.get("return_code"),
            stdout_bytes=len(out_b),
            stderr_bytes=len(err_b),
            wall_s=float(run.get("execution_time") or 0.0),
        )
        if run.get("status") == "TimeLimitExceeded":
            self.stats["timeouts"] += 1
            r.status = "timeout"
            r.message = f"timed out after {timeout_s:g} s (wall-clock limit); the run was killed"
        elif r.exit_code not in (0, None) or status == "Failed":
            # the service says nothing about memory: a MemoryError in the code's stderr is
            # the code's exception (it could raise or print one), not an observed limit
            r.status = "error"
        return r


def _body(e: urllib.error.HTTPError) -> str:
    try:
        return e.read().decode(errors="replace")[:200]
    except Exception:
        return ""

"""The gateway on HTTP: FastAPI routes served by uvicorn, in the caller's event loop.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
``/v1/models/{id}``), with the session's key as ``Authorization: Bearer``; ``GET /health``
without one. The key is checked before the body is read, so a forged or closed key is
refused without touching any session. Every refusal is OpenAI's error body (an unknown
route and a wrong method too); an unexpected failure is a 500 with the exception named,
and the server goes on.

``GatewayServer`` runs uvicorn as a task of the running event loop (the one the backend's
engines live in), on a port of its own choosing by default; it leaves signal handling to
the program that runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from laminar_core.gateway.errors import GatewayError, bad_request
from laminar_core.gateway.responses import body as response_body
from laminar_core.gateway.responses import sse_events
from laminar_core.gateway.service import CallResult, Gateway

log = logging.getLogger(__name__)

__all__ = ["GatewayServer", "create_app"]


def create_app(gateway: Gateway) -> Any:
    """The FastAPI application serving ``gateway``."""
    app = FastAPI(title="Laminar agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: GatewayError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, e: GatewayError) -> JSONResponse:
        return error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        what = "no such route" if e.status_code == 404 else str(e.detail)
        return error(
            GatewayError(
                e.status_code,
                f"{request.method} {request.url.path}: {what} (the gateway serves "
                "/v1/chat/completions, /v1/completions, /v1/models)",
            )
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("gateway call failed")
        return error(
            GatewayError(
                500,
                f"the gateway failed on this call: {type(e).__name__}: {e}",
                type="server_error",
            )
        )

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    def respond(r: CallResult) -> Any:
        if r.stream:
            return StreamingResponse(
                _iterate(sse_events(r)), media_type="text/event-stream", headers=r.headers
            )
        return JSONResponse(response_body(r), headers=r.headers)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.authenticate(request.headers.get("authorization"))
        return gateway.models()

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        gateway.authenticate(request.headers.get("authorization"))
        for m in gateway.models()["data"]:
            if m["id"] == model:
                return m
        raise GatewayError(404, f"the model {model!r} does not exist", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        session = gateway.authenticate(request.headers.get("authorization"))
        return respond(await gateway.chat(session, await read_json(request)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        session = gateway.authenticate(request.headers.get("authorization"))
        return respond(await gateway.complete(session, await read_json(request)))

    return app


async def _iterate(events: Iterator[str]) -> AsyncIterator[str]:
    # an async iterator: Starlette would run a plain one on a worker thread
    for event in events:
        yield event


class GatewayServer:
    """Serves ``gateway`` on ``host:port`` (``port=0``: a free port) from the running event
    loop. ``await start()`` returns the base URL (``http://host:port/v1``, also set as
    ``gateway.base_url``); ``await stop()`` shuts it down and closes its socket."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0) -> None:
        self.gateway = gateway
        self.host = host
        self.port = port
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    async def start(self) -> str:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # the run handles signals
                yield

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.gateway),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
        )
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the gateway's HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        self.gateway.base_url = f"http://{self.host}:{self.port}/v1"
        return self.gateway.base_url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

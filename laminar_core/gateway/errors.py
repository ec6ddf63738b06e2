"""Errors the gateway answers with, in OpenAI's shape.

Every refusal is a :class:`GatewayError`: an HTTP status and the body OpenAI's API sends
(``{"error": {"message", "type", "param", "code"}}``), so an agent's client raises the
exception it would raise against OpenAI (``BadRequestError``, ``AuthenticationError``,
``RateLimitError``, ...). The message names the problem and the fix; a refused call changes
nothing in any session.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GatewayError", "bad_request", "budget_exhausted", "unauthorized", "unavailable"]


class GatewayError(Exception):
    """A call the gateway refuses: ``status``, OpenAI's error ``type``/``code``/``param``,
    and extra response ``headers`` (``Retry-After``, ``x-should-retry``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    """A 400: the request itself is wrong (``param`` names the field)."""
    return GatewayError(400, message, param=param, code=code)


def unauthorized(message: str) -> GatewayError:
    """A 401 with OpenAI's ``invalid_api_key`` code."""
    return GatewayError(401, message, code="invalid_api_key")


def budget_exhausted(message: str, code: str) -> GatewayError:
    """A 429 for a session budget that is spent. ``x-should-retry: false`` tells the
    ``openai`` client not to retry: waiting does not refill a session's budget."""
    return GatewayError(
        429, message, type="insufficient_quota", code=code, headers={"x-should-retry": "false"}
    )


def unavailable(message: str, retry_after_s: float = 1.0) -> GatewayError:
    """A 503: no replica could serve the call now; the client may retry after a while."""
    return GatewayError(
        503,
        message,
        type="server_error",
        code="replica_unavailable",
        headers={"Retry-After": str(max(1, round(retry_after_s)))},
    )

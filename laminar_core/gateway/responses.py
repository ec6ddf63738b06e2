"""A served call written in OpenAI's shapes: a ``chat.completion`` / ``text_completion``
object, or the chunks of its server-sent-event stream.

Every response carries a ``laminar`` object (session, sample, call, weight version,
replica, sampling) besides OpenAI's fields; the ``openai`` client keeps unknown fields.

Streams are written once the turn is generated (the engine returns a turn whole): the
role, the content in pieces, each tool call (its name, then its arguments), the finish
reason, the usage when ``stream_options.include_usage`` asks, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from laminar_core.gateway.service import CallResult

__all__ = ["body", "sse_events"]

_PIECE = 16  # characters per streamed content chunk


def _usage(r: CallResult) -> dict[str, int]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


def body(r: CallResult) -> dict[str, Any]:
    """The non-streamed response."""
    if r.kind == "chat":
        assert r.turn is not None
        message: dict[str, Any] = {
            "role": "assistant",
            "content": r.turn.content,
            "refusal": None,
        }
        if r.turn.tool_calls:
            message["tool_calls"] = r.turn.tool_calls
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": r.finish_reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
        obj = "text_completion"
    return {
        "id": r.id,
        "object": obj,
        "created": r.created,
        "model": r.model,
        "choices": [choice],
        "usage": _usage(r),
        "system_fingerprint": None,
        "laminar": r.laminar,
    }


def _chunks(r: CallResult) -> Iterator[dict[str, Any]]:
    base = {"id": r.id, "created": r.created, "model": r.model, "system_fingerprint": None}
    if r.kind == "chat":
        assert r.turn is not None
        obj = "chat.completion.chunk"

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {**base, "object": obj, "choices": [choice]}

        yield {**chunk({"role": "assistant", "content": ""}), "laminar": r.laminar}
        content = r.turn.content or ""
        for i in range(0, len(content), _PIECE):
            yield chunk({"content": content[i : i + _PIECE]})
        for i, call in enumerate(r.turn.tool_calls):
            fn = call["function"]
            yield chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            )
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        yield chunk({}, r.finish_reason)
    else:
        obj = "text_completion"

        def text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            return {**base, "object": obj, "choices": [choice]}

        pieces = [r.text[i : i + _PIECE] for i in range(0, len(r.text), _PIECE)]
        for i, piece in enumerate([*pieces, ""]):
            c = text_chunk(piece, None if i < len(pieces) else r.finish_reason)
            yield {**c, "laminar": r.laminar} if i == 0 else c
    if r.include_usage:
        yield {**base, "object": obj, "choices": [], "usage": _usage(r)}


def sse_events(r: CallResult) -> Iterator[str]:
    """The stream as server-sent events, ending with ``data: [DONE]``."""
    for c in _chunks(r):
        yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"

"""OpenAI chat messages and tools, checked and normalised.

A request's ``messages`` become :class:`Message` values: the role, the text (text parts
joined; ``None`` is ``""``), tool calls as (name, arguments) with the arguments parsed from
their JSON string. Two messages are *the same* when these agree (``Message.key``): the
message-level test a call's history passes to extend its session's sample, so the ids a
client gives tool calls and the spacing of their JSON do not matter. Anything malformed is
a 400 naming the field (``messages[2].tool_calls[0].function.arguments``).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from laminar_core.gateway.errors import bad_request

__all__ = ["Message", "ToolCallMessage", "parse_messages", "parse_tools", "tools_key"]

ROLES = ("system", "developer", "user", "assistant", "tool")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class ToolCallMessage:
    """One tool call of an assistant message: ``arguments`` is the parsed JSON object (or
    the raw string when it is not JSON: kept, compared and rendered as sent)."""

    name: str
    arguments: Any
    id: str = ""

    def key(self) -> tuple[str, str]:
        return (self.name, _canonical(self.arguments))


@dataclass(frozen=True)
class Message:
    """A chat message as the gateway compares and renders it."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCallMessage, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def key(self) -> tuple[Any, ...]:
        """What must agree for two messages to be the same turn (ids do not count)."""
        return (self.role, self.content, tuple(c.key() for c in self.tool_calls), self.name)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"{where}[{i}]: only text content parts are supported, got {kind!r}",
                    param=f"{where}[{i}]",
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{i}].text must be a string", param=f"{where}[{i}]")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request(
        f"{where} must be a string or a list of text parts, got {type(content).__name__}",
        param=where,
    )


def _tool_calls(raw: Any, where: str) -> tuple[ToolCallMessage, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list", param=where)
    calls = []
    for i, call in enumerate(raw):
        at = f"{where}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise bad_request(f"{at}.function must be an object", param=f"{at}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{at}.function.name must be 1-64 letters, digits, '_', '-', '.', ':'",
                param=f"{at}.function.name",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            # not JSON: kept as the string the model (or the agent) wrote
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args) if args.strip() else {}
        calls.append(ToolCallMessage(name, args, str(call.get("id") or "")))
    return tuple(calls)


def parse_messages(raw: Any) -> list[Message]:
    """The request's ``messages`` as :class:`Message` values; a 400 naming the field when
    they are missing or malformed. ``developer`` is read as ``system``."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(raw):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{at} must be an object", param=at)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(
                f"{at}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{at}.role"
            )
        if role == "developer":
            role = "system"
        content = _text(m.get("content"), f"{at}.content")
        calls = _tool_calls(m.get("tool_calls"), f"{at}.tool_calls") if role == "assistant" else ()
        if role != "assistant" and m.get("tool_calls"):
            raise bad_request(f"{at}: only assistant messages have tool_calls", param=at)
        tool_call_id = m.get("tool_call_id")
        if role == "tool" and tool_call_id is not None and not isinstance(tool_call_id, str):
            raise bad_request(f"{at}.tool_call_id must be a string", param=f"{at}.tool_call_id")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{at}.name must be a string", param=f"{at}.name")
        out.append(Message(role, content, calls, tool_call_id if role == "tool" else None, name))
    return out


def parse_tools(raw: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` (OpenAI function tools) as given; a 400 naming the field
    when one is malformed."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools")
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{at} must be a function tool", param=at)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{at}.function.name is missing", param=f"{at}.function.name")
        if not _NAME.match(fn["name"]):
            raise bad_request(
                f"{at}.function.name must be 1-64 letters, digits, '_', '-', '.', ':'",
                param=f"{at}.function.name",
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{at}.function.parameters must be an object", param=at)
    return list(raw)


def tools_key(tools: list[dict[str, Any]]) -> str:
    """The tools' identity: calls with other tools render another context (no extension)."""
    return _canonical(tools)

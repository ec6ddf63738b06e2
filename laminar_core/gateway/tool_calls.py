"""The model's turn as an OpenAI assistant message: content and ``tool_calls``.

Calls are read by the run's tool-call parser (plugin kind ``parser``, the same registry
environments use; ``tool_call`` reads Hermes/Qwen ``<tool_call>{json}</tool_call>``). A
turn with a call the parser could not read (invalid JSON, no name) is returned whole as
content, with no ``tool_calls``: the agent sees what the model wrote, as it would from a
hosted model that produced no valid call, and the run goes on.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from laminar_core.gateway.messages import Message, ToolCallMessage
from laminar_core.interfaces.environment import ToolCallParser

__all__ = ["AssistantTurn", "read_turn"]


@dataclass(frozen=True)
class AssistantTurn:
    """The model's turn as returned: ``content`` (``None`` when only calls remain) and
    ``tool_calls`` in OpenAI's wire shape; ``malformed``: it held a call the parser could
    not read (so all of it is content)."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    malformed: bool = False

    def message(self) -> Message:
        """The turn as the agent will send it back (what the next call must repeat)."""
        calls = tuple(
            ToolCallMessage(c["function"]["name"], json.loads(c["function"]["arguments"]), c["id"])
            for c in self.tool_calls
        )
        return Message("assistant", self.content or "", calls)


def read_turn(text: str, parser: ToolCallParser | None) -> AssistantTurn:
    """``text`` (the turn's decoded text) split into content and tool calls by ``parser``
    (``None``: no tools offered, or ``tool_choice: none``: all content)."""
    calls = parser.parse(text) if parser is not None and text else []
    if not calls:
        return AssistantTurn(text, [])
    if any(c.error for c in calls):
        return AssistantTurn(text, [], malformed=True)
    content = text
    for c in calls:
        content = content.replace(c.text, "", 1)
    return AssistantTurn(
        content.strip() or None,
        [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": json.dumps(c.arguments, ensure_ascii=False),
                },
            }
            for c in calls
        ],
    )

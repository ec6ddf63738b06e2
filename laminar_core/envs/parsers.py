"""Tool-call parsers: how a model's turn names a tool call, and how the output comes back.

Two formats ship with core (plugin kind ``parser``):

* ``code`` -- ReTool's: code in ``<code>...</code>`` (its body may be a fenced
  ```` ```python ```` block), output appended as ``<interpreter>...</interpreter>``. With no
  ``<code>`` tag in the turn, bare fenced ```` ```python ```` blocks are calls (``fenced``).
* ``tool_call`` -- OpenAI-style function calls as Qwen/Hermes chat templates emit them:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, output appended as
  ``<tool_response>...</tool_response>``.

Both read a call whose closing tag is missing at the very end of the turn (generation stopped
at the stop string, which engines leave out of the text by default). Renderings are set by
``response_template`` (``{output}`` marks where the output goes): a chat-templated model wants
its template's turn markup there, e.g. for Qwen2.5::

    "<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n"
    "<|im_start|>assistant\\n"

The output is the tool's, i.e. whatever the model's code printed: in it, the parser's tags
(its call tag and every ``<tag>`` of the template, any case) are escaped (``<`` becomes
``&lt;``), so nothing printed can close the output or open a call; and :meth:`render` names
the template's text as the observation's markup, so only that is tokenised with control
tokens (the output's ``<|im_end|>`` stays plain text).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from laminar_core.interfaces.environment import Spans, ToolCall, ToolCallParser

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_FENCE_PY = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def _template(template: str, where: str) -> str:
    if "{output}" not in template:
        raise ValueError(f"{where}: response_template must contain '{{output}}', got {template!r}")
    return template


class _TemplateParser(ToolCallParser):
    """Renders outputs through ``response_template`` with the parser's tags escaped."""

    call_tag = ""

    def __init__(self, response_template: str, where: str) -> None:
        self.response_template = _template(response_template, where)
        self.prefix, suffix = response_template.split("{output}", 1)
        self.suffix = suffix.replace("{output}", "")  # the output goes in once
        tags = {self.call_tag, *re.findall(r"</?([A-Za-z_][\w.-]*)>", response_template)}
        alternatives = "|".join(re.escape(t) for t in sorted(tags) if t)
        self._tags = re.compile(rf"<(?=/?(?:{alternatives})>)", re.IGNORECASE)

    def escape(self, output: str) -> str:
        """``output`` with the parser's tags neutralised: ``</interpreter>`` becomes
        ``&lt;/interpreter>``, which no parser reads and no model takes for markup."""
        return self._tags.sub("&lt;", output)

    def format_response(self, output: str) -> str:
        return self.prefix + self.escape(output) + self.suffix

    def render(self, outputs: Sequence[str]) -> tuple[str, Spans]:
        text, spans = "", []
        for output in outputs:
            spans.append((len(text), len(text) + len(self.prefix)))
            text += self.prefix + self.escape(output)
            spans.append((len(text), len(text) + len(self.suffix)))
            text += self.suffix
        return text, tuple((a, b) for a, b in spans if b > a)


def _tagged(text: str, tag: str) -> list[re.Match[str]]:
    """``<tag>body</tag>`` spans, plus an unclosed ``<tag>body`` at the end of the text.

    An unclosed body loses a cut-off closing tag at its end (``</code``): a turn that ended
    at the stop string ``</tag>`` can carry part of it, e.g. when its text is decoded from
    the engine's token ids (the engine's stop check runs on text, not on token bounds).
    """
    close = f"</{tag}>"
    partial = "|".join(re.escape(close[:k]) for k in range(len(close) - 1, 1, -1))
    pattern = rf"<{tag}>(.*?)(?:{re.escape(close)}|(?:{partial})?\Z)"
    return list(re.finditer(pattern, text, re.DOTALL))


class CodeBlockParser(_TemplateParser):
    """ReTool's format: ``<code>`` blocks (or bare fenced ```` ```python ```` ones) run as
    calls of tool ``tool`` with argument ``code``.

    ``fenced``: read bare ```` ```python ```` / ```` ```py ```` fences when the turn has no
    ``<code>`` tag (an untagged fence in a turn that has ``<code>`` tags is prose).
    """

    stop = ("</code>",)
    call_tag = "code"

    def __init__(
        self,
        response_template: str = "\n<interpreter>\n{output}\n</interpreter>\n",
        fenced: bool = True,
        tool: str = "python",
    ) -> None:
        super().__init__(response_template, "parser 'code'")
        self.fenced = fenced
        self.tool = tool

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for m in _tagged(text, "code"):
            body = m.group(1)
            fence = _FENCE.search(body)
            calls.append(self._call(fence.group(1) if fence else body, m.group(0)))
        if not calls and self.fenced:
            calls = [self._call(m.group(1), m.group(0)) for m in _FENCE_PY.finditer(text)]
        return calls

    def _call(self, code: str, span: str) -> ToolCall:
        if not code.strip():
            return ToolCall(self.tool, {"code": code}, span, error="empty code block")
        return ToolCall(self.tool, {"code": code.strip("\n")}, span)


class JsonToolCallParser(_TemplateParser):
    """OpenAI-style calls in ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.

    ``arguments`` may be an object or a JSON string holding one (OpenAI's wire form). A call
    that is not valid JSON, or lacks a name, comes back with ``error`` set.
    """

    stop = ("</tool_call>",)
    call_tag = "tool_call"

    def __init__(
        self, response_template: str = "\n<tool_response>\n{output}\n</tool_response>\n"
    ) -> None:
        super().__init__(response_template, "parser 'tool_call'")

    def parse(self, text: str) -> list[ToolCall]:
        return [self._call(m.group(1).strip(), m.group(0)) for m in _tagged(text, "tool_call")]

    @staticmethod
    def _call(body: str, span: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", {}, span, error=f"tool call is not valid JSON ({e.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ToolCall("", {}, span, error='tool call needs {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return ToolCall(obj["name"], {}, span, error=f"arguments are not JSON ({e.msg})")
        if not isinstance(args, dict):
            return ToolCall(obj["name"], {}, span, error="arguments must be a JSON object")
        return ToolCall(obj["name"], args, span)

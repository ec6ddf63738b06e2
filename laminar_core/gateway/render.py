"""Chat messages to token ids with the model's chat template, untrusted text kept plain.

The template is rendered with every piece of text that came from the agent (message
contents, names, tool-call ids, names and arguments, tool definitions) replaced by a
placeholder; the rendered string is then cut at the placeholders. The template's own text
(its scaffolding: ``<|im_start|>user\\n``, ``<|im_end|>``, ...) is encoded with special
tokens parsed, so its control tokens are the real ones; every placeholder's text is
encoded with :func:`laminar_core.text.encode_untrusted`, so a tool output that prints
``<|im_end|>`` stays characters and can never close or open a turn.

A placeholder the template printed through ``tojson`` (a tool definition, a tool call's
arguments) comes back quoted and is replaced by the value's JSON, as ``tojson`` writes it.
A template that does more than print the agent's text (cuts it, or reads fields of a tool
definition) is detected: for tools the definitions are then rendered as given, after a
check that they hold no special-token string; anything else is refused at start.

Continuations: a call that extends a sample sends the messages already in it plus new
ones. The new tokens are the template's rendering of the whole conversation minus its
rendering of the messages already in the sample (both with placeholders, so the model's
own turns are compared as messages, never re-tokenised); this is what the model would see
after its last turn with the template's tail after an assistant message (``<|im_end|>\\n``
less the end token the model sampled itself). A template whose rendering of earlier
messages changes when more follow (it rewrites history) cannot be extended: the call forks.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from laminar_core.gateway.errors import bad_request
from laminar_core.gateway.messages import Message
from laminar_core.text import encode_untrusted

__all__ = ["ChatRenderer", "compile_template"]


def compile_template(template: str) -> Any:
    """``template`` compiled as transformers' ``apply_chat_template`` compiles it (a
    sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, loop controls, a
    ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``; a
    ``{% generation %}`` block renders its body). Our own, because transformers checks
    tool definitions before rendering and a placeholder is not one."""
    import datetime

    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - installed with transformers' chat templates
        raise ImportError(
            f"the gateway renders chat templates with jinja2 ({e}): pip install jinja2"
        ) from e

    class _Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


class ChatRenderer:
    """Renders chat messages into token ids (see the module docstring).

    ``stop_token_ids``: the template's end-of-turn token (what the engine stops a turn at).
    Raises ``ValueError`` naming the problem when the tokenizer has no chat template or the
    template cannot be rendered this way.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError(
                "the model's tokenizer has no chat template; give the gateway one "
                "(GatewaySettings.chat_template)"
            )
        self._compiled = compile_template(self.template)
        self._template_kwargs = {
            k: str(v)
            for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
            if isinstance(v, str)
        }
        self._mark = f"@@LMN{secrets.token_hex(4)}_"
        mark = re.escape(self._mark)
        self._pattern = re.compile(rf'"{mark}(\d+)@@"|{mark}(\d+)@@')
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._specials = set(getattr(tokenizer, "all_special_ids", None) or [])
        self._specials.update(i for i, t in decoder.items() if getattr(t, "special", False))
        self._special_strings = [
            s
            for s in {*getattr(tokenizer, "all_special_tokens", []), *map(str, decoder.values())}
            if s
        ]
        self.tools_by_placeholder = self._probe_tools()
        self._probe_suffix()

    # -- set-up ------------------------------------------------------------------------------
    def _probe_suffix(self) -> None:
        user = [Message("user", "x")]
        try:
            gen, _ = self._render(user, [], True)
            full, _ = self._render([*user, Message("assistant", "y")], [], False)
        except Exception as e:
            raise ValueError(f"the chat template does not render a plain conversation: {e}") from e
        reply = f"{self._mark}1@@"
        if not full.startswith(gen) or not full[len(gen) :].startswith(reply):
            raise ValueError(
                "the chat template's generation prompt is not where its assistant message "
                "starts; the gateway cannot capture turns with it (give it a template whose "
                "rendering of [user, assistant] extends the generation prompt)"
            )
        suffix = full[len(gen) + len(reply) :]
        self._suffix = suffix
        self.suffix_ids = self._scaffold(suffix)
        first = self.suffix_ids[0] if self.suffix_ids else None
        self.end_token_id: int | None = first if first in self._specials else None
        self.stop_token_ids = [] if self.end_token_id is None else [self.end_token_id]

    def _probe_tools(self) -> bool:
        """Whether the template prints tool definitions whole (``tojson``), so they can be
        placeholders; else they are rendered as given (after a special-token check)."""
        mark = f"{self._mark}0@@"
        try:
            text = self._apply([{"role": "user", "content": "x"}], [mark], True)
        except Exception:
            return False
        return f'"{mark}"' in text

    # -- rendering ---------------------------------------------------------------------------
    def _apply(self, conv: list[dict[str, Any]], tools: list[Any], gen: bool) -> str:
        return self._compiled.render(
            messages=conv,
            tools=tools or None,
            documents=None,
            add_generation_prompt=gen,
            **self._template_kwargs,
        )

    def _render(
        self, messages: Sequence[Message], tools: list[dict[str, Any]], gen: bool
    ) -> tuple[str, list[Any]]:
        slots: list[Any] = []

        def ph(value: Any) -> str:
            slots.append(value)
            return f"{self._mark}{len(slots) - 1}@@"

        tool_args = [ph(t) for t in tools] if self.tools_by_placeholder else list(tools)
        conv = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": ph(m.content) if m.content else ""}
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": ph(c.id) if c.id else "",
                        "type": "function",
                        "function": {"name": ph(c.name), "arguments": ph(c.arguments)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id:
                d["tool_call_id"] = ph(m.tool_call_id)
            if m.name:
                d["name"] = ph(m.name)
            conv.append(d)
        return self._apply(conv, tool_args, gen), slots

    def _scaffold(self, text: str) -> list[int]:
        if self._mark in text:
            raise ValueError(
                "the chat template changes message text instead of printing it (cut, "
                "escaped or filtered); the gateway needs a template that prints it verbatim"
            )
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _encode(self, text: str, slots: list[Any]) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self._pattern.finditer(text):
            ids += self._scaffold(text[pos : m.start()])
            quoted = m.group(1) is not None
            value = slots[int(m.group(1) or m.group(2))]
            if quoted or not isinstance(value, str):
                value = json.dumps(value, ensure_ascii=False)
            ids += encode_untrusted(self.tokenizer, value)
            pos = m.end()
        return ids + self._scaffold(text[pos:])

    def check_tools(self, tools: list[dict[str, Any]]) -> None:
        """A 400 when tools rendered as given (see the module docstring) hold a special-token
        string; nothing to check when the template prints them whole."""
        if self.tools_by_placeholder or not tools:
            return
        text = json.dumps(tools, ensure_ascii=False)
        for s in self._special_strings:
            if s in text:
                raise bad_request(
                    f"tool definitions may not contain the special token {s!r} with this "
                    "model's chat template (it reads the definitions' fields)",
                    param="tools",
                )

    # -- what the gateway uses ---------------------------------------------------------------
    def prompt(self, messages: Sequence[Message], tools: list[dict[str, Any]]) -> list[int]:
        """The ids of a first call: ``messages`` and ``tools`` with the generation prompt."""
        text, slots = self._render(messages, tools, True)
        return self._encode(text, slots)

    def continuation(
        self,
        before: Sequence[Message],
        after: Sequence[Message],
        tools: list[dict[str, Any]],
    ) -> list[int] | None:
        """The ids that follow ``before`` (a sample's messages, ending with the model's
        turn, whose tail :meth:`tail` gives) when the conversation is ``after`` (``before``
        plus new messages), generation prompt included; ``None`` when the template renders
        ``before`` differently once more messages follow (the call cannot extend)."""
        prev, _ = self._render(before, tools, False)
        full, slots = self._render(after, tools, True)
        if not full.startswith(prev) or not prev.endswith(self._suffix):
            return None
        return self._encode(full[len(prev) :], slots)

    def tail(self, sampled: Sequence[int]) -> list[int]:
        """What the template puts after a model turn that sampled ``sampled``: its
        end-of-turn text less the end token when the model wrote it itself (an end of
        sequence, a stop string or a length cut get the whole of it)."""
        if self.end_token_id is not None and sampled and sampled[-1] == self.end_token_id:
            return list(self.suffix_ids[1:])
        return list(self.suffix_ids)

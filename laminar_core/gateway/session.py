"""Sessions: one agent episode's key, budget and samples.

A session holds samples (``capture.Sample``). A call *extends* a sample when its history
is that sample's conversation: the messages of the sample's calls plus the model's turn as
the gateway returned it (compared as messages: role, text, tool calls by name and
JSON-equal arguments), with the same tools; then only the new messages' ids are appended.
Otherwise the call *forks*: it starts a new sample from its own rendering (the agent
trimmed, summarised or rewrote its history, changed its tools, or called concurrently on a
sample a running call is extending), and the samples it does not extend stay as they are,
each a training sample of its own. A call is fitted to the longest sample it extends, so a
side call (a summariser, a sub-agent) forks once and the main loop goes on extending its
own sample.

Everything here is synchronous and runs on the gateway's event loop: choosing a sample and
committing a call cannot interleave with another call's, so no lock is needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from laminar_core.gateway.backend import TurnResult
from laminar_core.gateway.capture import CallRecord, Sample
from laminar_core.gateway.errors import bad_request, budget_exhausted, unauthorized
from laminar_core.gateway.messages import Message
from laminar_core.gateway.render import ChatRenderer
from laminar_core.gateway.settings import SessionBudget
from laminar_core.text import encode_untrusted
from laminar_core.types import Trajectory

__all__ = ["Pending", "Session"]


@dataclass
class Pending:
    """A call between choosing its sample and committing (or abandoning) it."""

    sample: Sample
    new: bool
    observed: list[int]  # ids this call adds before generating (the prompt, for a new sample)
    prompt_ids: list[int]  # what the engine gets
    max_tokens: int
    call_index: int
    reserved: int
    started: float = field(default_factory=time.monotonic)


class Session:
    """One agent episode (see the module docstring). Built by ``Gateway.open_session``."""

    def __init__(
        self,
        session_id: str,
        api_key: str,
        group_id: str,
        metadata: dict[str, Any],
        budget: SessionBudget,
    ) -> None:
        self.id = session_id
        self.api_key = api_key
        self.group_id = group_id
        self.metadata = dict(metadata)
        self.budget = budget
        self.opened = time.monotonic()
        self.closed = False
        self.samples: list[Sample] = []
        self.calls = 0  # calls admitted (a call no replica could serve is given back)
        self.total_tokens = 0  # ids in the session's samples
        self._reserved = 0  # ids running calls may still add
        self._indices = 0
        # call numbers, apart from ``calls``: a given-back call must not hand its number to a
        # later call while a concurrent one already holds a higher number (repeated numbers)
        self._numbers = 0
        self.errors: dict[str, int] = {}

    # -- what the session made ---------------------------------------------------------------
    @property
    def forks(self) -> int:
        """Samples started after the first one."""
        return max(0, sum(1 for s in self.samples if s.calls) - 1)

    def trajectories(self) -> list[Trajectory]:
        """The session's samples with at least one call, as the trainer gets them."""
        return [
            s.trajectory(self.id, self.group_id, self.metadata) for s in self.samples if s.calls
        ]

    def wall_left(self) -> float:
        return self.budget.max_wall_s - (time.monotonic() - self.opened)

    # -- a call ------------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.closed:
            raise unauthorized("this session is closed: its episode is over")
        b = self.budget
        if self.calls >= b.max_calls:
            raise budget_exhausted(
                f"this session has made its {b.max_calls} calls (session budget max_calls)",
                "session_calls_exhausted",
            )
        if self.wall_left() <= 0:
            raise budget_exhausted(
                f"this session has run its {b.max_wall_s:g} s (session budget max_wall_s)",
                "session_time_exhausted",
            )

    def _reserve(self, sample: Sample, new: bool, observed: list[int], want: int) -> Pending:
        b = self.budget
        prompt_ids = observed if new else [*sample.context(), *observed]
        if len(prompt_ids) >= b.max_context_tokens:
            raise bad_request(
                f"this call's prompt is {len(prompt_ids)} tokens; a session's context is at "
                f"most {b.max_context_tokens} (session budget max_context_tokens): shorten "
                "the conversation",
                param="messages",
                code="context_length_exceeded",
            )
        if new and sum(1 for s in self.samples if s.calls) >= b.max_samples:
            raise budget_exhausted(
                f"this session has made {b.max_samples} samples (session budget max_samples): "
                "each call that does not extend an earlier one starts a sample",
                "session_samples_exhausted",
            )
        left = b.max_total_tokens - self.total_tokens - self._reserved - len(observed)
        if left < 1:
            raise budget_exhausted(
                f"this session holds {self.total_tokens} of its {b.max_total_tokens} tokens "
                f"and this call adds {len(observed)} (session budget max_total_tokens)",
                "session_tokens_exhausted",
            )
        max_tokens = min(want, b.max_context_tokens - len(prompt_ids), left)
        pending = Pending(
            sample, new, observed, prompt_ids, max_tokens, self._numbers, len(observed) + max_tokens
        )
        self.calls += 1
        self._numbers += 1
        self._reserved += pending.reserved
        sample.busy = True
        if new:
            self.samples.append(sample)
        return pending

    def _new_sample(self, kind: str, reason: str, tools_key: str = "") -> Sample:
        self._indices += 1
        return Sample(self._indices - 1, kind, [], reason, tools_key=tools_key)

    def _why_new(self, kind: str, tools_key: str = "") -> str:
        mine = [s for s in self.samples if s.kind == kind and s.calls]
        if not mine:
            return "first"
        if kind == "chat" and all(s.tools_key != tools_key for s in mine):
            return "tools_changed"
        return "history_rewritten"

    def prepare_chat(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]],
        tools_key: str,
        renderer: ChatRenderer,
        want: int,
    ) -> Pending:
        """Choose the sample this chat call extends (or start one) and reserve its budget;
        raises a ``GatewayError`` when the session is closed or a budget is spent."""
        self._admit()
        keys = [m.key() for m in messages]
        fits = [
            s
            for s in self.samples
            if s.kind == "chat"
            and s.calls
            and s.tools_key == tools_key
            and len(s.messages) <= len(messages)
            and [m.key() for m in s.messages] == keys[: len(s.messages)]
        ]
        reason = self._why_new("chat", tools_key)
        if fits:
            best = max(fits, key=lambda s: len(s.messages))
            if best.busy:
                reason = "concurrent"
            else:
                delta = renderer.continuation(best.messages, messages, tools)
                if delta is not None:
                    observed = renderer.tail(best.last_sampled) + delta
                    return self._reserve(best, False, observed, want)
                reason = "template_rewrites_history"
        renderer.check_tools(tools)
        sample = self._new_sample("chat", reason, tools_key)
        return self._reserve(sample, True, renderer.prompt(messages, tools), want)

    def prepare_text(self, prompt: str | list[int], tokenizer: Any, want: int) -> Pending:
        """As :meth:`prepare_chat` for ``/v1/completions``: a text prompt extends a sample
        whose prompt plus returned completion it starts with (the rest is encoded as plain
        text); a token-id prompt, one whose ids it starts with."""
        self._admit()
        best = None
        for s in self.samples:
            if s.kind != "text" or not s.calls:
                continue
            if isinstance(prompt, str):
                fits = s.text is not None and prompt.startswith(s.text)
                size = len(s.text or "")
            else:
                ctx = s.context()
                fits = s.text is None and prompt[: len(ctx)] == ctx
                size = len(ctx)
            if fits and (best is None or size > best[1]):
                best = (s, size)
        reason = self._why_new("text")
        if best is not None:
            sample, size = best
            if not sample.busy:
                rest = prompt[size:]
                observed = (
                    encode_untrusted(tokenizer, rest) if isinstance(rest, str) else list(rest)
                )
                return self._reserve(sample, False, observed, want)
            reason = "concurrent"
        ids = encode_untrusted(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request("'prompt' is empty", param="prompt")
        return self._reserve(self._new_sample("text", reason), True, ids, want)

    def commit(
        self,
        pending: Pending,
        result: TurnResult,
        *,
        messages: list[Message] | None = None,
        text: str | None = None,
    ) -> None:
        """Record a served call: its ids into the sample, the conversation (``messages``
        ending with the model's turn as returned) or text the next call must repeat."""
        self._release(pending)
        s = pending.sample
        if pending.new:
            s.prompt_ids = list(pending.observed)
            observed: list[int] = []
        else:
            observed = pending.observed
        record = CallRecord(
            pending.call_index,
            result.version,
            result.replica,
            len(pending.prompt_ids),
            len(pending.observed),
            len(result.ids),
            result.finish_reason.value,
            time.monotonic() - pending.started,
        )
        s.commit(observed, result, record)
        self.total_tokens += len(pending.observed) + len(result.ids)
        if messages is not None:
            s.messages = messages
        if text is not None:
            s.text = text

    def abandon(self, pending: Pending, kind: str, *, give_back_call: bool) -> None:
        """A call that was not served: nothing of it stays in the sample; a sample it
        would have started is dropped; ``give_back_call``: it does not count against
        ``max_calls`` (no replica could serve it)."""
        self._release(pending)
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if give_back_call:
            self.calls -= 1
            if pending.call_index == self._numbers - 1:
                # the newest number only: an older one stays a gap, never held by two calls
                self._numbers -= 1
        if pending.new and not pending.sample.calls:
            self.samples.remove(pending.sample)
            if pending.sample.index == self._indices - 1:
                # its number goes to the next sample: an agent retrying a refused first
                # call gets sample 0, as if the refused one had never been made
                self._indices -= 1

    def _release(self, pending: Pending) -> None:
        self._reserved -= pending.reserved
        pending.sample.busy = False

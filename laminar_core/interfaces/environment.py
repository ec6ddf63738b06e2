"""The environment interface: tools a model calls between its turns (multi-turn rollouts).

An :class:`Environment` is shared by every trajectory a rollout manager drives; each
trajectory gets its own :class:`Episode`. The loop alternates::

    model turn (text) --episode.step(turn)--> StepResult(observation, done, reward, info)
          ^                                             |
          +------ observation appended to the context --+   (until done)

What the model writes is read by a named, swappable :class:`ToolCallParser` (``<code>``
blocks as ReTool writes them, ``<tool_call>{json}</tool_call>`` as Qwen chat templates emit);
the parser also renders a tool's output into the text appended after the turn, and names the
stop strings generation should end a turn at.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Character spans ``(start, end)`` of an observation.
Spans = tuple[tuple[int, int], ...]


class EnvFailure(RuntimeError):
    """The environment itself is broken (not the model's doing): a remote sandbox that stays
    unreachable after retries, a pool that cannot start a worker.

    The rollout manager treats it like a replica failure: the trajectory is aborted and its
    prompt re-issued (a run stops after repeated failures); it is never shown to the model.
    Whatever the model's code does (time out, exhaust memory, kill its own process) is an
    *observation*, not an ``EnvFailure``.
    """


class EnvUnavailable(EnvFailure):
    """Raised by :meth:`Environment.start` when the environment cannot run on this machine as
    configured (say an isolation mechanism the host refuses). The message names what is
    missing and the fix; nothing is silently downgraded."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call read from a model turn.

    ``name`` is the tool (``"python"`` for a code block); ``arguments`` its keyword
    arguments (``{"code": ...}``); ``text`` the span of the turn it was read from. A call the
    parser recognised but could not read (malformed JSON, say) has ``error`` set to a
    one-line reason; an environment answers it with an observation naming the problem.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    error: str | None = None


class ToolCallParser(abc.ABC):
    """Reads tool calls from a model's turn and renders tool output back as text.

    Registered by name under the plugin kind ``parser`` (hook ``laminar_tool_parsers``);
    built with its options as keyword arguments. Pure and cheap: no I/O.
    """

    #: Strings at which generation should stop a turn so the call can run (the loop passes
    #: them to the engine). A turn cut just before its closing tag is still read in full.
    stop: tuple[str, ...] = ()

    @abc.abstractmethod
    def parse(self, text: str) -> list[ToolCall]:
        """The calls in ``text``, in order; ``[]`` when the turn calls no tool (an answer)."""

    @abc.abstractmethod
    def format_response(self, output: str) -> str:
        """The text appended to the context after a call whose tool printed ``output``.

        ``output`` is untrusted (the tool prints what the model's code chose): render it so
        that nothing in it can pass for the parser's own markup, i.e. neither close the
        output nor open a call (core's parsers escape their tags in it)."""

    def render(self, outputs: Sequence[str]) -> tuple[str, Spans]:
        """The observation of a turn whose calls printed ``outputs``, and the spans of it
        that are the parser's own markup (see :attr:`StepResult.markup`).

        This default joins :meth:`format_response` of each and claims no markup: all of it is
        tokenised as untrusted text. A parser whose template holds control tokens (a chat
        template's turn markup) overrides it to name where its template text is."""
        return "".join(self.format_response(o) for o in outputs), ()


@dataclass(frozen=True)
class StepResult:
    """What one model turn led to.

    ``observation``: the text to append after the turn (the formatted tool output); it is
    ``""`` when ``done``: nothing follows the model's last turn. ``done``: the episode is
    over (the model answered without calling a tool, or ``max_turns`` tool turns were
    spent). ``reward``: the environment's own score, or ``None`` to leave scoring to the
    run's reward function. ``info``: JSON-able facts for metrics and logs; keys every
    environment uses alike: ``finish`` (``"answer"``/``"max_turns"`` when done), ``error``
    (a short kind: ``"timeout"``, ``"memory"``, ``"output_limit"``, ``"killed"``,
    ``"parse_error"``, ``"unknown_tool"``, ...), ``tool_calls`` (calls run this turn),
    ``tool_seconds`` (their wall time).

    ``markup``: the spans of ``observation`` that are trusted markup (the parser's template,
    as :meth:`ToolCallParser.render` returns them), tokenised as written, so a chat
    template's control tokens there stay control tokens. Everything else is untrusted: the
    loop tokenises it with special-token strings as plain text
    (:func:`laminar_core.text.encode_untrusted`), so no tool can forge a turn.
    """

    observation: str
    done: bool
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    markup: Spans = ()


@dataclass
class EnvContext:
    """What an environment factory gets: the run's ``env`` settings every environment shares,
    the resolved ``parser``, and the plugin's own validated ``options`` (an instance of the
    class's ``Options`` dataclass, or ``None`` when it has none).

    ``max_turns``: tool turns an episode may take; the turn after them ends the episode.
    ``timeout_s``: wall-clock limit of one tool call; a call that outlasts it is stopped and
    reported to the model as an observation.
    """

    max_turns: int = 8
    timeout_s: float = 30.0
    parser: ToolCallParser | None = None
    options: Any = None


class Episode(abc.ABC):
    """One trajectory's interaction with an environment.

    Owned by the rollout manager (not by a replica): a trajectory moved between replicas by
    repack, or resumed after a replica failure, keeps its episode. ``step`` calls of one
    episode come one at a time; different episodes step concurrently.
    """

    #: Tool turns taken so far.
    turns: int = 0

    @abc.abstractmethod
    async def step(self, turn_text: str) -> StepResult:
        """Act on the model's latest turn (the text generated since the last observation).

        Never raises for anything the model wrote or its tool did: malformed calls, tool
        errors and timeouts (``timeout_s``) come back as observations. Raises
        :class:`EnvFailure` only when the environment itself is broken, and ``RuntimeError``
        when called after the episode is done or closed (a caller bug).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what the episode holds. Called exactly when the trajectory ends, is
        aborted, or dropped; idempotent."""


class Environment(abc.ABC):
    """Tools the model can call during a rollout, shared by concurrent episodes.

    Lifecycle, driven by the rollout manager:

    1. ``env = Cls(ctx)`` with an :class:`EnvContext`: cheap, no I/O.
    2. ``await env.start()`` once: acquires shared resources (a warm sandbox pool, an HTTP
       session); raises :class:`EnvUnavailable` naming the fix when it cannot run here.
    3. Per trajectory: ``ep = await env.reset(row)`` with the prompt's row (the dataset row:
       ``prompt``, the answer, any fields the environment reads), then ``await
       ep.step(turn)`` after each model turn until ``done``, then ``await ep.close()``.
       Many episodes run at once: the environment bounds its own concurrency (a call waits
       for a free worker; that wait does not count against ``timeout_s``).
    4. ``await env.close()`` once: ends open episodes and releases everything (no process,
       file or socket is left behind).
    """

    #: The context the environment was built with.
    ctx: EnvContext

    def __init__(self, ctx: EnvContext) -> None:
        self.ctx = ctx

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings for generation (the parser's)."""
        return self.ctx.parser.stop if self.ctx.parser is not None else ()

    def tool_specs(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas of the tools (for a chat template's ``tools=``);
        ``[]`` when the prompt does not list them."""
        return []

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def reset(self, row: dict[str, Any]) -> Episode:
        """Begin one episode for the prompt ``row``."""

    @abc.abstractmethod
    async def close(self) -> None: ...

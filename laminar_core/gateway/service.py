"""The gateway's logic, without HTTP: sessions, one call from request body to result.

``server`` puts it behind FastAPI; phase 2's rollout manager opens and closes sessions
and supplies the ``TurnBackend``. A call: authenticate the key, check the request (a 400
naming the field for anything this gateway does not do), choose the session's sample and
render the call's new ids (``session``), generate through the backend, read tool calls
from the text, commit the ids to the sample, and return the response's parts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from laminar_core.envs import make_parser
from laminar_core.gateway.backend import BackendUnavailable, TurnBackend, TurnRequest
from laminar_core.gateway.errors import (
    GatewayError,
    bad_request,
    budget_exhausted,
    unauthorized,
    unavailable,
)
from laminar_core.gateway.keys import SessionKeys
from laminar_core.gateway.messages import parse_messages, parse_tools, tools_key
from laminar_core.gateway.render import ChatRenderer
from laminar_core.gateway.session import Pending, Session
from laminar_core.gateway.settings import GatewaySettings, SessionBudget
from laminar_core.gateway.tool_calls import AssistantTurn, read_turn
from laminar_core.types import FinishReason, SamplingParams, Trajectory

log = logging.getLogger(__name__)

__all__ = ["CallResult", "Gateway", "SessionHandle"]

# Request fields that would change what is sampled (or ask for what the trainer owns):
# refused with the reason, never silently dropped.
_REFUSED = {
    "logprobs": "log-probs are captured for the trainer, not returned to agents; drop 'logprobs'",
    "top_logprobs": "log-probs are captured for the trainer, not returned; drop 'top_logprobs'",
    "functions": "legacy 'functions' are not supported: pass them as 'tools'",
    "function_call": "legacy 'function_call' is not supported: use 'tool_choice'",
    "best_of": "'best_of' > 1 samples several completions per call: one call is one sample",
    "echo": "'echo' is not supported",
    "suffix": "'suffix' (insertion) is not supported",
    "prediction": "'prediction' (speculative output) is not supported",
}
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class SessionHandle:
    """What an agent needs: the ``base_url`` and ``api_key`` to give its OpenAI client."""

    session_id: str
    api_key: str
    base_url: str


@dataclass
class CallResult:
    """One served call, ready to be written as OpenAI's response (``responses``)."""

    kind: str  # "chat" | "text"
    id: str
    created: int
    model: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    laminar: dict[str, Any]
    turn: AssistantTurn | None = None  # chat
    text: str = ""  # text completions
    stream: bool = False
    include_usage: bool = False
    headers: dict[str, str] = field(default_factory=dict)


def _is_false(value: Any) -> bool:
    return value is None or value is False or value == 0


class Gateway:
    """Sessions and calls (see the module docstring).

    ``backend`` generates; ``tokenizer`` is the served model's (a ``transformers``
    tokenizer with a chat template, or give one in ``settings.chat_template``);
    ``secret`` signs session keys (a fresh random one per gateway by default).
    Raises ``ValueError`` / ``ConfigError`` naming the problem when the template or the
    parser cannot be used.
    """

    def __init__(
        self,
        backend: TurnBackend,
        tokenizer: Any,
        settings: GatewaySettings | None = None,
        *,
        secret: bytes | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.settings = settings or GatewaySettings()
        self.renderer = ChatRenderer(tokenizer, self.settings.chat_template)
        self.parser = make_parser(self.settings.parser, dict(self.settings.parser_options))
        self.keys = SessionKeys(secret)
        self.base_url = ""  # set by the server once it listens
        self._sessions: dict[str, Session] = {}
        self.vocab_size = len(tokenizer)
        self.created = int(time.time())

    # -- sessions ----------------------------------------------------------------------------
    def open_session(
        self,
        group_id: str = "",
        metadata: dict[str, Any] | None = None,
        budget: SessionBudget | None = None,
    ) -> SessionHandle:
        """Open a session (one episode); its samples carry ``group_id`` and ``metadata``
        (the prompt's row, say)."""
        session_id = self.keys.new_session_id()
        key = self.keys.issue(session_id)
        self._sessions[session_id] = Session(
            session_id, key, group_id, metadata or {}, budget or self.settings.budget
        )
        return SessionHandle(session_id, key, self.base_url)

    def session(self, session_id: str) -> Session:
        """The open or closed session ``session_id`` (``KeyError`` when unknown)."""
        return self._sessions[session_id]

    async def close_session(self, session_id: str) -> list[Trajectory]:
        """End the session: its key is refused from now on (a call still running is not
        recorded) and its samples are returned, forgotten here."""
        session = self._sessions.pop(session_id)
        session.closed = True
        await self.backend.session_closed(session_id)
        return session.trajectories()

    def authenticate(self, authorization: str | None) -> Session:
        """The session an ``Authorization: Bearer <key>`` header names; a 401 for no key, a
        key this gateway did not sign, or a closed session."""
        if not authorization:
            raise unauthorized("no API key: send the session's key as 'Authorization: Bearer'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise unauthorized("the API key must be sent as 'Authorization: Bearer <key>'")
        session_id = self.keys.session_of(key.strip())
        if session_id is None:
            raise unauthorized("invalid API key: not a session key of this run")
        session = self._sessions.get(session_id)
        if session is None or session.closed:
            raise unauthorized("this session is closed: its episode is over")
        return session

    # -- checks shared by both endpoints -----------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.settings.model,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "laminar",
                }
            ],
        }

    def _check_common(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required", param="model")
        if model != self.settings.model:
            raise GatewayError(
                404,
                f"the model {model!r} does not exist: this run serves {self.settings.model!r}",
                param="model",
                code="model_not_found",
            )
        n = body.get("n")
        if n is not None and n != 1:
            raise bad_request(
                f"'n' must be 1 (got {n!r}): each call is one sample of the session", param="n"
            )
        for name, why in _REFUSED.items():
            value = body.get(name)
            if name == "best_of" and value in (None, 1):
                continue
            if not _is_false(value) and value != []:
                raise bad_request(why, param=name)
        for name in _PENALTIES:
            if not _is_false(body.get(name)):
                raise bad_request(
                    f"'{name}' changes the sampled distribution, which the trainer must "
                    f"reproduce: drop it",
                    param=name,
                )
        if body.get("logit_bias"):
            raise bad_request(
                "'logit_bias' changes the sampled distribution: drop it", param="logit_bias"
            )
        if not isinstance(body.get("stream", False), bool):
            raise bad_request("'stream' must be true or false", param="stream")

    def _sampling(self, body: dict[str, Any]) -> tuple[int, list[str], int | None, bool]:
        """The call's completion limit, stop strings, seed, and whether the request asked
        for other sampling than the run's (see ``settings``)."""
        s = self.settings
        overridden = False
        for name, run_value in (("temperature", s.temperature), ("top_p", s.top_p)):
            value = body.get(name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise bad_request(f"'{name}' must be a number", param=name)
            if abs(float(value) - run_value) > 1e-6:
                if s.on_sampling_mismatch == "reject":
                    raise bad_request(
                        f"'{name}' is {value} but this run samples at {run_value}: RL trains on "
                        f"the run's sampling; drop '{name}' or set it to {run_value}",
                        param=name,
                    )
                overridden = True
        want = body.get("max_completion_tokens")
        name = "max_completion_tokens"
        if want is None:
            want, name = body.get("max_tokens"), "max_tokens"
        if want is None:
            want = s.max_tokens
        elif not isinstance(want, int) or isinstance(want, bool) or want < 1:
            raise bad_request(f"'{name}' must be an integer >= 1, got {want!r}", param=name)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4:
            raise bad_request("'stop' must be a string or a list of up to 4 strings", param="stop")
        if not all(isinstance(x, str) and x for x in stop):
            raise bad_request("'stop' strings must be non-empty strings", param="stop")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise bad_request("'seed' must be an integer", param="seed")
        return min(want, s.max_tokens), stop, seed, overridden

    @staticmethod
    def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        return bool(body.get("stream", False)), bool(opts.get("include_usage", False))

    # -- the endpoints -----------------------------------------------------------------------
    async def chat(self, session: Session, body: Any) -> CallResult:
        """``POST /v1/chat/completions`` for ``session``."""
        self._check_common(body)
        messages = parse_messages(body.get("messages"))
        tools = parse_tools(body.get("tools"))
        tool_choice = body.get("tool_choice", "auto")
        if tool_choice is None:
            tool_choice = "auto"
        if tool_choice not in ("auto", "none"):
            raise bad_request(
                f"tool_choice {tool_choice!r} would need constrained decoding, which changes "
                "the sampled distribution; use 'auto' (or 'none')",
                param="tool_choice",
            )
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type", "text") != "text"):
            raise bad_request(
                "'response_format' other than text needs constrained decoding: drop it",
                param="response_format",
            )
        want, stop, seed, overridden = self._sampling(body)
        stream, include_usage = self._stream_flags(body)
        pending = session.prepare_chat(messages, tools, tools_key(tools), self.renderer, want)
        result, text = await self._generate(session, pending, stop, seed)
        parser = self.parser if tools and tool_choice != "none" else None
        turn = read_turn(text, parser)
        finish = _finish_reason(result.finish_reason, bool(turn.tool_calls))
        session.commit(pending, result, messages=[*messages, turn.message()])
        return self._result(
            "chat", session, pending, result, finish, overridden, stream, include_usage, turn=turn
        )

    async def complete(self, session: Session, body: Any) -> CallResult:
        """``POST /v1/completions`` for ``session``: ``prompt`` a string (plain text: any
        special-token string in it is characters) or a list of token ids (the agent's own
        control tokens)."""
        self._check_common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # OpenAI's batch form with one prompt
        if isinstance(prompt, list):
            if not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                for t in prompt
            ):
                raise bad_request(
                    f"'prompt' as token ids must be a non-empty list of ids in "
                    f"[0, {self.vocab_size})",
                    param="prompt",
                )
        elif not isinstance(prompt, str) or not prompt:
            raise bad_request(
                "'prompt' must be a non-empty string or a list of token ids (one prompt)",
                param="prompt",
            )
        want, stop, seed, overridden = self._sampling(body)
        stream, include_usage = self._stream_flags(body)
        pending = session.prepare_text(prompt, self.tokenizer, want)
        result, text = await self._generate(session, pending, stop, seed)
        session.commit(pending, result, text=prompt + text if isinstance(prompt, str) else None)
        finish = _finish_reason(result.finish_reason, False)
        return self._result(
            "text", session, pending, result, finish, overridden, stream, include_usage, text=text
        )

    async def _generate(
        self, session: Session, pending: Pending, stop: list[str], seed: int | None
    ) -> tuple[Any, str]:
        """Generate ``pending`` within the session's wall clock; the turn's text, cut at
        the first stop string. A call not served leaves nothing in the session."""
        s = self.settings
        sample = pending.sample
        request = TurnRequest(
            session.id,
            session.group_id,
            f"{session.id}.{sample.index}",
            pending.call_index,
            pending.prompt_ids,
            SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=pending.max_tokens,
                seed=seed,
                stop=list(stop),
                stop_token_ids=list(self.renderer.stop_token_ids) if sample.kind == "chat" else [],
            ),
            dict(session.metadata),
        )
        try:
            result = await asyncio.wait_for(
                self.backend.generate_turn(request), max(session.wall_left(), 0.001)
            )
        except asyncio.TimeoutError:
            session.abandon(pending, "wall_clock", give_back_call=False)
            raise budget_exhausted(
                f"this session ran out of its {session.budget.max_wall_s:g} s during the call "
                "(session budget max_wall_s)",
                "session_time_exhausted",
            ) from None
        except BackendUnavailable as e:
            session.abandon(pending, "unavailable", give_back_call=True)
            raise unavailable(f"no replica could serve this call: {e}", e.retry_after_s) from e
        except BaseException:
            session.abandon(pending, "error", give_back_call=True)
            raise
        if session.closed:
            session.abandon(pending, "closed", give_back_call=False)
            raise unauthorized("this session was closed while the call ran; it is not recorded")
        if len(result.ids) != len(result.logprobs):
            session.abandon(pending, "error", give_back_call=True)
            raise GatewayError(
                500,
                "the backend returned ids and log-probs of different lengths",
                type="server_error",
            )
        text = self.tokenizer.decode(result.ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(x) for x in stop) if i >= 0]
        return result, text[: min(cuts)] if cuts else text

    def _result(
        self,
        kind: str,
        session: Session,
        pending: Pending,
        result: Any,
        finish: str,
        overridden: bool,
        stream: bool,
        include_usage: bool,
        *,
        turn: AssistantTurn | None = None,
        text: str = "",
    ) -> CallResult:
        sample = pending.sample
        laminar = {
            "session": session.id,
            "sample": sample.index,
            "call": pending.call_index,
            "forked": pending.new and sample.reason != "first",
            "fork_reason": sample.reason if pending.new else None,
            "version": result.version,
            "replica": result.replica,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "sampling_overridden": overridden,
        }
        if turn is not None and turn.malformed:
            laminar["malformed_tool_call"] = True
        return CallResult(
            kind=kind,
            id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex,
            created=int(time.time()),
            model=self.settings.model,
            finish_reason=finish,
            prompt_tokens=len(pending.prompt_ids),
            completion_tokens=len(result.ids),
            laminar=laminar,
            turn=turn,
            text=text,
            stream=stream,
            include_usage=include_usage,
            headers={
                "x-laminar-session": session.id,
                "x-laminar-sample": str(sample.index),
                "x-laminar-weight-version": str(result.version),
                "x-laminar-replica": result.replica,
            },
        )


def _finish_reason(reason: FinishReason, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if reason == FinishReason.LENGTH else "stop"

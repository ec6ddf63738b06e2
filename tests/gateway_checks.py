"""The gateway tests that do not depend on the engine, run by both engine modules
(``test_gateway_vllm.py``, ``test_gateway_sglang.py``) against their real replica: bad
requests, budgets, session isolation, streaming on the wire.

Each module defines a ``stack`` fixture (a :class:`Stack`: its engine started once for the
module, the gateway's HTTP server on a free port) and imports the ``test_*`` functions
below, which pytest then collects there, on that module's engine: a test is written once
and fails on the engine it fails on.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from gateway_support import ADD_TOOL

from laminar_core.gateway import SessionBudget
from laminar_core.gateway.messages import parse_messages

QUESTION = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 2 + 3?"},
]


class Stack:
    """A started engine behind a gateway: ``rt`` (the loop both run in), ``gateway`` and its
    ``url``, ``recorder`` (every call the backend served), ``tok``, the served ``model`` name
    and the run's ``temperature``."""

    def __init__(
        self, rt, engine, gateway, url, recorder, tok, model_dir, model: str, temperature: float
    ) -> None:
        self.rt, self.engine, self.gateway, self.url = rt, engine, gateway, url
        self.recorder, self.tok, self.model_dir = recorder, tok, model_dir
        self.model, self.temperature = model, temperature

    def open(self, **budget):
        return self.rt.call(
            self.gateway.open_session, "g", {"row": 7}, SessionBudget(**budget) if budget else None
        )

    def close(self, session_id):
        return self.rt.run(self.gateway.close_session(session_id))

    def client(self, key, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, **kw)

    def calls(self, traj):
        return self.recorder.calls[traj.traj_id]

    def snapshot(self, session_id):
        """The session's calls, samples and errors as they stand (read on the loop)."""

        def read():
            s = self.gateway.session(session_id)
            return s.calls, s.trajectories(), dict(s.errors)

        return self.rt.call(read)


def tool_loop(stack: Stack, client: openai.OpenAI, tool_output: str = "5", **kw):
    """The calculator loop by hand with the openai client: question, tool call (if the
    model made one), result, answer. Returns the raw first response, both responses and the
    final messages."""
    messages = [dict(m) for m in QUESTION]
    raw = client.chat.completions.with_raw_response.create(
        model=stack.model, messages=messages, tools=[ADD_TOOL], seed=1, **kw
    )
    first = raw.parse()
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in first.choices[0].message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_output})
    second = client.chat.completions.create(
        model=stack.model, messages=messages, tools=[ADD_TOOL], seed=1, **kw
    )
    messages.append(second.choices[0].message.model_dump(exclude_none=True))
    return raw, first, second, messages


def test_bad_requests_get_openai_errors_and_change_nothing(stack: Stack) -> None:
    """Malformed JSON, an unknown model, ``n > 1``, log-probs, missing fields, ...: each an
    OpenAI-style error naming the field, nothing of the session changed, the server going
    on (the next good call is served)."""
    model = stack.model
    h = stack.open()
    auth = {"Authorization": f"Bearer {h.api_key}"}
    url = f"{stack.url}/chat/completions"
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (b"{not json", 400, None),
        (json.dumps({**good, "model": "gpt-4o"}), 404, "model"),
        (json.dumps({**good, "n": 2}), 400, "n"),
        (json.dumps({**good, "logprobs": True}), 400, "logprobs"),
        (json.dumps({**good, "top_logprobs": 3}), 400, "top_logprobs"),
        (json.dumps({k: v for k, v in good.items() if k != "messages"}), 400, "messages"),
        (json.dumps({k: v for k, v in good.items() if k != "model"}), 400, "model"),
        (json.dumps({**good, "tool_choice": "required"}), 400, "tool_choice"),
        (json.dumps({**good, "max_tokens": 0}), 400, "max_tokens"),
        (
            json.dumps({**good, "messages": [{"role": "robot", "content": "x"}]}),
            400,
            "messages[0].role",
        ),
        (json.dumps({**good, "presence_penalty": 0.5}), 400, "presence_penalty"),
    ]
    for body, status, param in cases:
        r = httpx.post(url, content=body, headers={**auth, "content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, (body, err)
    r = httpx.post(f"{stack.url}/nowhere", headers=auth)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{stack.url}/chat/completions", headers=auth)
    assert r.status_code == 405 and "error" in r.json()
    assert stack.snapshot(h.session_id) == (0, [], {})  # nothing refused was recorded
    # the openai client raises its usual exceptions
    client = stack.client(h.api_key)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=good["messages"])
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model=model, messages=good["messages"], n=3)
    # the run's sampling wins over an agent's (and says so); the server goes on serving
    r = client.chat.completions.create(
        model=model, messages=good["messages"], max_tokens=4, temperature=0.0
    )
    assert r.model_extra["laminar"]["sampling_overridden"]
    assert r.model_extra["laminar"]["temperature"] == stack.temperature
    assert stack.gateway.session(h.session_id).calls == 1
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model]
    (traj,) = stack.close(h.session_id)
    assert len(stack.calls(traj)) == 1


def test_budgets_are_enforced_with_the_limit_named(stack: Stack) -> None:
    """Each per-session limit (calls, context length, total tokens, wall clock) answered
    with OpenAI's 400/429 body naming it; what was served before stays the session's."""
    model = stack.model
    h = stack.open(max_calls=1)
    client = stack.client(h.api_key)
    client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
    with pytest.raises(openai.RateLimitError, match="max_calls") as e:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
    assert e.value.code == "session_calls_exhausted"
    assert e.value.response.headers["x-should-retry"] == "false"
    (traj,) = stack.close(h.session_id)
    assert len(stack.calls(traj)) == 1
    h = stack.open(max_context_tokens=20)
    with pytest.raises(openai.BadRequestError, match="max_context_tokens") as e:
        stack.client(h.api_key).chat.completions.create(model=model, messages=QUESTION)
    assert e.value.code == "context_length_exceeded"
    assert stack.close(h.session_id) == []
    # the session's tokens: the completion is cut to what is left, then the next is refused
    first = [{"role": "user", "content": "x"}]
    n = len(stack.gateway.renderer.prompt(parse_messages(first), []))
    h = stack.open(max_total_tokens=n + 2)
    client = stack.client(h.api_key)
    r = client.chat.completions.create(model=model, messages=first, max_tokens=50)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens <= 2
    more = [
        *first,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "y"},
    ]
    with pytest.raises(openai.RateLimitError, match="max_total_tokens"):
        client.chat.completions.create(model=model, messages=more)
    (traj,) = stack.close(h.session_id)
    assert traj.num_tokens <= n + 2
    h = stack.open(max_wall_s=1e-6)
    with pytest.raises(openai.RateLimitError, match="max_wall_s"):
        stack.client(h.api_key).chat.completions.create(model=model, messages=first)
    assert stack.close(h.session_id) == []
    # the engine goes on serving after the cut-off call
    h = stack.open()
    stack.client(h.api_key).chat.completions.create(model=model, messages=first, max_tokens=2)
    assert len(stack.close(h.session_id)) == 1


def test_sessions_are_isolated(stack: Stack) -> None:
    """A key reads and extends its own session only: replaying another session's messages
    starts the caller's own sample; forged, tampered, foreign and closed keys get 401; the
    other session is untouched throughout."""
    model = stack.model
    a, b = stack.open(), stack.open()
    _, _, _, b_messages = tool_loop(stack, stack.client(b.api_key))
    b_before = stack.snapshot(b.session_id)
    # A replays B's whole conversation: it makes A's own first sample, nothing of B's
    r = stack.client(a.api_key).chat.completions.create(
        model=model, messages=b_messages, tools=[ADD_TOOL], max_tokens=4
    )
    assert r.model_extra["laminar"]["session"] == a.session_id
    assert r.model_extra["laminar"]["fork_reason"] == "first"
    # forged keys: B's session id under A's signature, a tampered signature, another run's
    sig = a.api_key.split(".")[1]
    for key in (f"lmn-{b.session_id}.{sig}", b.api_key[:-1] + "x", "sk-not-ours"):
        with pytest.raises(openai.AuthenticationError):
            stack.client(key).chat.completions.create(model=model, messages=b_messages)
        with pytest.raises(openai.AuthenticationError):
            stack.client(key).models.list()
    assert stack.snapshot(b.session_id) == b_before
    b_trajs = stack.close(b.session_id)
    assert b_trajs == b_before[1]
    with pytest.raises(openai.AuthenticationError, match="closed"):  # a closed session
        stack.client(b.api_key).chat.completions.create(model=model, messages=b_messages)
    (a_traj,) = stack.close(a.session_id)
    assert a_traj.traj_id.startswith(a.session_id) and len(stack.calls(a_traj)) == 1


def test_streaming_on_the_wire(stack: Stack) -> None:
    """``stream: true``: server-sent events, OpenAI's chunks, ending with ``[DONE]``; the
    streamed content is the turn the session captured."""
    h = stack.open()
    with httpx.stream(
        "POST",
        f"{stack.url}/chat/completions",
        headers={"Authorization": f"Bearer {h.api_key}"},
        json={
            "model": stack.model,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 8,
        },
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [x for x in r.iter_lines() if x]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    (traj,) = stack.close(h.session_id)
    ((_, result),) = stack.calls(traj)
    assert content == stack.tok.decode(result.ids, skip_special_tokens=True)

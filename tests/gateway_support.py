"""What the gateway's engine tests share: a tiny model that calls a tool, an event loop
thread for the engines and the server, a backend wrapper that records each call, and the
token-faithfulness check.

A tiny model that calls a tool.

The tiny model (``laminar tiny-model``) is random; an agent's tool loop needs a model that
writes a tool call. ``build_tool_model`` fine-tunes the tiny model (a few hundred Adam
steps on CPU, seconds) on conversations rendered with its chat template, so that:

* after a user turn it writes ``CALL`` (a call of ``add`` in compact JSON, which the
  template's own rendering of the same call, ``{"name": "add", "arguments": ...}`` with
  spaces, never reproduces: a re-rendering of the conversation differs from what the model
  wrote, token for token);
* after a tool result it writes ``ANSWER``.

The prefixes are varied (system text, user text, tool schemas in the OpenAI Agents SDK's
form or the plain one), so what it writes depends on the end of the context only.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from laminar_core.gateway import TurnBackend, TurnRequest, TurnResult

CALL = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
ANSWER = "The sum is 5."
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _words(rng: random.Random, n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(1, 7))) for _ in range(n)
    )


def _tools(rng: random.Random) -> list[dict]:
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "description": rng.choice(["Add two integers.", "", _words(rng, 4)]),
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"title": "A", "type": "integer"},
                    "b": {"title": "B", "type": "integer"},
                },
                "required": ["a", "b"],
                "title": "add_args",
                "additionalProperties": False,
            },
        },
    }
    if rng.random() < 0.5:
        tool["function"]["strict"] = True
    return [rng.choice([ADD_TOOL, tool])]


WINDOW = 32  # the model's sliding attention window: each layer sees this many tokens back


def build_tool_model(out: Path, steps: int = 300, seed: int = 0) -> Path:
    """Write the fine-tuned tiny model (weights and tokenizer) to ``out``.

    Each layer attends to the last ``WINDOW`` tokens only (Qwen2's sliding-window
    attention, which transformers and vLLM both implement), so the model sees at most
    ``2 * WINDOW`` tokens back: trained on contexts cut to that before its targets, it
    does the same at any context length, and a step stays cheap on a shared CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laminar_core.gateway.messages import parse_messages
    from laminar_core.gateway.render import ChatRenderer
    from laminar_core.models import build_tiny_model
    from laminar_core.models.tiny import save_model
    from laminar_core.text import encode_untrusted

    build_tiny_model(out, seed=seed)
    tok = AutoTokenizer.from_pretrained(out)
    renderer = ChatRenderer(tok)
    end = renderer.end_token_id
    call_ids = [*encode_untrusted(tok, CALL), end]
    answer_ids = [*encode_untrusted(tok, ANSWER), end]
    rng = random.Random(seed)

    def example(window: int) -> tuple[list[int], list[int]]:
        msgs = []
        if rng.random() < 0.7:
            msgs.append({"role": "system", "content": _words(rng, rng.randint(1, 12))})
        msgs.append({"role": "user", "content": _words(rng, rng.randint(1, 10))})
        tools = _tools(rng)
        first = parse_messages(msgs)
        ids = renderer.prompt(first, tools)
        ids = ids[-window:]
        mask = [0] * len(ids)
        ids, mask = ids + call_ids, mask + [1] * len(call_ids)
        if rng.random() < 0.6:  # the second turn: after the tool's result, the answer
            call = {
                "id": "c",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
            }
            before = [*first, *parse_messages([{"role": "assistant", "tool_calls": [call]}])]
            after = [
                *before,
                *parse_messages(
                    [{"role": "tool", "tool_call_id": "c", "content": str(rng.randint(0, 99))}]
                ),
            ]
            extra = renderer.tail(call_ids) + renderer.continuation(before, after, tools)
            ids, mask = ids[-4:], mask[-4:]  # the call's end, then the tool's result
            ids, mask = ids + extra + answer_ids, mask + [0] * len(extra) + [1] * len(answer_ids)
        return ids, mask

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(
        out,
        dtype=torch.float32,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=0,
        layer_types=["sliding_attention"] * 2,  # every layer slides
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    for _step in range(steps):
        batch = [example(2 * WINDOW + 8) for _ in range(16)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float32)
        logits = model(ids).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    save_model(model, out)
    return out


def cached_tool_model(cache, tmp_path_factory) -> Path:
    """The tool model, kept in pytest's cache between runs (keyed by the sources that
    decide its weights: this module, the tiny model, the renderer), as fine-tuning takes a
    while on a shared CPU; ``cache`` is ``request.config.cache`` (``None``: no cache)."""
    import hashlib

    import torch
    import transformers

    import laminar_core.gateway.render as render
    import laminar_core.models.tiny as tiny

    h = hashlib.sha256()
    for mod in (sys.modules[__name__], tiny, render):
        h.update(Path(mod.__file__).read_bytes())
    h.update(f"{torch.__version__} {transformers.__version__}".encode())
    if cache is None:
        return build_tool_model(tmp_path_factory.mktemp("tool") / "m")
    out = Path(cache.mkdir(f"gateway-tool-model-{h.hexdigest()[:16]}"))
    if not (out / "done").exists():
        build_tool_model(out / "m")
        (out / "done").write_text("ok")
    return out / "m"


class Loop:
    """One event loop, in a thread, for the engines and the gateway's server (an engine
    belongs to the loop that started it); tests submit coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 900) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the loop's thread."""

        async def go() -> Any:
            return fn(*args, **kwargs)

        return self.run(go())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Recording(TurnBackend):
    """A real backend, with every call it served recorded (request and result) by sample."""

    def __init__(self, inner: TurnBackend) -> None:
        self.inner = inner
        self.calls: dict[str, list[tuple[TurnRequest, TurnResult]]] = {}

    async def generate_turn(self, request: TurnRequest) -> TurnResult:
        result = await self.inner.generate_turn(request)
        self.calls.setdefault(request.sample_id, []).append((request, result))
        return result

    async def session_closed(self, session_id: str) -> None:
        await self.inner.session_closed(session_id)


def check_faithful(traj, calls: list[tuple[TurnRequest, TurnResult]]) -> None:
    """``traj`` (a captured sample) is token for token what the engine saw and sampled:
    each call's prompt is the sample so far, its sampled ids are the sample's loss-mask-1
    ids there, with their log-probs, and nothing else is masked 1 or has a log-prob."""
    full = [*traj.prompt_ids, *traj.response_ids]
    assert calls and calls[0][0].prompt_ids == traj.prompt_ids
    sampled_at = set()
    for request, result in calls:
        assert full[: len(request.prompt_ids)] == request.prompt_ids
        start = len(request.prompt_ids) - len(traj.prompt_ids)
        end = start + len(result.ids)
        assert traj.response_ids[start:end] == result.ids
        assert traj.loss_mask[start:end] == [1] * len(result.ids)
        assert traj.logprobs[start:end] == result.logprobs
        assert traj.token_versions[start:end] == [result.version] * len(result.ids)
        sampled_at.update(range(start, end))
    for i, (m, lp) in enumerate(zip(traj.loss_mask, traj.logprobs, strict=True)):
        if i not in sampled_at:
            assert m == 0 and lp == 0.0, i


def recomputed_gap(model, traj, temperature: float) -> float:
    """Largest |transformers' log-prob - the engine's| over the sample's model tokens, from
    one forward pass over the captured ids (what the trainer recomputes)."""
    import torch

    ids = torch.tensor([[*traj.prompt_ids, *traj.response_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    lp = lp[len(traj.prompt_ids) - 1 :]
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    return (lp[mask] - torch.tensor(traj.logprobs)[mask]).abs().max().item()


def observed_count(traj, token_id: int) -> int:
    """How often ``token_id`` occurs in what the model did not write (prompt and loss-mask-0
    ids): the template's control tokens, when the id is one."""
    masked = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if not m]
    return [*traj.prompt_ids, *masked].count(token_id)

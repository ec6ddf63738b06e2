"""The ``Environment`` contract."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from laminar_core.interfaces.environment import (
    EnvContext,
    Environment,
    Episode,
    StepResult,
    ToolCallParser,
)


async def check_environment(
    make_env: Callable[[EnvContext], Environment | Awaitable[Environment]],
    *,
    row: dict[str, Any],
    tool_turn: str,
    answer_turn: str,
    slow_turn: str | None = None,
    bad_turn: str | None = None,
    parser: ToolCallParser | str = "code",
    options: Any = None,
    max_turns: int = 2,
    timeout_s: float = 2.0,
    concurrency: int = 4,
    leftovers: Callable[[], Any] | None = None,
    grace_s: float = 60.0,
    max_block_s: float = 0.5,
) -> None:
    """Drive an environment through its lifecycle and check the contract.

    ``make_env(ctx)`` builds the environment (sync or async); ``row`` is a prompt row;
    ``tool_turn`` a model turn that makes one quick tool call, ``answer_turn`` one that calls
    no tool. Optional: ``slow_turn`` a call that outlasts ``timeout_s`` (checks that a
    timeout is an observation with ``info["error"] == "timeout"`` and the episode goes on),
    ``bad_turn`` a malformed call (an observation naming the error, not an exception), and
    ``leftovers()`` returning what the environment left behind after ``close`` (processes,
    files): it must be empty.

    Checked: observations are strings, non-empty after a tool call and empty when done;
    ``info`` is JSON-able; ``reward`` is ``None`` or a float; the answer ends the episode with
    ``finish == "answer"``; ``max_turns`` tool turns end it at the next tool call with
    ``finish == "max_turns"``; stepping a done episode raises ``RuntimeError``; ``close`` is
    idempotent; ``concurrency`` episodes step at once; the row is not modified; ``close`` of
    the environment ends an episode still open; no call hangs (each within ``timeout_s +
    grace_s``); ``reset`` and ``step`` never hold the event loop longer than ``max_block_s``
    at a time (the rollout manager, heartbeats and every other episode share that loop).
    Raises ``AssertionError`` naming the broken rule.
    """
    if isinstance(parser, str):
        from laminar_core.envs import make_parser

        parser = make_parser(parser)
    ctx = EnvContext(max_turns=max_turns, timeout_s=timeout_s, parser=parser, options=options)
    env = make_env(ctx)
    if inspect.isawaitable(env):
        env = await env
    assert isinstance(env, Environment), f"make_env built {type(env).__name__}, not Environment"
    limit = timeout_s + grace_s
    watch = _LoopWatch(max_block_s)

    async def within(aw: Awaitable[Any], what: str, watched: bool = False) -> Any:
        task = asyncio.ensure_future(aw)
        if watched:
            watch.arm()
        done, _ = await asyncio.wait({task}, timeout=limit)
        held, where = watch.disarm() if watched else (0.0, None)
        if not done:
            task.cancel()
            raise AssertionError(f"{what} did not return within {limit:.0f} s")
        if where is not None:
            raise AssertionError(
                f"{what} held the event loop for {held:.2f} s without yielding (at {where}): "
                "the environment blocks the event loop (the rollout manager, heartbeats and "
                "every other episode stop meanwhile); await slow work off the loop "
                "(asyncio.to_thread, an asyncio subprocess, an async HTTP client)"
            )
        return task.result()

    async def step(ep: Episode, text: str, what: str) -> StepResult:
        try:
            result = await within(ep.step(text), what, watched=True)
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(
                f"{what} raised {type(e).__name__}: {e} (what the model or its tool does must "
                "come back as an observation)"
            ) from e
        _check_result(result, what)
        return result

    await within(env.start(), "start()")
    watch.start()
    try:
        assert isinstance(env.stop, tuple), "Environment.stop must be a tuple of str"
        assert all(isinstance(s, str) and s for s in env.stop), f"bad stop strings {env.stop!r}"
        specs = env.tool_specs()
        assert isinstance(specs, list), "tool_specs() must return a list"
        json.dumps(specs)
        original = copy.deepcopy(row)

        # 1. a tool turn, then the answer
        ep = await within(env.reset(row), "reset(row)", watched=True)
        assert isinstance(ep, Episode), f"reset() returned {type(ep).__name__}, not an Episode"
        r = await step(ep, tool_turn, "step(tool_turn)")
        assert not r.done, f"a tool call ended the episode: {r}"
        assert r.observation, "a tool call gave an empty observation"
        assert ep.turns == 1, f"after one tool turn, Episode.turns is {ep.turns}"
        r = await step(ep, answer_turn, "step(answer_turn)")
        assert r.done, (
            f"a turn with no tool call did not end the episode: {r} (a turn the parser finds "
            "no call in is the model's answer: return done=True, info finish='answer')"
        )
        assert r.info.get("finish") == "answer", f"finish is not 'answer': {r.info}"
        try:
            await within(ep.step(tool_turn), "step() after done")
        except RuntimeError:
            pass
        else:
            raise AssertionError("step() on a done episode did not raise RuntimeError")
        await within(ep.close(), "Episode.close()")
        await within(ep.close(), "a second Episode.close()")

        # 2. max_turns tool turns, then the next tool call ends the episode
        ep = await env.reset(row)
        for i in range(max_turns):
            r = await step(ep, tool_turn, f"tool turn {i + 1} of max_turns={max_turns}")
            assert not r.done, f"tool turn {i + 1} of max_turns={max_turns} ended the episode"
        r = await step(ep, tool_turn, "the tool turn after max_turns")
        assert r.done, (
            f"the tool call after max_turns={max_turns} did not end the episode: {r} (once "
            "Episode.turns == ctx.max_turns, the next tool call is not run: return done=True, "
            "info finish='max_turns')"
        )
        assert r.info.get("finish") == "max_turns", f"finish is not 'max_turns': {r.info}"
        assert ep.turns == max_turns, f"Episode.turns is {ep.turns}, not max_turns={max_turns}"
        await ep.close()

        # 3. a timeout is an observation, and the episode goes on
        if slow_turn is not None:
            ep = await env.reset(row)
            r = await step(ep, slow_turn, f"step(slow_turn) with timeout_s={timeout_s}")
            assert not r.done, f"a timed-out call ended the episode: {r}"
            assert r.observation, "a timed-out call gave an empty observation"
            assert r.info.get("error") == "timeout", f"info['error'] is not 'timeout': {r.info}"
            r = await step(ep, tool_turn, "step(tool_turn) after a timeout")
            assert not r.done and r.observation, f"the call after a timeout failed: {r}"
            await ep.close()

        # 4. a malformed call is an observation naming the error
        if bad_turn is not None:
            ep = await env.reset(row)
            r = await step(ep, bad_turn, "step(bad_turn)")
            assert not r.done and r.observation, f"a malformed call gave {r}"
            assert r.info.get("error"), f"a malformed call set no info['error']: {r.info}"
            await ep.close()

        # 5. concurrent episodes
        eps = [await env.reset(row) for _ in range(concurrency)]
        results = await within(
            asyncio.gather(*(ep.step(tool_turn) for ep in eps)),
            f"{concurrency} concurrent step(tool_turn)",
            watched=True,
        )
        for i, r in enumerate(results):
            _check_result(r, f"concurrent episode {i}")
            assert not r.done and r.observation, f"concurrent episode {i} gave {r}"
        for ep in eps:
            await ep.close()

        assert row == original, (
            "the environment modified the prompt row (the row is the prompt's, read by the "
            "reward and the other samples: copy what you change)"
        )
        # 6. an episode left open is ended by the environment's close
        await env.reset(row)
    finally:
        watch.stop()
        await within(env.close(), "Environment.close()")
    if leftovers is not None:
        left = leftovers()
        assert not left, f"left behind after close(): {left!r}"


class _LoopWatch:
    """Finds code that holds the event loop: a ticker on the loop notes each tick, and a
    watchdog thread, when the loop has not ticked for ``max_block_s``, looks at what the
    loop's thread is running. Only a callback's code counts (a step coroutine in
    ``time.sleep``, say); a loop that waits in ``select`` is slow, not blocked (a loaded
    machine), and is not reported."""

    TICK_S = 0.005

    def __init__(self, max_block_s: float) -> None:
        self.max_block_s = max_block_s
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._loop_thread = 0
        self._armed = False
        self._last = 0.0
        self._worst = 0.0
        self._where: str | None = None

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._last = time.monotonic()
        self._task = asyncio.ensure_future(self._tick())
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()

    def arm(self) -> None:
        self._worst, self._where = 0.0, None
        self._last = time.monotonic()
        self._armed = True

    def disarm(self) -> tuple[float, str | None]:
        """The longest time the loop went without a tick, and where a callback held it."""
        self._armed = False
        return max(self._worst, time.monotonic() - self._last), self._where

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.TICK_S)
            now = time.monotonic()
            if self._armed:
                self._worst = max(self._worst, now - self._last)
            self._last = now

    def _watch(self) -> None:
        while not self._stopped.wait(self.max_block_s / 4):
            stuck = time.monotonic() - self._last > self.max_block_s
            if self._armed and self._where is None and stuck:
                self._where = _callback_frame(sys._current_frames().get(self._loop_thread))


def _callback_frame(frame: Any) -> str | None:
    """``file:line (function)`` of the innermost non-asyncio frame of the callback the loop
    runs, or ``None`` when the loop runs none (it waits for events)."""
    inner = None
    while frame is not None:
        path = frame.f_code.co_filename
        in_asyncio = f"{os.sep}asyncio{os.sep}" in path
        if in_asyncio and frame.f_code.co_name == "_run" and path.endswith("events.py"):
            return inner  # Handle._run: a callback (a task's step) is running
        if inner is None and not in_asyncio:
            inner = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


def _check_result(r: Any, what: str) -> None:
    assert isinstance(r, StepResult), f"{what} returned {type(r).__name__}, not StepResult"
    assert isinstance(r.observation, str), f"{what}: observation is {type(r.observation)}"
    assert isinstance(r.done, bool), f"{what}: done is {type(r.done).__name__}, not bool"
    if r.done:
        assert r.observation == "", f"{what}: done with a non-empty observation"
    assert r.reward is None or isinstance(r.reward, (int, float)), f"{what}: reward {r.reward!r}"
    assert isinstance(r.info, dict), f"{what}: info is {type(r.info).__name__}, not dict"
    try:
        json.dumps(r.info)
    except (TypeError, ValueError) as e:
        raise AssertionError(f"{what}: info is not JSON-able ({e})") from None

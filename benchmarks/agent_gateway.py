"""The agent gateway's cost per call and the sessions/s it sustains, against the engine.

    python benchmarks/agent_gateway.py [--calls 8] [--sessions 256] [--max-tokens 8]

One run, three arms, printed side by side:

* **engine direct**: ``RolloutEngine.generate`` on a real vLLM CPU replica of the tiny model
  (``laminar tiny-model``), no gateway, no HTTP: the same prompts, token for token, as the
  gateway arm sent (recorded there and replayed, sessions in the same order and
  concurrency), each session's first token changed so vLLM's prefix cache holds nothing
  of the gateway arm's run while a session's own earlier calls still hit, as they do there.
* **gateway + vLLM**: agents using real ``openai.AsyncOpenAI`` clients over HTTP, one client
  per session, in a separate process (so their CPU is not the server's), calling
  ``/v1/chat/completions`` with a tool, ``calls`` calls per session on a growing
  conversation; the gateway (``Gateway``, ``GatewayServer``, ``EngineTurnBackend``) renders,
  generates on the same replica and captures. Overhead per call = the client's latency
  minus the time the call spent in the backend (the engine), call by call.
* **gateway only (engine-free backend)**: the same agents against a backend that returns a
  fixed tool call at once, no engine: what is left is the gateway's own cost (render, capture,
  HTTP, JSON) and the client's. Not an engine: said so in the output.

Each at 1 session and at ``--concurrency`` (256) sessions at once, generations short
(``--max-tokens``) so the overhead is visible; sessions/s is sessions run to the end
(opened, ``calls`` calls, closed with their samples returned) per second with that many at
once. Run with ``OMP_NUM_THREADS=1``; the machine may be shared, so compare the arms of one
run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import ROOT, pct, say, table

sys.path.insert(0, str(ROOT / "tests"))
from gateway_support import ADD_TOOL, CALL  # the tests' calculator tool and its call

SYSTEM = "You are a calculator. Use the add tool, then answer."
QUESTION = "What is 2 + 3?"


# -- the agents (a child process: only the openai client is imported there) -----------------
async def _agent(client: Any, calls: int, max_tokens: int, model: str) -> list:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        resp = await client.chat.completions.create(
            model=model, messages=messages, tools=[ADD_TOOL], max_tokens=max_tokens
        )
        took = time.perf_counter() - t0
        lam = (resp.model_extra or {}).get("laminar", {})
        out.append((lam.get("session"), lam.get("call", i), took))
        msg = resp.choices[0].message
        if msg.tool_calls:
            messages.append(
                {
                    "role": "assistant",
                    "content": msg.content,
                    "tool_calls": [c.model_dump() for c in msg.tool_calls],
                }
            )
            for c in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": "5"})
        else:
            messages.append({"role": "assistant", "content": msg.content or ""})
            messages.append({"role": "user", "content": "Go on."})
    return out


async def _agents(
    base_url: str, keys: list[str], concurrency: int, calls: int, max_tokens: int, model: str
) -> dict[str, Any]:
    import openai

    # one client per agent, made before the clock starts (an agent's own set-up, not the
    # gateway's); each opens its own HTTP connection on its first call
    clients = [
        openai.AsyncOpenAI(base_url=base_url, api_key=k, max_retries=0, timeout=900) for k in keys
    ]
    sem = asyncio.Semaphore(concurrency)

    async def one(client: Any) -> list:
        async with sem:
            return await _agent(client, calls, max_tokens, model)

    t0, c0 = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(one(c) for c in clients))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for c in clients:
        await c.close()
    return {"wall": wall, "cpu": cpu, "calls": [c for r in results for c in r]}


def _agents_main(conn: Any, *args: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    conn.send(asyncio.run(_agents(*args)))
    conn.close()


async def run_agents(
    base_url: str, keys: list[str], concurrency: int, calls: int, max_tokens: int, model: str
) -> dict[str, Any]:
    """The agents in a child process; their per-call latencies and wall time."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_agents_main,
        args=(child, base_url, keys, concurrency, calls, max_tokens, model),
        daemon=True,
    )
    proc.start()
    child.close()
    try:
        return await asyncio.get_running_loop().run_in_executor(None, parent.recv)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


# -- the server side ---------------------------------------------------------------------------
def _backend_classes() -> tuple[type, type]:
    from laminar_core.gateway import TurnBackend, TurnRequest, TurnResult
    from laminar_core.types import FinishReason

    class Timed(TurnBackend):
        """A real backend, with each call's time in it and its request recorded."""

        def __init__(self, inner: TurnBackend) -> None:
            self.inner = inner
            self.seconds: dict[tuple[str, int], float] = {}
            self.requests: dict[str, list[TurnRequest]] = {}

        async def generate_turn(self, request: TurnRequest) -> TurnResult:
            t0 = time.perf_counter()
            result = await self.inner.generate_turn(request)
            self.seconds[(request.session_id, request.call_index)] = time.perf_counter() - t0
            self.requests.setdefault(request.session_id, []).append(request)
            return result

        async def session_closed(self, session_id: str) -> None:
            await self.inner.session_closed(session_id)

    class Instant(TurnBackend):
        """NOT AN ENGINE: returns the same tool call at once (log-prob -0.5 per id), so
        what a call costs is the gateway's own work and the client's."""

        def __init__(self, ids: list[int]) -> None:
            self.ids = list(ids)

        async def generate_turn(self, request: TurnRequest) -> TurnResult:
            n = min(len(self.ids), request.sampling.max_tokens)
            return TurnResult(self.ids[:n], [-0.5] * n, FinishReason.STOP, 0, "instant")

    return Timed, Instant


@dataclass
class Arm:
    name: str
    sessions: int
    concurrency: int
    latencies: list[float] = field(default_factory=list)  # per call, as the caller saw it
    overhead: list[float] = field(default_factory=list)  # per call, latency - backend time
    wall: float = 0.0
    open_close_s: float = 0.0
    forks: int = 0
    server_cpu: float = 0.0  # this process's CPU time (gateway, uvicorn, vLLM's front end)
    client_cpu: float = float("nan")  # the agents' process's CPU time

    @property
    def calls(self) -> int:
        return len(self.latencies)

    @property
    def sessions_per_s(self) -> float:
        t = self.wall + self.open_close_s
        return self.sessions / t if t > 0 else float("nan")


async def gateway_arm(
    gateway: Any, timed: Any, name: str, n: int, concurrency: int, calls: int, max_tokens: int
) -> Arm:
    arm = Arm(name, n, concurrency)
    t0 = time.perf_counter()
    handles = [gateway.open_session(group_id=f"g{i}", metadata={"row": i}) for i in range(n)]
    arm.open_close_s = time.perf_counter() - t0
    c0 = time.process_time()
    res = await run_agents(
        gateway.base_url,
        [h.api_key for h in handles],
        concurrency,
        calls,
        max_tokens,
        gateway.settings.model,
    )
    arm.server_cpu = time.process_time() - c0
    arm.wall, arm.client_cpu = res["wall"], res["cpu"]
    t0, c0 = time.perf_counter(), time.process_time()
    for h in handles:
        samples = await gateway.close_session(h.session_id)
        arm.forks += max(0, len(samples) - 1)
    arm.open_close_s += time.perf_counter() - t0
    arm.server_cpu += time.process_time() - c0
    for session, call, took in res["calls"]:
        arm.latencies.append(took)
        inside = timed.seconds.get((session, call))
        if inside is not None:
            arm.overhead.append(took - inside)
    return arm


async def direct_arm(engine: Any, sessions: list[list[Any]], concurrency: int) -> Arm:
    """The gateway arm's requests replayed on the engine itself, session by session."""
    import dataclasses

    from laminar_core.types import GenerationRequest

    arm = Arm("engine direct", len(sessions), concurrency)
    sem = asyncio.Semaphore(concurrency)

    async def one(j: int, reqs: list[Any]) -> None:
        async with sem:
            for r in reqs:
                ids = list(r.prompt_ids)
                ids[0] = (ids[0] + 1) % 100  # no prefix-cache hit on the gateway arm's blocks
                req = GenerationRequest(
                    traj_id=f"direct-{j}-{r.call_index}",
                    group_id=r.group_id,
                    prompt_ids=ids,
                    sampling=dataclasses.replace(r.sampling),
                )
                t0 = time.perf_counter()
                await engine.generate(req)
                arm.latencies.append(time.perf_counter() - t0)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(j, reqs) for j, reqs in enumerate(sessions)))
    arm.wall, arm.server_cpu = time.perf_counter() - t0, time.process_time() - c0
    return arm


async def cpu_by_depth(gateway: Any, depth: int, sessions: int = 5) -> dict[int, tuple]:
    """The gateway's own CPU per call (process time), in process: no HTTP, no engine (the
    gateway's backend must be the engine-free one). Per call depth: (total ms, of which
    rendering the chat template ms), the mean over ``sessions`` sessions of ``depth`` calls
    on the same growing tool conversation as the agents'."""
    from laminar_core.gateway.responses import body as response_body

    renderer = gateway.renderer
    spent = [0.0]
    originals = (renderer.prompt, renderer.continuation)

    def timed(fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.process_time() - t0

        return run

    renderer.prompt, renderer.continuation = (timed(f) for f in originals)
    per: dict[int, list[tuple[float, float]]] = {}
    try:
        for _ in range(sessions):
            h = gateway.open_session()
            session = gateway.authenticate(f"Bearer {h.api_key}")
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTION},
            ]
            for i in range(depth):
                spent[0] = 0.0
                t0 = time.process_time()
                r = await gateway.chat(
                    session,
                    {"model": gateway.settings.model, "messages": messages, "tools": [ADD_TOOL]},
                )
                msg = response_body(r)["choices"][0]["message"]
                per.setdefault(i + 1, []).append((time.process_time() - t0, spent[0]))
                messages.append(
                    {
                        "role": "assistant",
                        "content": msg["content"],
                        "tool_calls": msg["tool_calls"],
                    }
                )
                for c in msg["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": c["id"], "content": "5"})
            samples = await gateway.close_session(h.session_id)
            assert len(samples) == 1, "the conversation forked: the benchmark's agent is wrong"
    finally:
        renderer.prompt, renderer.continuation = originals
    return {
        d: (sum(x for x, _ in v) / len(v) * 1e3, sum(y for _, y in v) / len(v) * 1e3)
        for d, v in per.items()
    }


async def main_async(args: argparse.Namespace) -> tuple[list[Arm], dict[int, tuple]]:
    from transformers import AutoTokenizer

    from laminar_core.gateway import (
        ChatRenderer,
        EngineTurnBackend,
        Gateway,
        GatewayServer,
        GatewaySettings,
    )
    from laminar_core.text import encode_untrusted
    from laminar_vllm import VLLMOptions, VLLMRolloutEngine

    Timed, Instant = _backend_classes()
    model_dir = args.model
    tok = AutoTokenizer.from_pretrained(model_dir)
    settings = GatewaySettings(model="policy", temperature=1.0, max_tokens=args.max_tokens)
    arms: list[Arm] = []
    c = args.concurrency

    # -- gateway only: the engine-free backend -------------------------------------------------
    fixed = [*encode_untrusted(tok, CALL), *ChatRenderer(tok).stop_token_ids]
    free = Timed(Instant(fixed))
    gw = Gateway(free, tok, GatewaySettings(model="policy", max_tokens=len(fixed)))
    server = GatewayServer(gw)
    await server.start()
    try:
        say("gateway CPU per call, in process ...")
        await cpu_by_depth(gw, 2, 1)  # warm-up
        depth = await cpu_by_depth(gw, args.depth)
        say("gateway only (engine-free backend) ...")
        await gateway_arm(gw, free, "warm-up", 4, 4, 2, len(fixed))
        arms.append(
            await gateway_arm(
                gw,
                free,
                "gateway only (NO ENGINE: fixed tokens)",
                args.single,
                1,
                args.calls,
                len(fixed),
            )
        )
        arms.append(
            await gateway_arm(
                gw,
                free,
                "gateway only (NO ENGINE: fixed tokens)",
                args.sessions,
                c,
                args.calls,
                len(fixed),
            )
        )
    finally:
        await server.stop()

    # -- a real vLLM replica: through the gateway, then directly ------------------------------
    engine = VLLMRolloutEngine(
        "r0",
        model_dir,
        VLLMOptions(kv_cache_mb=args.kv_cache_mb, max_model_len=2048, max_num_seqs=c),
        model_dtype="float32",
    )
    say("starting the vLLM replica ...")
    await engine.start()
    try:
        timed = Timed(EngineTurnBackend([engine]))
        gw = Gateway(timed, tok, settings)
        server = GatewayServer(gw)
        await server.start()
        try:
            say("gateway + vLLM ...")
            await gateway_arm(gw, timed, "warm-up", 4, 4, 2, args.max_tokens)
            timed.requests.clear()
            one = await gateway_arm(
                gw, timed, "gateway + vLLM", args.single, 1, args.calls, args.max_tokens
            )
            one_reqs = list(timed.requests.values())
            timed.requests.clear()
            many = await gateway_arm(
                gw, timed, "gateway + vLLM", args.sessions, c, args.calls, args.max_tokens
            )
            many_reqs = list(timed.requests.values())
        finally:
            await server.stop()
        say("engine direct ...")
        arms.append(await direct_arm(engine, one_reqs, 1))
        arms.append(one)
        arms.append(await direct_arm(engine, many_reqs, c))
        arms.append(many)
    finally:
        await engine.stop()
    return arms, depth


def report(arms: list[Arm], calls: int) -> str:
    rows = []
    for a in arms:
        lat = [x * 1e3 for x in a.latencies]
        over = [x * 1e3 for x in a.overhead]
        rows.append(
            [
                a.name,
                str(a.concurrency),
                str(len(lat)),
                f"{pct(lat, 0.5):.1f} / {pct(lat, 0.99):.1f}",
                f"{pct(over, 0.5):.1f} / {pct(over, 0.99):.1f}" if over else "-",
                f"{len(a.latencies) / a.wall:,.0f}" if a.wall else "-",
                f"{a.sessions_per_s:,.1f}",
                f"{a.server_cpu / a.calls * 1e3:.2f}" if a.calls else "-",
                f"{a.client_cpu / a.calls * 1e3:.2f}" if a.calls and a.client_cpu >= 0 else "-",
                f"{a.sessions / a.server_cpu:,.0f}" if a.server_cpu > 0 else "-",
                str(a.forks),
            ]
        )
    header = [
        "arm",
        "sessions at once",
        "calls",
        "latency ms p50 / p99",
        "gateway overhead ms p50 / p99",
        "calls/s",
        f"sessions/s ({calls} calls each)",
        "server CPU ms / call",
        "agents' CPU ms / call",
        "sessions/s per server core (CPU)",
        "forks",
    ]
    return table(rows, header)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=8, help="calls per session")
    ap.add_argument("--single", type=int, default=8, help="sessions run one at a time")
    ap.add_argument("--sessions", type=int, default=256, help="sessions of the concurrent arms")
    ap.add_argument("--concurrency", type=int, default=256, help="sessions at once")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per vLLM call")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    ap.add_argument("--model", default="", help="a tiny model dir (default: build one)")
    ap.add_argument("--depth", type=int, default=40, help="calls of the in-process CPU arm")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="agent-gw-") as tmp:
        if not args.model:
            from laminar_core.models import build_tiny_model

            args.model = str(Path(tmp) / "tiny")
            build_tiny_model(args.model, seed=0)
        arms, depth = asyncio.run(main_async(args))
    say()
    say(report(arms, args.calls))
    say()
    marks = sorted({1, 2, 5, 10, 20, args.depth} & set(depth))
    say(
        table(
            [[str(d), f"{depth[d][0]:.2f}", f"{depth[d][1]:.2f}"] for d in marks],
            ["call in the session", "gateway CPU ms / call", "of which chat-template render ms"],
        )
    )
    say(
        "gateway CPU per call in process (no HTTP, NO ENGINE), process time: each call "
        "renders the conversation twice (the sample's messages and the call's) to check that "
        "the template does not rewrite history, so the cost grows with the conversation"
    )
    say(
        "overhead = the client's latency minus the call's time in the backend, call by call "
        "(HTTP both ways, the openai client, render, capture); 'NO ENGINE' rows use a backend "
        "that returns a fixed tool call at once: the gateway's own cost. Server CPU: this "
        "process's CPU time (the gateway, uvicorn, vLLM's front end; the engine core has a "
        "process of its own; 'engine direct' is vLLM's front end alone), per call and as "
        "the sessions/s one core would sustain: unlike the wall-clock columns it does not "
        "depend on how many other programs share the machine. Shared machine: compare rows "
        "of this run only."
    )


if __name__ == "__main__":
    main()

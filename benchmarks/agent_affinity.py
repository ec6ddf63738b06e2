"""What keeping a session on its replica saves: re-prefill, with real vLLM prefix caches.

    python benchmarks/agent_affinity.py [--sessions 16 --calls 8 --system-tokens 256 ...]

A session's next call extends its last call's context (token for token: the gateway never
re-tokenises), so the replica that served the last call holds the whole prefix in its
prefix cache, and only the new tokens (the tool result, the generation prompt) need a
prefill there. Any other replica computes the whole context again. Two arms, one run,
printed side by side, on two real vLLM CPU replicas of the tiny model (prefix caching on,
as ``rollout.vllm`` ships it):

* **home replica**: each call goes to the replica of the session's last call (the gateway's
  rule, ``loop.placement.choose_call_replica``, when the replicas hold one version);
* **no affinity**: each call to a replica drawn at random (seeded), whatever served the
  session before (a benchmark-only backend: what a load balancer that knows nothing of
  sessions does; with two replicas about half of a session's later calls move).

The same agents in both (``--sessions`` at once, ``--calls`` calls each, a system prompt of
``--system-tokens`` and a tool result of ``--tool-tokens`` per call: an agent's context
grows call by call; the system prompt is the same for every session of an arm, as an
agent's is), each arm's text different so neither hits the other's cache, the arms run
twice in turn (home, none, home, none) so that a drift of the shared machine's load
falls on both. Per arm:
the prompt tokens sent, the tokens vLLM's prefix cache served (``num_cached_tokens`` of
its request output, block-granular), the tokens it computed, and each call's time. Run with
``OMP_NUM_THREADS=1``; the machine may be shared: compare the arms of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import string
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import pct, say, table


@dataclass
class Arm:
    name: str
    calls: list[tuple[int, int, float]] = field(default_factory=list)  # prompt, cached, s
    wall: float = 0.0
    moved: int = 0  # later calls on another replica than the session's last


class Recorded:
    """An engine whose calls are recorded: prompt tokens, cached tokens, seconds."""

    def __init__(self, inner: Any, arm: list[Arm]) -> None:
        self.inner, self.arm = inner, arm
        self.replica_id = inner.replica_id

    async def generate(self, request: Any) -> Any:
        t0 = time.perf_counter()
        traj = await self.inner.generate(request)
        cached = int(traj.metadata.get("cached_prompt_tokens", 0))
        self.arm[0].calls.append((len(request.prompt_ids), cached, time.perf_counter() - t0))
        return traj


def backend(engines: list[Any], affinity: bool, arm: Arm) -> Any:
    from laminar_core.gateway import EngineTurnBackend

    class Anywhere(EngineTurnBackend):
        """NO AFFINITY (benchmark only): a replica drawn at random for every call."""

        rng = random.Random(0)

        def _pick(self, session_id: str) -> Any:
            return self.engines[self.rng.choice(sorted(self.engines))]

    class Counted(EngineTurnBackend if affinity else Anywhere):  # type: ignore[misc]
        async def generate_turn(self, request: Any) -> Any:
            before = self._home.get(request.session_id)
            result = await super().generate_turn(request)
            if before is not None and before != result.replica:
                arm.moved += 1
            return result

    return Counted(engines)


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))


async def run_arm(gateway: Any, arm: Arm, args: argparse.Namespace, seed: int) -> None:
    """``args.sessions`` agents at once, ``args.calls`` calls each, through ``gateway``."""
    from laminar_core.gateway.responses import body as response_body

    rng = random.Random(seed)
    system = _text(rng, args.system_tokens)  # the tiny model's tokenizer: a token a char

    async def one(i: int) -> None:
        h = gateway.open_session(group_id=f"g{i}")
        session = gateway.authenticate(f"Bearer {h.api_key}")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"task {i}: " + _text(rng, 32)},
        ]
        for _ in range(args.calls):
            body = {"model": "policy", "messages": messages, "max_tokens": args.max_tokens}
            r = await gateway.chat(session, body)
            msg = response_body(r)["choices"][0]["message"]
            messages.append({"role": "assistant", "content": msg["content"] or ""})
            messages.append({"role": "user", "content": "tool: " + _text(rng, args.tool_tokens)})
        samples = await gateway.close_session(h.session_id)
        assert len(samples) == 1, "the conversation forked: the benchmark's agent is wrong"

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.sessions)))
    arm.wall = time.perf_counter() - t0


async def main_async(args: argparse.Namespace) -> list[Arm]:
    from transformers import AutoTokenizer

    from laminar_core.gateway import Gateway, GatewaySettings
    from laminar_vllm import VLLMOptions, VLLMRolloutEngine

    tok = AutoTokenizer.from_pretrained(args.model)
    opts = VLLMOptions(kv_cache_mb=args.kv_cache_mb, max_model_len=2048, max_num_seqs=args.sessions)
    engines = [VLLMRolloutEngine(f"r{i}", args.model, opts, model_dtype="float32") for i in (0, 1)]
    say("starting two vLLM replicas ...")
    for e in engines:
        await e.start()
    arms: dict[str, Arm] = {}
    try:
        settings = GatewaySettings(model="policy", temperature=1.0, max_tokens=args.max_tokens)
        order = [("warm-up", True)] + [("home replica", True), ("no affinity", False)] * 2
        for k, (name, affinity) in enumerate(order):
            arm = Arm(name)
            slot = [arm]
            recorded = [Recorded(e, slot) for e in engines]
            gateway = Gateway(backend(recorded, affinity, arm), tok, settings)
            say(f"{name} ...")
            warm = argparse.Namespace(**{**vars(args), "sessions": 2, "calls": 2})
            await run_arm(gateway, arm, warm if name == "warm-up" else args, seed=k)
            if name != "warm-up":
                into = arms.setdefault(name, Arm(name))
                into.calls += arm.calls
                into.wall += arm.wall
                into.moved += arm.moved
    finally:
        for e in engines:
            await e.stop()
    return list(arms.values())


def report(arms: list[Arm]) -> str:
    rows = []
    for a in arms:
        sent = sum(p for p, _, _ in a.calls)
        cached = sum(c for _, c, _ in a.calls)
        ms = [s * 1e3 for _, _, s in a.calls]
        rows.append(
            [
                a.name,
                str(len(a.calls)),
                str(a.moved),
                f"{sent:,}",
                f"{cached:,} ({cached / sent:.0%})" if sent else "-",
                f"{sent - cached:,}",
                f"{pct(ms, 0.5):.0f} / {pct(ms, 0.99):.0f}",
                f"{sum(ms) / len(ms):.0f}" if ms else "-",
                f"{a.wall:.1f}",
            ]
        )
    header = [
        "placement",
        "calls",
        "calls moved",
        "prompt tokens sent",
        "served from prefix cache",
        "prompt tokens computed",
        "ms / call p50 / p99",
        "ms / call mean",
        "wall s",
    ]
    return table(rows, header)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16, help="sessions at once")
    ap.add_argument("--calls", type=int, default=10, help="calls per session")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--tool-tokens", type=int, default=96, help="tool result per call")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per call")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    ap.add_argument("--model", default="", help="a tiny model dir (default: build one)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="agent-affinity-") as tmp:
        if not args.model:
            from laminar_core.models import build_tiny_model

            args.model = str(Path(tmp) / "tiny")
            build_tiny_model(args.model, seed=0)
        arms = asyncio.run(main_async(args))
    say()
    say(report(arms))
    say(
        "prompt tokens computed = sent - served from vLLM's prefix cache (num_cached_tokens, "
        "whole blocks); 'no affinity' is a benchmark-only backend. Two vLLM CPU replicas on "
        "one shared machine: compare the rows of this run only."
    )


if __name__ == "__main__":
    main()

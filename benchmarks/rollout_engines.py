"""Rollout throughput of the real engines on one workload: SGLang against vLLM.

Both engines run in this process through their Laminar plugins (``laminar_sglang``,
``laminar_vllm``), one after the other, on the same model, the same prompts and the same
sampling settings (n samples per prompt, ``max_tokens``, temperature 1). Both engines start
and generate a small warm-up batch; then, in turns (vLLM, SGLang, vLLM, ...: a machine whose
load changes during the run biases neither), each generates all ``prompts x samples``
trajectories at once (the engine batches them continuously). Per batch it measures the wall
time and the CPU time of this process and all its children (the engines' workers): prints
response tokens/s, trajectories/s and tokens per CPU-second (less sensitive to other work on
a shared machine) side by side, medians over the batches, and SGLang / vLLM.

    python benchmarks/rollout_engines.py [--model DIR] [--prompts 16] [--samples 8]
                                         [--max-tokens 128] [--engines vllm sglang]
                                         [--repeats 5] [--json FILE]

Without ``--model`` it builds the tiny local model (``laminar tiny-model``), float32. Sampled
lengths differ between engines (temperature 1, EOS ends a trajectory), so compare tokens/s.
On a CPU machine run ``bash scripts/install.sh`` first (both engines' CPU recipes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil
import torch
from _common import say, table

from laminar_core import GenerationRequest, SamplingParams
from laminar_core.models import build_tiny_model, char_vocab

torch.set_num_threads(1)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = 3, len(char_vocab())  # printable characters (after the special tokens)
    lengths = torch.randint(8, 25, (n,), generator=g).tolist()
    return [torch.randint(lo, hi, (k,), generator=g).tolist() for k in lengths]


def _engine(name: str, model: str, dtype: str, kv_tokens: int):
    if name == "sglang":
        from laminar_sglang import SGLangOptions, SGLangRolloutEngine

        opts = SGLangOptions(max_total_tokens=kv_tokens)
        return SGLangRolloutEngine("bench-sglang", model, opts, model_dtype=dtype)
    if name == "vllm":
        from laminar_vllm import VLLMOptions, VLLMRolloutEngine

        # the same KV capacity in tokens: the tiny model holds 1 KiB per token in float32
        opts = VLLMOptions(kv_cache_mb=max(16, kv_tokens >> 10), max_model_len=2048)
        return VLLMRolloutEngine("bench-vllm", model, opts, model_dtype=dtype)
    raise SystemExit(f"unknown engine {name!r}: choose vllm or sglang")


async def _batch(engine, prompts: list[list[int]], samples: int, max_tokens: int, tag: str):
    reqs = [
        GenerationRequest(
            f"{tag}-{i}-{j}",
            f"{tag}-{i}",
            prompt_ids=p,
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens),
        )
        for i, p in enumerate(prompts)
        for j in range(samples)
    ]
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    out = await asyncio.gather(*(engine.generate(r) for r in reqs))
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    tokens = sum(t.num_response_tokens for t in out)
    return {
        "seconds": wall,
        "cpu_seconds": cpu,
        "trajectories": len(out),
        "response_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "trajectories_per_s": len(out) / wall,
        "tokens_per_cpu_s": tokens / cpu,
    }


def _cpu_seconds() -> float:
    """User + system CPU time of this process and every live descendant (engine workers)."""
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


async def _compare(args, prompts: list[list[int]]) -> dict:
    engines, results = {}, {}
    try:
        for name in args.engines:
            say(f"{name}: starting")
            engines[name] = _engine(name, args.model, args.dtype, args.kv_tokens)
            t0 = time.perf_counter()
            await engines[name].start()
            results[name] = {"start_seconds": time.perf_counter() - t0, "runs": []}
            await _batch(engines[name], prompts[:2], 2, 16, "warmup")
        for r in range(args.repeats):
            for name, engine in engines.items():
                res = await _batch(engine, prompts, args.samples, args.max_tokens, f"r{r}")
                say(
                    f"  {name} batch {r}: {res['trajectories']} trajectories, "
                    f"{res['response_tokens']} tokens in {res['seconds']:.2f} s "
                    f"({res['cpu_seconds']:.1f} CPU s)"
                )
                results[name]["runs"].append(res)
    finally:
        for engine in engines.values():
            await engine.stop()
    for res in results.values():
        for k in ("tokens_per_s", "trajectories_per_s", "tokens_per_cpu_s", "seconds"):
            res[k] = statistics.median(run[k] for run in res["runs"])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local HF model directory (default: build the tiny model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per engine (median)")
    ap.add_argument("--engines", nargs="+", default=["vllm", "sglang"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(build_tiny_model(Path(tmp) / "tiny", seed=args.seed))
        prompts = _prompts(args.prompts, args.seed)
        say(
            f"workload: {args.prompts} prompts x {args.samples} samples, max_tokens "
            f"{args.max_tokens}, temperature 1, {args.dtype}, {args.repeats} timed batches"
        )
        results = asyncio.run(_compare(args, prompts))
    rows = [
        [
            name,
            f"{r['tokens_per_s']:,.0f}",
            f"{r['trajectories_per_s']:.2f}",
            f"{r['tokens_per_cpu_s']:,.0f}",
            f"{r['seconds']:.2f}",
            f"{r['start_seconds']:.0f}",
        ]
        for name, r in results.items()
    ]
    say("")
    header = ["engine", "tokens/s", "trajectories/s", "tokens/CPU-s", "batch s", "start s"]
    say(table(rows, header))
    if "sglang" in results and "vllm" in results:
        s, v = results["sglang"], results["vllm"]
        say(
            f"sglang / vllm: tokens/s {s['tokens_per_s'] / v['tokens_per_s']:.2f}x, "
            f"trajectories/s {s['trajectories_per_s'] / v['trajectories_per_s']:.2f}x, "
            f"tokens/CPU-s {s['tokens_per_cpu_s'] / v['tokens_per_cpu_s']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""What a generated token costs a vLLM replica at each decode batch size (CPU).

    python benchmarks/decode_batch.py [--model runs/small-qwen2] [--batches 4,8,16,32,64,128]
                                      [--tokens 128] [--json FILE]

One vLLM engine, built as a Laminar replica builds it on CPU (the engine core in this
process, ``laminar_vllm.inproc.InprocLLM``, eager, float32, one torch thread, token log-probs
returned, a delta per step, no detokenizing: a replica serving requests without stop
strings; ``--detokenize`` as it serves requests with them), generates ``B`` sequences of
exactly ``--tokens`` tokens at once (EOS ignored, so the batch stays ``B`` to the end) for
each ``B``, after a warm-up round at that size. Prints the CPU milliseconds per generated
token, the wall milliseconds per decode step and tokens/s, and a fit
``cost(B) = a / B + b``: ``a`` the fixed CPU milliseconds of one decode step (scheduling,
input preparation, sampling, output handling: paid once per step whatever the batch), ``b``
the milliseconds each token adds (the model's arithmetic).

This is the mechanism behind ``grpo_vs_trl.py``'s laminar vs ``sync`` figures on a CPU
machine: a replica decoding a fuller batch spends less per token. ``sync`` ends every step
on its long tail (a few sequences per decode step); laminar keeps admitting work, so its
replicas decode fuller batches. The Laminar paper's premise on GPUs is the extreme case of
the same curve (a decode step at batch < 8 costs about what batch 64 does: ``a`` dominates).
Builds ``--model`` with ``laminar tiny-model --preset small`` if it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, say, table

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of ``cost = a / B + b`` over ``(B, cost)`` points: ``(a, b)``."""
    xs = [1.0 / b for b, _ in points]
    ys = [c for _, c in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return a, my - a * mx


async def _measure(llm, batches: list[int], tokens: int, detokenize: bool) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=tokens,
        ignore_eos=True,
        temperature=1.0,
        logprobs=0,
        output_kind=RequestOutputKind.DELTA,
        detokenize=detokenize,
    )
    ids = iter(range(1 << 30))

    async def one() -> int:
        n = 0
        prompt = TokensPrompt(prompt_token_ids=list(range(3, 23)))
        async for out in llm.generate(prompt, params, f"r{next(ids)}"):
            n += len(out.outputs[0].token_ids)
        return n

    rows = []
    for b in batches:
        await asyncio.gather(*(one() for _ in range(b)))  # warm-up at this size
        c0, t0 = _cpu(), time.monotonic()
        n = sum(await asyncio.gather(*(one() for _ in range(b))))
        cpu, wall = _cpu() - c0, time.monotonic() - t0
        rows.append(
            {
                "batch": b,
                "cpu_ms_per_token": 1000 * cpu / n,
                "step_ms": 1000 * wall / tokens,
                "tokens_per_second": n / wall,
            }
        )
        say(f"  batch {b}: {rows[-1]['cpu_ms_per_token']:.3f} CPU ms per token")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "runs" / "small-qwen2"))
    ap.add_argument("--batches", default="4,8,16,32,64,128")
    ap.add_argument("--tokens", type=int, default=128, help="generated per sequence")
    ap.add_argument(
        "--detokenize",
        action="store_true",
        help="text each step too (what a replica pays only for requests with stop strings)",
    )
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]

    import torch

    torch.set_num_threads(1)  # as a replica on CPU runs (OMP_NUM_THREADS=1)
    model = Path(a.model)
    if not (model / "config.json").exists():
        from laminar_core.models import build_tiny_model

        build_tiny_model(model, preset="small")
    from vllm.engine.arg_utils import AsyncEngineArgs

    from laminar_vllm.inproc import InprocLLM

    args = AsyncEngineArgs(
        model=str(model),
        dtype="float32",
        max_model_len=max(384, 32 + a.tokens),
        max_num_seqs=max(batches),
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        logprobs_mode="processed_logprobs",
    )
    llm = InprocLLM.from_engine_args(args)
    say(f"model {model}, {a.tokens} tokens per sequence, batches {batches}")
    try:
        rows = asyncio.run(_measure(llm, batches, a.tokens, a.detokenize))
    finally:
        llm.shutdown()
    fixed, per_token = _fit([(r["batch"], r["cpu_ms_per_token"]) for r in rows])
    say(
        table(
            [
                [
                    str(r["batch"]),
                    f"{r['cpu_ms_per_token']:.3f}",
                    f"{r['step_ms']:.1f}",
                    f"{r['tokens_per_second']:.0f}",
                ]
                for r in rows
            ],
            ["decode batch", "CPU ms per token", "ms per decode step", "tokens/s"],
        )
    )
    say(
        f"fit: CPU ms per token = {fixed:.2f} / batch + {per_token:.3f} "
        f"(a decode step's fixed cost {fixed:.2f} ms; each token adds {per_token:.3f} ms)"
    )
    if a.json:
        out = {"rows": rows, "fixed_ms_per_step": fixed, "ms_per_token": per_token}
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

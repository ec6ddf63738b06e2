"""What a generated token costs a vLLM replica at each decode batch size (CPU), with and
without vLLM turning each step's tokens into text.

    python benchmarks/decode_batch.py [--model runs/small-qwen2] [--batches 4,8,16,32,64,128]
                                      [--tokens 128] [--repeats 3] [--json FILE]

One vLLM engine, built with the arguments a Laminar replica gives vLLM on CPU
(``VLLMRolloutEngine.start``: the engine core in this process, ``laminar_vllm.inproc.
InprocLLM``, eager, float32, scheduler stats on, one torch thread, token log-probs
returned, a delta per step), generates ``B`` sequences of exactly ``--tokens`` tokens at
once (EOS ignored, so the batch stays ``B`` to the end) for each ``B``, after a warm-up
round at that size; once without detokenizing (a replica serving requests without stop
strings) and once with it (requests with stop strings, which vLLM matches on text), in
turns, ``--repeats`` times: the medians are printed side by side, so a machine whose speed
drifts biases neither. Prints the CPU milliseconds per generated token, the wall
milliseconds per decode step and tokens/s, and a fit ``cost(B) = a / B + b``: ``a`` the
fixed CPU milliseconds of one decode step (scheduling, input preparation, sampling, output
handling: paid once per step whatever the batch), ``b`` the milliseconds each token adds
(the model's arithmetic).

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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, say, table

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process
# as a replica sets it: vLLM's own stats logger (it prints at INFO) is then not added
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


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


async def _measure(llm, batches: list[int], tokens: int, repeats: int) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    ids = iter(range(1 << 30))

    async def one(params) -> int:
        n = 0
        prompt = TokensPrompt(prompt_token_ids=list(range(3, 23)))
        async for out in llm.generate(prompt, params, f"r{next(ids)}"):
            n += len(out.outputs[0].token_ids)
        return n

    rows = []
    for b in batches:
        runs: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
        for rep in range(repeats):
            for detokenize in (False, True):
                params = SamplingParams(
                    max_tokens=tokens,
                    ignore_eos=True,
                    temperature=1.0,
                    logprobs=0,
                    output_kind=RequestOutputKind.DELTA,
                    detokenize=detokenize,
                )
                if rep == 0:
                    await asyncio.gather(*(one(params) for _ in range(b)))  # warm-up
                c0, t0 = _cpu(), time.monotonic()
                n = sum(await asyncio.gather(*(one(params) for _ in range(b))))
                runs[detokenize].append((_cpu() - c0, time.monotonic() - t0, n))
        row: dict[str, float] = {"batch": b}
        for detokenize, suffix in ((False, ""), (True, "_detokenized")):
            cpu = statistics.median(c / n for c, _, n in runs[detokenize])
            wall = statistics.median(w / n for _, w, n in runs[detokenize])
            row["cpu_ms_per_token" + suffix] = 1000 * cpu
            row["step_ms" + suffix] = 1000 * wall * b
            row["tokens_per_second" + suffix] = 1 / wall
        rows.append(row)
        say(
            f"  batch {b}: {row['cpu_ms_per_token']:.3f} CPU ms per token "
            f"({row['cpu_ms_per_token_detokenized']:.3f} detokenized)"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "runs" / "small-qwen2"))
    ap.add_argument("--batches", default="4,8,16,32,64,128")
    ap.add_argument("--tokens", type=int, default=128, help="generated per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per batch and mode")
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
        disable_log_stats=False,  # a replica reads vLLM's scheduler stats (repack's inputs)
    )
    llm = InprocLLM.from_engine_args(args, stat_loggers=[])
    say(f"model {model}, {a.tokens} tokens per sequence, batches {batches}")
    try:
        rows = asyncio.run(_measure(llm, batches, a.tokens, a.repeats))
    finally:
        llm.shutdown()
    fits = {
        suffix: _fit([(r["batch"], r["cpu_ms_per_token" + suffix]) for r in rows])
        for suffix in ("", "_detokenized")
    }
    say(
        table(
            [
                [
                    str(r["batch"]),
                    f"{r['cpu_ms_per_token']:.3f}",
                    f"{r['cpu_ms_per_token_detokenized']:.3f}",
                    f"{r['cpu_ms_per_token'] / r['cpu_ms_per_token_detokenized']:.2f}",
                    f"{r['step_ms']:.1f}",
                    f"{r['tokens_per_second']:.0f}",
                ]
                for r in rows
            ],
            [
                "decode batch",
                "CPU ms per token",
                "detokenized",
                "ratio",
                "ms per decode step",
                "tokens/s",
            ],
        )
    )
    for suffix, (fixed, per_token) in fits.items():
        say(
            f"fit{suffix.replace('_', ', ')}: CPU ms per token = {fixed:.2f} / batch + "
            f"{per_token:.3f} (a decode step's fixed cost {fixed:.2f} ms; each token adds "
            f"{per_token:.3f} ms)"
        )
    if a.json:
        out = {"rows": rows, "fit": {k or "plain": v for k, v in fits.items()}}
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""The FSDP trainer engine against a plain torch loop, side by side, on one long-tail batch.

    python benchmarks/trainer_engine.py                       # --shape tiny, CPU figures
    python benchmarks/trainer_engine.py --shape 1.5b          # on a GPU: Qwen2.5-1.5B shape
    python benchmarks/trainer_engine.py --smoke --json out.json   # seconds (the test suite)

Models are built locally from a transformers ``Qwen2Config`` with random weights (nothing
from a hub): ``tiny`` (CPU), ``0.5b`` / ``1.5b`` (the Qwen2.5 shapes, vocab 151,936).

The batch is the issue's long tail: G groups x S samples sharing a prompt, one sample per group
at the maximum response length, the others lognormal around a tenth of it (GPU: 8 x 8, prompt
256, responses up to 4,096; scaled down on CPU).

Figures (one run, same batch, same model):

- tokens/s (prompt + response tokens of the batch / optimiser-step time) of
  ``FSDPTrainerEngine`` (world size 1: packed micro-batches, chunked log-prob head; with and
  without activation checkpointing) vs a plain torch loop (the HF model, padded micro-batches,
  full float32 logits, ``policy_loss``, AdamW): the old engine's recipe without FSDP;
- MFU on GPU (model FLOPs: 6 x params x tokens + causal attention, over ``--peak-tflops``);
- memory: on GPU the peak allocated per step; on CPU (no allocator stats) the bytes one
  micro-batch's forward keeps for backward (``laminar_fsdp.memory``), for every combination
  of checkpointing and the chunked head, and for the plain loop;
- the longest single trajectory that trains: doubling from ``--probe-start`` until out of
  memory (GPU) or ``--probe-cap`` (CPU: so the probe ends in about a minute);
- export GB/s: the engine's bucketed export vs the old per-parameter ``.to("cpu", dtype)``
  vs a plain copy of the same tensors (GPU: into pinned host buffers, asynchronous), and a
  copy into fresh host memory kept until the end (what an export the consumer keeps costs:
  on CPU, first touch of new pages).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import say, table

# Qwen2.5 shapes (config.json of the released models), random weights here
SHAPES: dict[str, dict[str, Any]] = {
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=512),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=8192),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
}  # fmt: skip
# workload per scale: groups, samples, prompt, longest response, timed steps, probe start/cap
WORKLOADS = {
    "smoke": dict(groups=2, samples=2, prompt=8, response=24, steps=1, probe=(32, 64)),
    "cpu": dict(groups=4, samples=4, prompt=32, response=512, steps=2, probe=(512, 2048)),
    "gpu": dict(groups=8, samples=8, prompt=256, response=4096, steps=3, probe=(4096, 131072)),
}
H100_BF16_TFLOPS = 989.0  # dense


def build_model(shape: str, out: Path, device: torch.device) -> Path:
    """A random-weight Qwen2 model directory (config + safetensors), built here."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU when there is one: much faster
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    del model
    return out


def long_tail_batch(vocab: int, w: dict, seed: int = 0):
    """G groups x S samples; per group one response at the maximum, the rest lognormal
    around a tenth of it (p99/p50 of about 10, as in the paper's workloads)."""
    from laminar_core import FinishReason, Group, TrainBatch, Trajectory

    rng = random.Random(seed)
    groups = []
    for g in range(w["groups"]):
        prompt = [rng.randrange(3, vocab) for _ in range(w["prompt"])]
        trajs = []
        for j in range(w["samples"]):
            med = max(1, w["response"] // 10)
            n = (
                w["response"]
                if j == 0
                else min(w["response"], int(rng.lognormvariate(0, 1) * med) + 1)
            )
            trajs.append(
                Trajectory(
                    f"g{g}-{j}", f"g{g}", 0, prompt_ids=prompt,
                    response_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    logprobs=[rng.uniform(-12.0, -8.0) for _ in range(n)],
                    num_prompt_tokens=len(prompt), num_response_tokens=n,
                    finish_reason=FinishReason.STOP, reward=float(rng.random() < 0.5),
                )
            )  # fmt: skip
        groups.append(Group(f"g{g}", g, trajs))
    return TrainBatch(0, groups)


def tokens_of(batch) -> int:
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in batch.trajectories)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops(conf, batch) -> float:
    """Model FLOPs of one training step (forward + backward, no recompute): 6 x params x
    tokens for the matmuls (the tied LM head included once) + causal attention."""
    d, layers, v = conf.hidden_size, conf.num_hidden_layers, conf.vocab_size
    inter, h, kv = conf.intermediate_size, conf.num_attention_heads, conf.num_key_value_heads
    hd = d // h
    per_layer = d * (h * hd) * 2 + d * (kv * hd) * 2 + 3 * d * inter
    params = layers * per_layer + v * d
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in batch.trajectories]
    attn = 6 * layers * d * sum(n * n for n in lengths)  # QK^T and AV, causal half, x3 for bwd
    return 6 * params * sum(lengths) + attn


# -- the plain torch loop ----------------------------------------------------------------------
class PlainLoop:
    """The HF model trained directly: padded micro-batches of ``budget`` tokens (rows x
    longest), full float32 logits, log-softmax, core's ``policy_loss``, AdamW. bf16 autocast on
    GPU. What the engine did before (minus FSDP), as the baseline."""

    def __init__(self, path: Path, device: torch.device, budget: int, cfg) -> None:
        from transformers import AutoModelForCausalLM

        self.device, self.budget, self.cfg = device, budget, cfg
        attn = "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation=attn
        ).to(device)
        self.model.train()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-6)

    def _logprobs(self, mb) -> torch.Tensor:
        from laminar_core.training import responses

        dev = self.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = self.model(
                input_ids=mb.input_ids.to(dev),
                attention_mask=mb.attention_mask.to(dev),
                use_cache=False,
            ).logits
        logp = torch.log_softmax(logits.float() / float(self.cfg.rollout.temperature), -1)
        lp = logp.gather(-1, mb.labels.to(dev)[..., None])[..., 0]
        return responses(lp, mb.spans)

    def step(self, batch) -> None:
        from laminar_core.algorithms import compute_advantages, policy_loss
        from laminar_core.training import collate, pack_micro_batches, padded, response_mask

        trajs = batch.trajectories
        gid = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
        adv = compute_advantages(
            "grpo",
            torch.tensor([float(t.reward) for t in trajs]),
            torch.tensor([gid[t.group_id] for t in trajs]),
        )
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        total = sum(len(t.response_ids) for t in trajs)
        self.optim.zero_grad(set_to_none=True)
        for idx in pack_micro_batches(lengths, list(range(len(trajs))), self.budget):
            mb = collate(trajs, idx, 0)
            lp = self._logprobs(mb)
            mask = response_mask(mb.spans).to(self.device)
            beh = padded([trajs[i].logprobs for i in idx], mask.shape[1]).to(self.device)
            loss, _ = policy_loss(
                self.cfg.algorithm, lp, beh, adv[idx].to(self.device), mask,
                max_len=self.cfg.rollout.max_tokens,
            )  # fmt: skip
            (loss * mb.num_tokens / total).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optim.step()

    def saved_bytes(self, batch) -> int:
        from laminar_core.training import collate, pack_micro_batches
        from laminar_fsdp.memory import saved_activations

        trajs = batch.trajectories
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        groups = pack_micro_batches(lengths, list(range(len(trajs))), self.budget)
        mb = collate(trajs, max(groups, key=lambda g: sum(lengths[i] for i in g)), 0)
        with saved_activations() as saved:
            lp = self._logprobs(mb)
        del lp
        return saved.bytes


# -- the engine -----------------------------------------------------------------------------
def make_engine(cfg, **opts):
    from laminar_core import TrainerContext
    from laminar_fsdp import FSDPOptions, FSDPTrainerEngine

    eng = FSDPTrainerEngine(cfg, FSDPOptions(lr=1e-6, **opts))
    asyncio.run(eng.setup(TrainerContext(0, 1, eng.opt, cfg.algorithm, {"seed": 0})))
    return eng


def timed(fn, device: torch.device, steps: int) -> tuple[float, float]:
    """(seconds per call after one warm-up call, peak GiB allocated on GPU or 0)."""
    fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return dt, peak


def probe(step, make_batch, start: int, cap: int, device: torch.device) -> tuple[int, str]:
    """Double a single trajectory's length from ``start`` until a step fails for memory or
    ``cap`` is reached; returns (longest that trained, why the probe stopped)."""
    n, best = start, 0
    while n <= cap:
        try:
            step(make_batch(n))
            sync(device)
            best = n
        except torch.cuda.OutOfMemoryError:
            return best, f"out of memory at {n}"
        except RuntimeError as e:  # CPU allocation failures
            if "memory" not in str(e).lower():
                raise
            return best, f"out of memory at {n}"
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        n *= 2
    return best, f"cap {cap} reached"


def export_rates(eng, repeats: int) -> dict[str, float]:
    """GB/s of the engine's export, the old per-parameter export, and a plain (pinned on GPU)
    copy of the same tensors in the export dtype."""
    dev, dtype = eng.device, eng.export_dtype
    named = list(eng.lm.named_parameters())
    nbytes = sum(p.numel() for _, p in named) * dtype.itemsize

    async def drain() -> None:
        async for _ in eng.export_weights():
            pass

    def new() -> None:  # the interface's async generator, as the runtime consumes it
        asyncio.run(drain())

    def old() -> None:  # the engine's export before this change
        for _, p in named:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            full.detach().to("cpu", dtype)

    locals_ = [(p.to_local() if hasattr(p, "to_local") else p).detach().to(dtype) for _, p in named]
    if dev.type == "cuda":
        hosts = [torch.empty(t.shape, dtype=dtype, pin_memory=True) for t in locals_]

        def plain() -> None:
            for h, t in zip(hosts, locals_, strict=True):
                h.copy_(t, non_blocking=True)
            torch.cuda.synchronize(dev)
    else:

        def plain() -> None:
            for t in locals_:
                torch.empty_like(t).copy_(t)

    def kept() -> None:  # fresh host memory held until the end, as a consumer holds an export
        held = [torch.empty(t.shape, dtype=dtype, pin_memory=dev.type == "cuda") for t in locals_]
        for h, t in zip(held, locals_, strict=True):
            h.copy_(t, non_blocking=True)
        sync(dev)

    out = {}
    runs = (("export_new", new), ("export_old", old), ("copy_baseline", plain), ("copy_kept", kept))
    for name, fn in runs:
        fn()  # warm-up (allocators, pinned pool)
        best = math.inf
        for _ in range(repeats):
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_gbps"] = nbytes / best / 1e9
    out["export_gb"] = nbytes / 1e9
    return out


def _mb(value: float | None) -> str:
    return "out of memory" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=[s for s in SHAPES if s != "smoke"], default="tiny")
    ap.add_argument("--smoke", action="store_true", help="seconds: the smallest shape and batch")
    ap.add_argument("--json", type=Path, help="write the figures here as JSON")
    ap.add_argument("--steps", type=int, help="timed optimiser steps (after one warm-up)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--probe-start", type=int)
    ap.add_argument("--probe-cap", type=int)
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS)
    ap.add_argument("--cpu", action="store_true", help="stay on CPU even with a GPU")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = "smoke" if args.smoke else args.shape
    w = dict(WORKLOADS["smoke" if args.smoke else ("gpu" if cuda else "cpu")])
    steps = args.steps or w["steps"]
    start, cap = args.probe_start or w["probe"][0], args.probe_cap or w["probe"][1]
    budget = args.micro_batch_tokens
    from laminar_core import load_config

    res: dict[str, Any] = {"shape": shape, "device": str(device), "workload": w}
    with tempfile.TemporaryDirectory(prefix="laminar-bench-") as tmp:
        path = build_model(shape, Path(tmp) / "model", device)
        dtype = "bfloat16" if cuda else "float32"
        cfg = load_config(
            None,
            [f"model.path={path}", f"model.dtype={dtype}", "trainer.mini_batches=1",
             f"rollout.max_tokens={max(cap, w['response'])}", "run.steps=1000"],
        ).cfg  # fmt: skip
        vocab = SHAPES[shape]["vocab_size"]
        batch = long_tail_batch(vocab, w)
        ntok = tokens_of(batch)
        res["batch_tokens"] = ntok
        say(f"{shape} on {device}: {len(batch.trajectories)} trajectories, {ntok} tokens")

        def one(n: int):
            return long_tail_batch(
                vocab, {**w, "groups": 1, "samples": 1, "response": n - w["prompt"]}
            )

        rows = []
        conf = None
        for name, opts in (("engine", {}), ("engine+ckpt", {"gradient_checkpointing": True})):
            eng = make_engine(cfg, micro_batch_tokens=budget, **opts)
            conf = eng.lm.config
            dt, peak = timed(lambda e=eng: asyncio.run(e.train_step(batch)), device, steps)
            res[f"{name}_tok_s"], res[f"{name}_peak_gib"] = ntok / dt, peak
            rows.append((name, dt, peak))
            for chunk in (1024, 0):  # the chunked head, then full logits
                eng.opt.logprob_chunk = chunk
                key = f"saved_mb_{'ckpt' if opts else 'nockpt'}_{'chunk' if chunk else 'full'}"
                res[key] = eng.saved_activation_bytes(batch).bytes / 2**20
            eng.opt.logprob_chunk = 1024
            if opts:  # checkpointing + chunked head: the longest trajectory
                best, why = probe(
                    lambda b, e=eng: asyncio.run(e.train_step(b)), one, start, cap, device
                )
                res["engine_longest"], res["engine_longest_why"] = best, why
            else:
                res.update(export_rates(eng, repeats=1 if args.smoke else 3))
            asyncio.run(eng.close())
            del eng
            if cuda:
                torch.cuda.empty_cache()
        base = PlainLoop(path, device, budget, cfg)
        try:
            dt, peak = timed(lambda: base.step(batch), device, steps)
            res["plain_tok_s"], res["plain_peak_gib"] = ntok / dt, peak
        except torch.cuda.OutOfMemoryError:  # its float32 logits: [tokens, vocab] per row
            dt, peak = None, None
            res["plain_tok_s"] = res["plain_peak_gib"] = None
            base.optim.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        rows.insert(0, ("plain torch loop", dt, peak))
        try:
            res["saved_mb_plain"] = base.saved_bytes(batch) / 2**20
        except torch.cuda.OutOfMemoryError:
            res["saved_mb_plain"] = None
            torch.cuda.empty_cache()
        best, why = probe(base.step, one, start, cap, device)
        res["plain_longest"], res["plain_longest_why"] = best, why

    flops = model_flops(conf, batch)
    header = ["trainer", "tokens/s", "s/step"] + (["MFU", "peak GiB"] if cuda else [])
    out_rows = []
    for name, dt, peak in rows:
        if dt is None:
            out_rows.append([name, "out of memory", "-"] + (["-", "-"] if cuda else []))
            continue
        r = [name, f"{ntok / dt:,.0f}", f"{dt:.3f}"]
        if cuda:
            mfu = flops / dt / (args.peak_tflops * 1e12)
            res[f"{name.split()[0]}_mfu"] = mfu
            r += [f"{100 * mfu:.1f}%", f"{peak:.2f}"]
        out_rows.append(r)
    say(table(out_rows, header))
    say("")
    mem = [
        ["plain torch loop (full logits, padded)", _mb(res["saved_mb_plain"])],
        ["engine, full logits", _mb(res["saved_mb_nockpt_full"])],
        ["engine, chunked head", _mb(res["saved_mb_nockpt_chunk"])],
        ["engine, checkpointing, full logits", _mb(res["saved_mb_ckpt_full"])],
        ["engine, checkpointing + chunked head", _mb(res["saved_mb_ckpt_chunk"])],
    ]
    say(table(mem, ["saved for backward, largest micro-batch", "MB"]))
    say("")
    longest = [
        ["engine (checkpointing + chunked head)", res["engine_longest"], res["engine_longest_why"]],
        ["plain torch loop", res["plain_longest"], res["plain_longest_why"]],
    ]
    longest = [[a, str(b), c] for a, b, c in longest]
    say(table(longest, ["longest single trajectory that trains", "tokens", "probe"]))
    say("")
    copy = "pinned async copy" if cuda else "plain copy"
    say(
        table(
            [
                ["engine export (bucketed)", f"{res['export_new_gbps']:.2f}"],
                ["old export (per parameter .to)", f"{res['export_old_gbps']:.2f}"],
                [f"{copy} of the same tensors", f"{res['copy_baseline_gbps']:.2f}"],
                ["copy into fresh host memory, all kept", f"{res['copy_kept_gbps']:.2f}"],
            ],
            [f"export of {res['export_gb'] * 1e3:.1f} MB", "GB/s"],
        )
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    return res


if __name__ == "__main__":
    main()

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
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from concurrent.futures import Executor, Future
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


def setup_run(shape: str, w: dict, device: torch.device, tmp: Path, max_tokens: int, res: dict):
    """The model (random weights, in ``tmp``), its config and the long-tail batch of one run;
    the batch's token count goes to ``res``."""
    from laminar_core import load_config

    path = build_model(shape, tmp / "model", device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = load_config(
        None,
        [f"model.path={path}", f"model.dtype={dtype}", "trainer.mini_batches=1",
         f"rollout.max_tokens={max_tokens}", "run.steps=1000"],
    ).cfg  # fmt: skip
    batch = long_tail_batch(SHAPES[shape]["vocab_size"], w)
    res["batch_tokens"] = ntok = tokens_of(batch)
    say(f"{shape} on {device}: {len(batch.trajectories)} trajectories, {ntok} tokens")
    return path, cfg, batch


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


def timed(fn, device: torch.device, steps: int, warm_up: bool = True) -> tuple[float, float]:
    """(seconds per call after one warm-up call unless ``warm_up`` is false, peak GiB
    allocated on GPU or 0)."""
    if warm_up:
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


# -- per-step counts and the issue-37 goals ------------------------------------------------------
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC_EVENTS = (
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
)  # fmt: skip


def step_counts(step, device: torch.device) -> dict[str, int]:
    """One step under ``torch.profiler``: ``aten_ops`` (operator calls dispatched by the
    host, nested ones included), ``launches`` (CUDA kernel launches; on CPU none: every op
    runs where it is called), ``syncs`` (host waits on the device: stream/device/event
    synchronisations and synchronous copies) and ``host_reads`` (``aten::_local_scalar_dense``:
    a tensor's value read by the host, a sync on GPU, free on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(device)
    prof.events()
    counts = {"aten_ops": 0, "launches": 0, "syncs": 0, "host_reads": 0}
    for ev in prof.events():
        name = ev.name
        if name.startswith("aten::"):
            counts["aten_ops"] += 1
        if name in LAUNCH_EVENTS:
            counts["launches"] += 1
        if name in SYNC_EVENTS:
            counts["syncs"] += 1
        if name == "aten::_local_scalar_dense":
            counts["host_reads"] += 1
    return counts


class _SameThread(Executor):
    """Runs what is submitted at once, in the caller's thread: the profiler records the
    operators of the thread it was started in, and the engine's model work runs on a worker
    thread of its own."""

    def submit(self, fn, /, *args, **kwargs):
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:
            fut.set_exception(e)
        return fut


def _inline(eng, step):
    """``step`` with the engine's blocking work on the calling thread (for the profiler)."""

    def run():
        pool, eng._pool = eng._pool, _SameThread()
        try:
            step()
        finally:
            eng._pool = pool

    return run


# variants of the engine: main's packed-attention path (one SDPA call per trajectory, eager)
# and this one (one flex / varlen-flash call per layer, compiled layers and head)
GOAL_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # the options' defaults (also on main's code: before/after on CPU)
    "base": {"packed_attention": "sdpa"},
    "flex": {"packed_attention": "flex"},  # one compiled flex call per layer, nothing else
    "new": {"packed_attention": "auto", "compile": "inductor"},
    "base+ckpt": {"packed_attention": "sdpa", "gradient_checkpointing": True},
    "new+ckpt": {"packed_attention": "auto", "compile": "inductor", "gradient_checkpointing": True},
    "flex+ckpt": {"packed_attention": "flex", "gradient_checkpointing": True},
}


def variant(name: str, cuda: bool) -> dict[str, Any]:
    """A ``GOAL_VARIANTS`` entry; on CPU without compilation (a C++ build per graph there,
    minutes on the tiny shape: ``--compile-on-cpu`` keeps it)."""
    opts = dict(GOAL_VARIANTS[name])
    if not cuda and not COMPILE_ON_CPU:
        opts.pop("compile", None)
    return opts


COMPILE_ON_CPU = False


def goals(args, device: torch.device) -> dict:
    """The issue-37 figures in one run: each ``--rows`` entry's tokens/s, MFU, peak memory and
    per-step counts (``plain``: the plain torch loop), then ``--longest`` tokens in one
    trajectory with checkpointing, with and without activation offload. Every figure goes
    to ``--json`` as soon as it exists; a row that fails is recorded and the run goes on."""

    cuda = device.type == "cuda"
    w = dict(WORKLOADS["smoke" if args.smoke else ("gpu" if cuda else "cpu")])
    steps = args.steps or w["steps"]
    shape = "smoke" if args.smoke else args.shape
    res: dict[str, Any] = {"shape": shape, "device": str(device), "workload": w}
    if cuda:
        res["gpu"] = torch.cuda.get_device_name(device)
    rows = [r for r in args.rows.split(",") if r]
    t_start = time.perf_counter()

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")

    def out_of_time() -> bool:
        return args.budget_s > 0 and time.perf_counter() - t_start > args.budget_s

    with tempfile.TemporaryDirectory(prefix="laminar-bench-") as tmp:
        longest = max(args.longest or 0, w["response"] + w["prompt"])
        path, cfg, batch = setup_run(shape, w, device, Path(tmp), longest, res)
        vocab, ntok = SHAPES[shape]["vocab_size"], res["batch_tokens"]
        conf = None
        table_rows = []
        for name in rows:
            if out_of_time():
                res[f"{name}_error"] = "skipped: --budget-s spent"
                continue
            t0 = time.perf_counter()
            try:
                if name == "plain":
                    base = PlainLoop(path, device, args.micro_batch_tokens, cfg)
                    step = lambda b=base: b.step(batch)  # noqa: E731
                    closer = lambda: None  # noqa: E731
                    counted = step
                else:
                    eng = make_engine(
                        cfg, micro_batch_tokens=args.micro_batch_tokens, **variant(name, cuda)
                    )
                    conf = eng.lm.config
                    res[f"{name}_kernel"] = getattr(eng, "kernel", "sdpa")  # main's: no choice
                    step = lambda e=eng: asyncio.run(e.train_step(batch))  # noqa: E731
                    closer = lambda e=eng: asyncio.run(e.close())  # noqa: E731
                    counted = _inline(eng, step)
                step()  # warm-up: compilation, allocator, cuDNN plans
                sync(device)
                res[f"{name}_warmup_s"] = time.perf_counter() - t0
                dt, peak = timed(step, device, steps, warm_up=False)
                res[f"{name}_tok_s"], res[f"{name}_s_step"] = ntok / dt, dt
                res[f"{name}_peak_gib"] = peak
                counts = step_counts(counted, device)
                res.update({f"{name}_{k}": v for k, v in counts.items()})
                closer()
            except Exception as e:
                res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                say(f"{name}: {res[f'{name}_error']}")
                if cuda:
                    torch.cuda.empty_cache()
            save()
            table_rows.append(name)
            say(f"{name}: done in {time.perf_counter() - t0:.0f} s")
            # drop every reference to the row's trainer (the closures hold it too), so the next
            # row's peak memory is its own
            eng = base = step = closer = counted = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if conf is None:
            from transformers import AutoConfig

            conf = AutoConfig.from_pretrained(str(path))
        flops = model_flops(conf, batch)
        out = []
        for name in table_rows:
            if f"{name}_tok_s" not in res:
                out.append([name, res.get(f"{name}_error", "-")[:40]] + ["-"] * 6)
                continue
            mfu = flops / res[f"{name}_s_step"] / (args.peak_tflops * 1e12) if cuda else 0.0
            res[f"{name}_mfu"] = mfu
            out.append([
                name, f"{res[f'{name}_tok_s']:,.0f}", f"{100 * mfu:.1f}%" if cuda else "-",
                f"{res[f'{name}_peak_gib']:.2f}", str(res[f"{name}_launches"]),
                str(res[f"{name}_syncs"]), str(res[f"{name}_host_reads"]),
                str(res[f"{name}_aten_ops"]),
            ])  # fmt: skip
        hdr = ["trainer", "tokens/s", "MFU", "peak GiB", "launches", "syncs", "host reads",
               "aten ops"]  # fmt: skip
        if out:
            say(table(out, hdr))
        save()
        if args.longest:
            lrows = []
            # the compiled variant unless it failed above (then flex attention alone)
            ckpt = "flex+ckpt" if "new+ckpt_error" in res else "new+ckpt"
            runs = [(f"{ckpt}+offload", {**variant(ckpt, cuda), "activation_offload": True})]
            if not args.longest_offload_only:
                runs.append((ckpt, variant(ckpt, cuda)))
            for label, opts in runs:
                if out_of_time():
                    res[f"longest_{label}"] = "skipped: --budget-s spent"
                    continue
                t0 = time.perf_counter()
                one = long_tail_batch(
                    vocab, {**w, "groups": 1, "samples": 1, "response": args.longest - w["prompt"]}
                )
                try:
                    eng = make_engine(cfg, micro_batch_tokens=args.longest, **opts)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    asyncio.run(eng.train_step(one))
                    sync(device)
                    dt = time.perf_counter() - t0
                    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
                    res[f"longest_{label}"] = {"tokens": args.longest, "peak_gib": peak, "s": dt}
                    lrows.append([label, str(args.longest), f"{peak:.2f}", f"{dt:.1f}"])
                    asyncio.run(eng.close())
                except torch.cuda.OutOfMemoryError as e:
                    res[f"longest_{label}"] = f"out of memory: {str(e)[:200]}"
                    lrows.append([label, f"{args.longest}: out of memory", "-", "-"])
                except Exception as e:
                    res[f"longest_{label}"] = f"{type(e).__name__}: {str(e)[:300]}"
                    lrows.append([label, f"{type(e).__name__}", "-", "-"])
                eng = None
                if cuda:
                    torch.cuda.empty_cache()
                save()
            if lrows:
                hdr = ["one trajectory, 1 step", "tokens", "peak GiB", "s (incl. setup)"]
                say(table(lrows, hdr))
    res["elapsed_s"] = time.perf_counter() - t_start
    save()
    return res


def check_attention(device: torch.device) -> dict[str, float]:
    """Packed flex attention (compiled on CUDA) against one SDPA call per trajectory, forward
    and backward, in bf16 on random inputs: max |difference| over max |reference|."""
    from laminar_fsdp.attention import packed_attention
    from laminar_fsdp.packed_row import PackedRow

    g = torch.Generator(device="cpu").manual_seed(0)
    bounds = [0, 300, 301, 1500, 1536, 4000, 4096]
    n = bounds[-1]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float64
    base = [torch.randn(1, h, n, 128, generator=g).to(device, dt) for h in (12, 2, 2)]
    dout = torch.randn(1, 12, n, 128, generator=g).to(device, dt)
    grads = device.type == "cuda"  # flex attention has no backward on CPU
    got = {}
    for kernel in ("sdpa", "flex"):
        q, k, v = (t.clone().requires_grad_(grads) for t in base)
        row = PackedRow.of(bounds, device, kernel=kernel)
        out = packed_attention(q, k, v, row, 128**-0.5)
        got[kernel] = [out.detach().float()]
        if grads:
            out.backward(dout)
            got[kernel] += [q.grad.float(), k.grad.float(), v.grad.float()]
    rel = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got["flex"], got["sdpa"]):
        rel[name] = float((a - b).abs().max() / b.abs().max())
    return rel


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
    ap.add_argument(
        "--goals",
        action="store_true",
        help="issue 37's figures: --rows side by side, counts per step, --longest",
    )
    ap.add_argument(
        "--rows",
        default="plain,base,new",
        help=f"with --goals: plain and any of {', '.join(GOAL_VARIANTS)}",
    )
    ap.add_argument(
        "--longest",
        type=int,
        default=0,
        help="with --goals: one trajectory of this many tokens, ckpt +- offload",
    )
    ap.add_argument(
        "--longest-offload-only",
        action="store_true",
        help="with --longest: only with activation offload",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="with --goals: skip what is left after this many seconds",
    )
    ap.add_argument(
        "--compile-on-cpu",
        action="store_true",
        help="with --goals on CPU: compile the 'new' rows too (minutes)",
    )
    ap.add_argument(
        "--check-attention",
        action="store_true",
        help="flex vs per-trajectory SDPA, forward and backward (GPU)",
    )
    args = ap.parse_args(argv)  # fmt: skip
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.check_attention:
        rel = check_attention(device)
        say("flex vs SDPA per trajectory, max|diff|/max|ref|: " + json.dumps(rel))
        return rel
    if args.goals:
        global COMPILE_ON_CPU
        COMPILE_ON_CPU = args.compile_on_cpu
        return goals(args, device)
    shape = "smoke" if args.smoke else args.shape
    w = dict(WORKLOADS["smoke" if args.smoke else ("gpu" if cuda else "cpu")])
    steps = args.steps or w["steps"]
    start, cap = args.probe_start or w["probe"][0], args.probe_cap or w["probe"][1]
    budget = args.micro_batch_tokens

    res: dict[str, Any] = {"shape": shape, "device": str(device), "workload": w}
    with tempfile.TemporaryDirectory(prefix="laminar-bench-") as tmp:
        path, cfg, batch = setup_run(shape, w, device, Path(tmp), max(cap, w["response"]), res)
        vocab, ntok = SHAPES[shape]["vocab_size"], res["batch_tokens"]

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

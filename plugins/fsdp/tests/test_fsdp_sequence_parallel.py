"""Ulysses sequence parallelism over gloo (real processes): 2 ranks sharing every packed row
give the log-probs, loss and gradients of 1 rank holding the rows whole.

The SP run also turns activation checkpointing on, so the recompute in backward goes through
the all-to-alls too; the 1-rank reference uses transformers' own packed SDPA attention (a
mask from the restarting position ids), so the Ulysses path (all-to-alls, KV heads repeated
1 -> 2 for the split, SDPA per trajectory) is checked against an independent implementation.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import torch.multiprocessing as mp
from fsdp_batches import config, long_tail_batch

from laminar_core import TrainerContext, free_port
from laminar_core.training import plan_micro_batches
from laminar_fsdp import FSDPOptions, FSDPTrainerEngine

# 24 real tokens per rank: a row of 48 split at column 24, through the middle of trajectories
SP_OPTS = {"lr": 1e-3, "micro_batch_tokens": 24, "sequence_parallel": 2}
# transformers' own packed attention (a block-diagonal mask from the restarting position ids)
REF_OPTS = {"lr": 1e-3, "micro_batch_tokens": 48, "attention": "sdpa"}


def _run(rank: int, world: int, port: int, model_dir: str, opts: dict) -> dict:
    cfg = config(model_dir, "algorithm.loss_agg=seq_mean_token_mean")

    async def main() -> dict:
        # two ranks on one host: gloo, also where a GPU is (NCCL refuses two ranks on one GPU)
        eng = FSDPTrainerEngine(cfg, FSDPOptions(**opts, backend="gloo"))
        ctx = TrainerContext(
            rank, world, eng.opt, cfg.algorithm, {"init_method": f"tcp://127.0.0.1:{port}"}
        )
        await eng.setup(ctx)
        batch = long_tail_batch(eng.lm.config.vocab_size, response=(1, 20))
        logprobs = await eng.compute_logprobs(batch)
        metrics = await eng.train_step(batch)
        grads = {n: p.grad.full_tensor().clone() for n, p in eng.lm.named_parameters()}
        plan = plan_micro_batches(
            batch.trajectories, list(range(len(batch.trajectories))), eng.batch_layout()
        )
        await eng.close()
        return {
            "logprobs": logprobs,
            "metrics": metrics,
            "grads": grads,
            "rows": [mb.input_ids.shape[1] for mb in plan],
        }

    return asyncio.run(main())


def _rank(rank: int, port: int, model_dir: str, out: dict) -> None:
    torch.set_num_threads(1)
    out[("sp", rank)] = _run(rank, 2, port, model_dir, {**SP_OPTS, "gradient_checkpointing": True})
    if rank == 0:  # the reference: one rank, whole rows, no checkpointing
        out["ref"] = _run(0, 1, free_port(), model_dir, REF_OPTS)


@pytest.fixture(scope="module")
def sp_results(tiny_model) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, tiny_model, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return dict(out)


def test_rows_are_split_across_trajectories(sp_results):
    # several rows of 48 tokens (2 x 24): trajectories straddle the two ranks' halves
    rows = sp_results[("sp", 0)]["rows"]
    assert len(rows) > 1 and all(r % 2 == 0 for r in rows) and max(rows) == 48


def test_two_sp_ranks_match_one_rank(sp_results):
    ref, r0, r1 = sp_results["ref"], sp_results[("sp", 0)], sp_results[("sp", 1)]
    for got in (r0, r1):
        for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "grad_norm"):
        assert r0["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
    assert r0["metrics"]["trained_trajectories"] == ref["metrics"]["trained_trajectories"]
    assert set(r0["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, name  # every parameter gets a gradient
        torch.testing.assert_close(r0["grads"][name], g, atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(r1["grads"][name], g, atol=1e-6, rtol=1e-4, msg=name)

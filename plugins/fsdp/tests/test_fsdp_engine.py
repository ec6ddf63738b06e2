"""The FSDP2 trainer engine on 2 gloo ranks (real processes): a GRPO step changes the weights
the same way on both ranks, the exported weights are the full model in HF naming, a fresh
model's recompute agrees with its own "rollout" log-probs, and a checkpoint round-trips."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from laminar_core import (
    FinishReason,
    Group,
    TrainBatch,
    TrainerContext,
    Trajectory,
    load_config,
)
from laminar_core.testing import run_ranks
from laminar_fsdp import FSDPOptions, FSDPTrainerEngine


def _batch(vocab: int, version: int = 0) -> TrainBatch:
    rng = random.Random(0)
    groups = []
    for g in range(3):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(3, 6))]
        trajs = []
        for j in range(4):
            n = rng.randint(1, 12)
            trajs.append(
                Trajectory(
                    f"g{g}-{j}",
                    f"g{g}",
                    version,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(2, vocab) for _ in range(n)],
                    logprobs=[-4.0] * n,
                    num_prompt_tokens=len(prompt),
                    num_response_tokens=n,
                    finish_reason=FinishReason.STOP,
                    reward=float(j),
                )
            )
        groups.append(Group(f"g{g}", g, trajs))
    # a failed trajectory is not trained on
    groups[0].trajectories.append(
        Trajectory(
            "g0-x",
            "g0",
            version,
            prompt_ids=[3],
            response_ids=[4],
            logprobs=[-1.0],
            finish_reason=FinishReason.FAILED,
            error="reward: boom",
        )
    )
    return TrainBatch(0, groups)


def _rank(rank: int, world: int, port: int, model_dir: str, ckpt: str, out: dict) -> None:
    torch.set_num_threads(1)
    cfg = load_config(
        None,
        [f"model.path={model_dir}", "model.dtype=float32", "trainer.mini_batches=2", "run.steps=4"],
    ).cfg

    async def main() -> dict:
        # buckets of 256 KiB: the tiny model's ~1 MiB goes out in several
        opts = FSDPOptions(lr=1e-3, micro_batch_tokens=40, export_bucket_mb=0.25, backend="gloo")
        eng = FSDPTrainerEngine(cfg, opts)
        ctx = TrainerContext(
            rank,
            world,
            eng.opt,
            cfg.algorithm,
            {"init_method": f"tcp://127.0.0.1:{port}", "seed": 0},
        )
        await eng.setup(ctx)
        before = {n: t async for n, t in eng.export_weights()}
        batch = _batch(eng.model.config.vocab_size)
        metrics = await eng.train_step(batch)
        after = {n: t async for n, t in eng.export_weights()}
        await eng.save_checkpoint(ckpt)
        await eng.train_step(batch)  # moves the weights on past the checkpoint
        await eng.load_checkpoint(ckpt)
        restored = {n: t async for n, t in eng.export_weights()}
        await eng.close()
        return {
            "metrics": metrics,
            "changed": sum(not torch.equal(before[k], after[k]) for k in before),
            "names": sorted(after),
            "before": before,
            "restored_equal": all(torch.equal(after[k], restored[k]) for k in after),
            "version": eng.version,
            "checksum": sum(float(v.double().sum()) for v in after.values()),
        }

    out[rank] = asyncio.run(main())


def test_two_gloo_ranks_train_export_and_checkpoint(tiny_model, tmp_path):
    out = run_ranks(_rank, 2, tiny_model, str(tmp_path / "ckpt"))
    r0, r1 = out[0], out[1]
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_model, "model.safetensors"), "pt") as f:
        hf_names = set(f.keys())
    assert set(r0["names"]) <= hf_names | {"lm_head.weight"}  # HF naming, full model
    with safe_open(os.path.join(tiny_model, "model.safetensors"), "pt") as f:
        for name, t in r0["before"].items():  # the export of the loaded model is the file
            assert torch.equal(t, f.get_tensor(name)), name
    assert r0["changed"] > 0  # the step moved the weights
    assert r0["checksum"] == pytest.approx(r1["checksum"])  # both ranks hold the same model
    assert r0["restored_equal"] and r1["restored_equal"]
    assert r0["version"] == 1  # the checkpoint's version, not the step after it
    m = r0["metrics"]
    assert m["trained_trajectories"] == 12.0  # the failed one is left out
    assert m["grad_norm"] > 0

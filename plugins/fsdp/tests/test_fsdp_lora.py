"""``trainer.lora`` on the FSDP2 trainer, 2 gloo ranks (real processes), with gradient
checkpointing and a small log-prob chunk: only the adapters train (the optimiser holds
nothing else, the base weights stay as loaded), a version is the adapter tensors alone
under PEFT's names, both ranks hold the same adapter, and a checkpoint (adapters and their
optimiser state, no base weights) round-trips."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from test_fsdp_engine import _batch, run_ranks

from laminar_core import TrainerContext, load_config
from laminar_fsdp import FSDPOptions, FSDPTrainerEngine

LORA = [
    "model.dtype=float32",
    "trainer.mini_batches=2",
    "run.steps=4",
    "trainer.engine=fsdp",
    "rollout.engine=vllm",
    "cluster.gpus=3",
    "cluster.trainer_gpus=2",
    "trainer.lora.rank=4",
    "trainer.lora.target_modules=[q_proj,v_proj,down_proj]",
]


def _rank(rank: int, world: int, port: int, model_dir: str, ckpt: str, out: dict) -> None:
    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={model_dir}", *LORA]).cfg

    async def main() -> dict:
        opts = FSDPOptions(
            lr=1e-2,
            micro_batch_tokens=40,
            backend="gloo",
            gradient_checkpointing=True,
            logprob_chunk=8,
        )
        eng = FSDPTrainerEngine(cfg, opts)
        init = {"init_method": f"tcp://127.0.0.1:{port}", "seed": 0}
        await eng.setup(TrainerContext(rank, world, eng.opt, cfg.algorithm, init))
        base = {
            n: p.full_tensor().clone() for n, p in eng.lm.named_parameters() if ".lora_" not in n
        }
        before = {n: t.clone() async for n, t in eng.export_weights()}
        batch = _batch(eng.model.config.vocab_size)
        metrics = await eng.train_step(batch)
        after = {n: t.clone() async for n, t in eng.export_weights()}
        base_after = {n: p.full_tensor() for n, p in eng.lm.named_parameters() if n in base}
        await eng.save_checkpoint(ckpt)
        await eng.train_step(batch)
        await eng.load_checkpoint(ckpt)
        restored = {n: t async for n, t in eng.export_weights()}
        optimised = sum(len(g["params"]) for g in eng.optim.param_groups)
        await eng.close()
        return {
            "names": list(after),
            "b_zero_before": all(not t.any() for n, t in before.items() if "lora_B" in n),
            "changed": sum(not torch.equal(before[k], after[k]) for k in after),
            "base_unchanged": all(torch.equal(base[n], base_after[n]) for n in base),
            "restored": all(torch.equal(after[k], restored[k]) for k in after),
            "optimised": optimised,
            "checksum": sum(float(v.double().sum()) for v in after.values()),
            "grad_norm": metrics["grad_norm"],
        }

    out[rank] = asyncio.run(main())


def test_lora_trains_only_adapters_and_exports_them_alone(tiny_model, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = run_ranks(_rank, 2, tiny_model, ckpt)
    r0, r1 = out[0], out[1]
    layers = 2  # the tiny model's decoder layers
    assert len(r0["names"]) == 2 * 3 * layers  # A and B of 3 targets per layer, nothing else
    assert all(n.startswith("base_model.model.model.layers.") for n in r0["names"])
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in r0["names"])
    assert r0["b_zero_before"]  # version 0 is the base model
    assert r0["changed"] > 0 and r0["grad_norm"] > 0
    assert r0["base_unchanged"] and r1["base_unchanged"]
    assert r0["optimised"] == len(r0["names"])  # the optimiser holds the adapters only
    assert r0["checksum"] == r1["checksum"]
    assert r0["restored"] and r1["restored"]
    model_bytes = (Path(tiny_model) / "model.safetensors").stat().st_size
    ckpt_bytes = sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file())
    assert ckpt_bytes < model_bytes / 2  # adapters + their Adam moments, no base weights

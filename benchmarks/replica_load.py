"""A replica's side of a weight version: full model vs LoRA adapter, per rollout engine.

For each engine (``sglang``, ``vllm``), one replica of the tiny model is started for full
fine-tuning and one with ``trainer.lora`` (rank 8, all seven projections), and each loads
``--versions`` versions the way the relay tier hands them over (``SharedWeights``: the node
relay's file in ``/dev/shm``): the full model's tensors, or the adapter's. Printed: the
bytes per version and the median seconds of ``update_weights`` (SGLang: its weight update
and cache flush, or ``load_lora_adapter`` + ``unload_lora_adapter`` of the previous one;
vLLM: ``reload_weights`` and a prefix-cache reset, or ``add_lora`` + ``remove_lora``),
then one generation to show the replica serves.

    python benchmarks/replica_load.py [--engines sglang vllm] [--versions 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import say, table

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from laminar_core import GenerationRequest, SamplingParams
from laminar_core.models import build_tiny_model
from laminar_core.testing import share_version
from laminar_core.testing.lora import adapted_model
from laminar_core.training import LoRASpec, adapter_tensors

SPEC = LoRASpec(
    8, 16.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


def _engine(kind: str, model_dir: str, lora: LoRASpec | None):
    if kind == "sglang":
        from laminar_sglang import SGLangOptions, SGLangRolloutEngine

        opts = SGLangOptions(device="cpu", max_total_tokens=8192)
        return SGLangRolloutEngine("b", model_dir, opts, model_dtype="float32", lora=lora)
    from laminar_vllm import VLLMOptions, VLLMRolloutEngine

    opts = VLLMOptions(kv_cache_mb=32, max_model_len=256, max_num_seqs=8)
    return VLLMRolloutEngine("b", model_dir, opts, model_dtype="float32", lora=lora)


async def _measure(kind: str, model_dir: str, lora: bool, versions: int, shm: Path) -> dict:
    model = adapted_model(model_dir, SPEC, 0)
    eng = _engine(kind, model_dir, SPEC if lora else None)
    await eng.start()
    try:
        secs, nbytes = [], 0
        for v in range(1, versions + 1):
            with torch.no_grad():  # a new version: every tensor moves
                for _, p in adapter_tensors(model) if lora else model.named_parameters():
                    p.add_(0.01)
            if lora:
                named = [(n, p.detach().clone()) for n, p in adapter_tensors(model)]
            else:
                named = [
                    (n, p.detach().clone())
                    for n, p in model.named_parameters()
                    if ".lora_" not in n
                ]
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            ref = share_version(shm / f"{kind}-{lora}", 0, v, named)
            t0 = time.perf_counter()
            await eng.update_weights(ref)
            secs.append(time.perf_counter() - t0)
        req = GenerationRequest(
            "x", "g", prompt_ids=[72, 15, 22], sampling=SamplingParams(max_tokens=8)
        )
        t = await eng.generate(req)
        assert t.versions == [versions] and t.response_ids
    finally:
        await eng.stop()
    return {"engine": kind, "lora": lora, "bytes": nbytes, "seconds": statistics.median(secs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=["sglang", "vllm"])
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "m", seed=0))
        for kind in args.engines:
            for lora in (False, True):
                rows.append(asyncio.run(_measure(kind, model_dir, lora, args.versions, Path(tmp))))
                say(rows[-1])
    say(
        table(
            [
                [
                    r["engine"],
                    f"LoRA r={SPEC.rank}" if r["lora"] else "full",
                    f"{r['bytes'] / 1e6:.3f}",
                    f"{r['seconds']:.4f}",
                ]
                for r in rows
            ],
            ["engine", "version", "MB per version", "update_weights s (median)"],
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

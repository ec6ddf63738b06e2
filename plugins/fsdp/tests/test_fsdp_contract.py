"""laminar-fsdp against core's trainer contract (``check_trainer_engine``): one rank in this
process, and two gloo ranks as spawned processes. Log-probs equal transformers' on the same
weights, the export loads into ``AutoModelForCausalLM``, checkpoints restore the log-probs,
optimizer and scheduler."""

from __future__ import annotations

import asyncio
import os

import pytest

from laminar_core.models import build_tiny_model
from laminar_core.testing import check_trainer_engine

os.environ.setdefault("OMP_NUM_THREADS", "1")
OPTIONS = ["trainer.fsdp.lr=1e-3", "trainer.fsdp.micro_batch_tokens=40"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_passes_the_trainer_contract(tiny, tmp_path, world):
    report = asyncio.run(
        check_trainer_engine("fsdp", tiny, tmp_path, world_size=world, overrides=OPTIONS)
    )
    assert report["logprobs_hf_max_diff"] < 1e-4
    assert report["metrics"]["trained_trajectories"] == 12.0

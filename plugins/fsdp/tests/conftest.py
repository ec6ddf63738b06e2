"""Shared set-up of the FSDP plugin's tests: one thread per torch op, one tiny model."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from laminar_core.models import build_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="session")
def narrow_model(tmp_path_factory) -> str:
    """Hidden 64 and MLP 96, not vocab 128: a ``[tokens, vocab]`` tensor is told by its shape."""
    path = tmp_path_factory.mktemp("narrow")
    return str(build_tiny_model(path, seed=0, hidden_size=64, intermediate_size=96))

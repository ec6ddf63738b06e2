"""Batches and configs shared by the FSDP plugin's tests (importable in spawned ranks)."""

from __future__ import annotations

import random

from laminar_core import FinishReason, Group, TrainBatch, Trajectory, load_config


def config(model_dir: str, *extra: str):
    """A run config for one optimiser step over the whole batch (``mini_batches=1``)."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "model.dtype=float32",
            "trainer.mini_batches=1",
            "run.steps=4",
            "rollout.max_tokens=64",
            *extra,
        ],
    ).cfg


def long_tail_batch(
    vocab: int,
    groups: int = 3,
    samples: int = 4,
    prompt: tuple[int, int] = (3, 6),
    response: tuple[int, int] = (1, 12),
    seed: int = 0,
    version: int = 0,
) -> TrainBatch:
    """Groups of trajectories sharing a prompt, random tokens, lengths drawn from the ranges
    (one sample per group gets the top of the response range: the long tail)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        p = [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt))]
        trajs = []
        for j in range(samples):
            n = response[1] if j == 0 else rng.randint(*response)
            trajs.append(
                Trajectory(
                    f"g{g}-{j}",
                    f"g{g}",
                    version,
                    prompt_ids=p,
                    response_ids=[rng.randrange(2, vocab) for _ in range(n)],
                    logprobs=[rng.uniform(-6.0, -3.0) for _ in range(n)],
                    num_prompt_tokens=len(p),
                    num_response_tokens=n,
                    finish_reason=FinishReason.STOP,
                    reward=float(rng.random() < 0.5),
                )
            )
        out.append(Group(f"g{g}", g, trajs))
    return TrainBatch(0, out)

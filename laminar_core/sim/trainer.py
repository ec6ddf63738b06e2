"""The simulated trainer: step time proportional to tokens, weights as meta tensors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from laminar_core.interfaces import BuildContext, TrainerContext, TrainerEngine
from laminar_core.sim.config import SimTrainerConfig
from laminar_core.types import TrainBatch


class SimTrainerEngine(TrainerEngine):
    """One simulated trainer group (it models all ``gpus`` ranks at once).

    ``export_weights`` yields ``meta`` tensors: the relay tier turns them into phantom buckets
    of the right size, so a 72B model costs nothing to "move" but the right time.
    """

    Options = SimTrainerConfig

    @classmethod
    def from_config(cls, ctx: BuildContext) -> SimTrainerEngine:
        model = ctx.config.model
        dtype = getattr(torch, model.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"model.dtype: unknown torch dtype '{model.dtype}'")
        return cls(ctx.options, ctx.gpus, int(model.params_b * 1e9), dtype)

    def __init__(
        self,
        config: SimTrainerConfig,
        gpus: int,
        param_count: int,
        dtype: torch.dtype = torch.bfloat16,
        num_tensors: int = 64,
    ) -> None:
        if gpus < 1:
            raise ValueError(f"simulated trainer needs at least one GPU (got {gpus})")
        self.cfg = config
        self.gpus = gpus
        self.param_count = int(param_count)
        self.dtype = dtype
        self.num_tensors = max(1, num_tensors)
        self.steps = 0
        self.tokens_trained = 0

    def step_seconds(self, tokens: int) -> float:
        eff = self.gpus**self.cfg.scaling_exponent  # 1.0 = linear speed-up
        return self.cfg.step_overhead_s + tokens * self.cfg.gpu_seconds_per_token / eff

    async def setup(self, ctx: TrainerContext) -> None:
        return None

    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return [[] for _ in batch.trajectories]

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        tokens = batch.num_tokens
        seconds = self.step_seconds(tokens)
        await asyncio.sleep(seconds)
        self.steps += 1
        self.tokens_trained += tokens
        return {"train_seconds": seconds, "train_tokens": float(tokens)}

    async def export_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        per, rest = divmod(self.param_count, self.num_tensors)
        for i in range(self.num_tensors):
            n = per + (1 if i < rest else 0)
            yield f"layers.{i}.weight", torch.empty(n, dtype=self.dtype, device="meta")

    async def save_checkpoint(self, directory: str) -> None:
        return None

    async def load_checkpoint(self, directory: str) -> None:
        return None

    async def close(self) -> None:
        return None

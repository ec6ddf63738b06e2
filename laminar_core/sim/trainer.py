"""The simulated trainer: step time from a FLOP / parallelism model, weights as meta tensors.

``SimTrainerConfig`` (``trainer.sim``) holds the model and its parameters; the paper setups
state their values and public sources in ``examples/sim/*.yaml``. ``step_breakdown`` says
where a step's time goes (``sim.study`` reports it; ``benchmarks/fidelity.py`` prints it).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch

from laminar_core.interfaces import BuildContext, TrainerContext, TrainerEngine
from laminar_core.sim.config import SimTrainerConfig
from laminar_core.types import TrainBatch

_GIB = float(1 << 30)


@dataclass(frozen=True)
class StepTime:
    """One trainer step's time by part (seconds); ``total`` is the step."""

    compute: float = 0.0  # model FLOPs at the stated MFU
    bubble: float = 0.0  # pipeline bubble
    comm: float = 0.0  # exposed gradient all-reduce
    optimizer: float = 0.0
    overhead: float = 0.0
    switch: float = 0.0  # co-located sync: rollout <-> training offload/onload

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.comm + self.optimizer + self.overhead + self.switch


class SimTrainerEngine(TrainerEngine):
    """One simulated trainer group (it models all ``gpus`` ranks at once).

    ``export_weights`` yields ``meta`` tensors: the relay tier turns them into phantom buckets
    of the right size, so a 72B model costs nothing to "move" but the right time.
    ``colocated``: the GPUs also run the rollout (``sync`` on verl's hybrid engine), so each
    step pays the switch between the two (``SimTrainerConfig``).
    """

    Options = SimTrainerConfig

    @classmethod
    def from_config(cls, ctx: BuildContext) -> SimTrainerEngine:
        cfg = ctx.config
        dtype = getattr(torch, cfg.model.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"model.dtype: unknown torch dtype '{cfg.model.dtype}'")
        # the runtime gives the trainer every GPU only when sync time-shares them
        colocated = ctx.gpus >= cfg.cluster.gpus
        return cls(
            ctx.options,
            ctx.gpus,
            int(cfg.model.params_b * 1e9),
            dtype,
            mini_batches=cfg.trainer.mini_batches,
            colocated=colocated,
            gpus_per_replica=cfg.cluster.gpus_per_replica,
        )

    def __init__(
        self,
        config: SimTrainerConfig,
        gpus: int,
        param_count: int,
        dtype: torch.dtype = torch.bfloat16,
        num_tensors: int = 64,
        mini_batches: int = 1,
        colocated: bool = False,
        gpus_per_replica: int = 1,
    ) -> None:
        if gpus < 1:
            raise ValueError(f"simulated trainer needs at least one GPU (got {gpus})")
        self.cfg = config
        self.gpus = gpus
        self.param_count = int(param_count)
        self.dtype = dtype
        self.num_tensors = max(1, num_tensors)
        self.mini_batches = max(1, mini_batches)
        self.colocated = colocated
        self.gpus_per_replica = max(1, gpus_per_replica)
        self.steps = 0
        self.tokens_trained = 0
        self.breakdowns: list[StepTime] = []

    # -- the model -------------------------------------------------------------------------
    def switch_seconds(self) -> float:
        """Co-located sync: the offload/onload between rollout and training, per step."""
        c = self.cfg
        if not (self.colocated and c.switch):
            return 0.0
        elem = torch.empty((), dtype=self.dtype).element_size()
        weights = self.param_count * elem / self.gpus_per_replica  # a replica's shard
        gib = 2 * weights / _GIB  # sleep (offload) and wake (onload) of the rollout
        if c.switch_trainer_state:
            gib += 2 * self.param_count * c.trainer_state_bytes_per_param / self.gpus / _GIB
        return gib * c.switch_s_per_gib

    def step_breakdown(self, seq_lengths: Sequence[int]) -> StepTime:
        """The step time of a batch of sequences (prompt + response tokens each)."""
        c = self.cfg
        tokens = sum(seq_lengths)
        switch = self.switch_seconds()
        if c.kind == "linear":
            eff = self.gpus**c.scaling_exponent  # 1.0 = linear speed-up
            return StepTime(
                compute=tokens * c.gpu_seconds_per_token / eff,
                overhead=c.step_overhead_s,
                switch=switch,
            )
        n = self.param_count
        # dense FLOPs, plus causal attention: 2 * layers * hidden * L per token and forward
        # pass for a sequence of length L (QK^T and AV over L/2 keys on average)
        passes = c.flops_per_param_token / 2  # forward-pass equivalents per token
        attn = 2.0 * c.layers * c.hidden * sum(s * s for s in seq_lengths)
        flops = c.flops_per_param_token * n * tokens + passes * attn
        compute = flops / (self.gpus * c.peak_tflops * 1e12 * c.mfu)
        model_gpus = c.tp * c.pp
        dp = max(1, self.gpus // model_gpus)
        bubble = 0.0
        if c.pp > 1:
            per_pipe = tokens / (self.mini_batches * dp)
            m = max(1, math.ceil(per_pipe / c.micro_batch_tokens))
            frac = (c.pp - 1) / (m + c.pp - 1)
            bubble = compute * frac / (1 - frac)
        grad = n * c.grad_bytes_per_param / model_gpus  # one GPU's share of the gradients
        allreduce = 2 * (dp - 1) / dp * grad / (c.dp_gbps * 1e9 / 8) if dp > 1 else 0.0
        comm = self.mini_batches * allreduce * (1 - c.comm_overlap)
        optimizer = self.mini_batches * 2 * n * c.optimizer_bytes_per_param / self.gpus
        optimizer /= c.hbm_tbps * 1e12
        return StepTime(compute, bubble, comm, optimizer, c.step_overhead_s, switch)

    def step_seconds(self, tokens: int | Sequence[int]) -> float:
        """Step time for ``tokens`` (a token count: one sequence) or sequence lengths."""
        lengths = [tokens] if isinstance(tokens, int) else list(tokens)
        return self.step_breakdown(lengths).total

    # -- TrainerEngine ---------------------------------------------------------------------
    async def setup(self, ctx: TrainerContext) -> None:
        return None

    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return [[] for _ in batch.trajectories]

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        lengths = [t.num_tokens for t in batch.trajectories]
        parts = self.step_breakdown(lengths)
        seconds = parts.total
        await asyncio.sleep(seconds)
        self.steps += 1
        self.tokens_trained += sum(lengths)
        self.breakdowns.append(parts)
        return {
            "train_seconds": seconds,
            "train_tokens": float(sum(lengths)),
            "switch_seconds": parts.switch,
        }

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

"""``ModelTrainerEngine``: a ``TrainerEngine`` whose step core drives while the engine runs
the model (guide: ``docs/plugins.md``, "The trainer engine contract").

Core does, once for every engine: which trajectories train (``trainable``: failed ones, and
ones whose log-probs or loss mask do not match their response, are left out), advantages,
the split into mini-batches (one optimiser update each), the split over data-parallel groups
and the token-budget micro-batches (packed or padded, as the engine's ``BatchLayout`` asks),
each micro-batch's loss inputs, the loss (``laminar_core.algorithms``), the metrics and the
recomputed log-probs that off-policy corrections need. The engine implements the
model-specific part, the shape of verl's ``forward_backward_batch`` + ``optimizer_step``:

- ``batch_layout()``: its device, padding token, token budget, layout and data parallelism;
- ``forward(micro_batches)``: each micro-batch's response log-probs, no gradient;
- ``forward_backward(micro_batches, loss_fn)``: zero the gradients, then forward and backward
  every micro-batch with the loss ``loss_fn`` gives for its response log-probs;
- ``optimizer_step()``: clip, step the optimiser and the LR schedule, return the grad norm;
- ``learning_rate()``; and ``setup``, ``export_weights``, ``save_checkpoint``,
  ``load_checkpoint``, ``close`` as every ``TrainerEngine``.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from laminar_core.interfaces.trainer import TrainerEngine, to_device
from laminar_core.training.batching import BatchLayout, MicroBatch, plan_micro_batches, trainable
from laminar_core.training.step import LossFn, TrainStep
from laminar_core.types import TrainBatch

__all__ = ["ModelTrainerEngine"]

T = TypeVar("T")


class ModelTrainerEngine(TrainerEngine):
    """One rank of an SPMD trainer: core implements ``compute_logprobs`` and ``train_step``
    from the model-specific methods below (see the module docstring).

    ``__init__(config)``: the whole ``LaminarConfig`` the engine was built with (a subclass
    calls ``super().__init__(config)``): the step reads ``config.algorithm``,
    ``config.trainer.mini_batches`` and ``config.rollout.max_tokens`` from it.
    ``version`` counts the optimiser steps taken (``train_step`` adds one); an engine saves
    and restores it with its checkpoints.

    Every hook runs on the thread ``run_blocking`` picks (by default a worker thread per
    call, ``asyncio.to_thread``; an engine whose device, collectives or caches are per
    thread overrides it to use one thread of its own), never on the event loop.
    """

    def __init__(self, config: Any) -> None:
        self.cfg = config
        self.version = 0
        # the version the current weights were published as (a restarted run can publish
        # them under a newer one than the optimiser steps taken): the log-prob gap's anchor
        self._held = 0
        self._recomputed: dict[str, Tensor] = {}

    # -- the model-specific part -------------------------------------------------------------
    @abc.abstractmethod
    def batch_layout(self) -> BatchLayout:
        """How this rank wants its micro-batches (read at every step; cheap)."""

    @abc.abstractmethod
    def forward(self, micro_batches: list[MicroBatch]) -> Sequence[Tensor | None]:
        """Each micro-batch's response log-probs ``[k, T]`` under the current weights
        (``log_softmax(logits / rollout.temperature)`` of each next token, mapped with
        ``responses(per_position, mb.spans)``), without gradient; ``None`` for a micro-batch
        whose log-probs this rank does not hold (a pipeline stage before the last). Ranks
        with ``reports`` must return every non-empty one's. Collective like a step."""

    @abc.abstractmethod
    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> None:
        """Zero the gradients, then for every micro-batch: the forward, ``loss =
        loss_fn(mb, logprobs, entropy)`` with its response log-probs ``[k, T]`` (``entropy``
        the same shape, detached, or ``None``), and the backward of ``loss`` (scaled as the
        engine's gradient reduction needs: the objective is the sum over micro-batches and
        data-parallel groups). A micro-batch with nothing to learn (``mb.index == []``)
        gets no ``loss_fn`` call: run it with zero weight where the collectives need it."""

    @abc.abstractmethod
    def optimizer_step(self) -> Tensor | float | None:
        """Clip the gradients, step the optimiser and the LR schedule; return the gradient
        norm before clipping (a device tensor is fine: it is read with the step's metrics)."""

    @abc.abstractmethod
    def learning_rate(self) -> float:
        """The learning rate to report for the step just taken."""

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` off the event loop (where the hooks run)."""
        return await asyncio.to_thread(fn, *args)

    # -- what core does ----------------------------------------------------------------------
    async def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Every trainable trajectory's response log-probs under the current weights (empty
        lists for the others), the same on every rank; kept for the next ``train_step``'s
        off-policy correction."""
        return await self.run_blocking(self._compute_logprobs, batch)

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """``trainer.mini_batches`` optimiser updates over the batch; the step's metrics."""
        return await self.run_blocking(self._train_step, batch)

    @torch.no_grad()
    def _compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        layout = self.batch_layout()
        trajs = trainable(batch.trajectories)
        sizes = [len(t.response_ids) for t in trajs]
        starts = [0, *itertools.accumulate(sizes)]
        # one flat vector of every trajectory's log-probs: the reporting rank of the group
        # that computed a trajectory fills its slot, a sum over ranks gives every rank all
        # of them (a later mini-batch may put a trajectory on another group)
        flat = torch.zeros(starts[-1], dtype=torch.float32, device=layout.device)
        if trajs:
            mbs = plan_micro_batches(trajs, list(range(len(trajs))), layout)
            outs = list(self.forward(mbs))
            if len(outs) != len(mbs):
                raise ValueError(
                    f"{type(self).__name__}.forward returned {len(outs)} results for "
                    f"{len(mbs)} micro-batches: one per micro-batch (None where this rank "
                    f"holds no log-probs)"
                )
            if layout.reports:
                for mb, lp in zip(mbs, outs, strict=True):
                    if mb.index:
                        _scatter(flat, mb, lp, starts, type(self).__name__)
        if flat.numel() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        flat = flat.cpu()  # the one host read
        self._recomputed = {
            t.traj_id: flat[starts[i] : starts[i + 1]].clone() for i, t in enumerate(trajs)
        }
        return [
            self._recomputed[t.traj_id].tolist() if t.traj_id in self._recomputed else []
            for t in batch.trajectories
        ]

    def _train_step(self, batch: TrainBatch) -> dict[str, float]:
        layout = self.batch_layout()
        # the version these weights were published as: the run's (``batch.version``) can run
        # ahead of the optimiser steps taken after a trainer restart; a bare batch: ours
        self._held = batch.version if batch.version >= 0 else self.version
        step = TrainStep(
            batch,
            self.cfg.algorithm,
            layout,
            mini_batches=self.cfg.trainer.mini_batches,
            max_len=self.cfg.rollout.max_tokens,
            held_version=self._held,
            recomputed=self._recomputed,
        )
        for c in range(len(step.chunks)):
            mbs = step.micro_batches(c)
            loss_fn, calls = _counting(step.loss_fn(c))
            self.forward_backward(mbs, loss_fn)
            want = sum(1 for mb in mbs if mb.index)
            if layout.reports and calls[0] != want:
                raise RuntimeError(
                    f"{type(self).__name__}.forward_backward called loss_fn {calls[0]} times "
                    f"for {want} micro-batches with trajectories: once for each (an empty "
                    f"one, mb.index == [], runs with zero weight and no loss_fn call)"
                )
            step.add_grad_norm(self.optimizer_step())
        out = step.finish(self.learning_rate())
        self.version += 1
        return out


def _counting(fn: LossFn) -> tuple[LossFn, list[int]]:
    calls = [0]

    def counted(mb: MicroBatch, logprobs: Tensor, entropy: Tensor | None = None) -> Tensor:
        calls[0] += 1
        return fn(mb, logprobs, entropy)

    return counted, calls


def _scatter(flat: Tensor, mb: MicroBatch, lp: Tensor | None, starts: list[int], who: str) -> None:
    """``lp [k, T]``'s response log-probs into their trajectories' slots of ``flat``, with
    index tensors built on the host (a boolean mask would make the host wait for the GPU)."""
    want = (len(mb.index), mb.width)
    if lp is None or tuple(lp.shape) != want:
        got = None if lp is None else tuple(lp.shape)
        raise ValueError(
            f"{who}.forward gave {got} for a micro-batch of {want[0]} trajectories (longest "
            f"response {want[1]}): a reporting rank returns [k, T] response log-probs, "
            f"laminar_core.training.responses(per_position, mb.spans)"
        )
    src = [k * want[1] + j for k, (_, _, n) in enumerate(mb.spans) for j in range(n)]
    dst = [starts[i] + j for i, (_, _, n) in zip(mb.index, mb.spans, strict=True) for j in range(n)]
    src_t = to_device(torch.tensor(src), flat.device)
    dst_t = to_device(torch.tensor(dst), flat.device)
    flat[dst_t] = lp.reshape(-1)[src_t].to(flat.dtype)

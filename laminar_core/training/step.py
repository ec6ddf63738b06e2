"""One trainer step's shared work, done once for every engine: which trajectories train, their
advantages, the mini-batches and their micro-batches with the loss inputs, the loss of a
micro-batch, and the step's metrics.

GPU rules kept here so that no engine has to: loss inputs go to the device through pinned
memory (``to_device``); metric sums and the trainer-vs-rollout log-prob gap stay on the
device, summed over micro-batches and mini-batches, and are read once per step (one
all-reduce over ranks, one host read in :meth:`TrainStep.finish`): a host read per
micro-batch would make the host wait for the GPU and stop it queueing kernels ahead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from laminar_core.algorithms import (
    compute_advantages,
    distill_advantages,
    policy_loss_terms,
    reverse_kl,
)
from laminar_core.interfaces.trainer import to_device
from laminar_core.training.batching import (
    BatchLayout,
    MicroBatch,
    padded,
    plan_micro_batches,
    split_mini_batches,
    trainable,
)
from laminar_core.types import TrainBatch, Trajectory

__all__ = ["LossFn", "TrainStep", "add_logprob_agreement", "group_advantages"]

LossFn = Callable[[MicroBatch, Tensor, Tensor | None], Tensor]
"""``loss_fn(micro_batch, logprobs, entropy=None) -> loss``: ``logprobs`` ``[k, T]`` (with
grad; ``laminar_core.training.responses`` of the per-position log-probs), ``entropy`` the
same shape (detached) or ``None``. The returned 0-dim loss is the micro-batch's share of the
mini-batch objective: back-propagating it for every micro-batch on every data-parallel group
(summing the gradients) gives the mini-batch's gradient."""


def group_advantages(trajs: list[Trajectory], algorithm: Any) -> Tensor:
    """One advantage per trajectory (float32 ``[N]``) by ``algorithm.advantage`` over the
    groups of ``group_id``."""
    groups: dict[str, int] = {}
    gids = torch.tensor([groups.setdefault(t.group_id, len(groups)) for t in trajs])
    rewards = torch.tensor([float(t.reward) for t in trajs])  # type: ignore[arg-type]
    kw = {"eps": algorithm.adv_eps} if algorithm.advantage in ("grpo", "reinforce_pp") else {}
    return compute_advantages(algorithm.advantage, rewards, gids, **kw)


def add_logprob_agreement(
    acc: Tensor,
    logprobs: Tensor,
    behaviour: Tensor,
    mask: Tensor,
    rows: list[bool],
) -> None:
    """Add ``|logprobs - behaviour|`` (``[B, T]``) over the masked tokens of the rows marked
    in ``rows`` into ``acc = [max, sum, tokens]`` (float64, on the tensors' device): the
    trainer-vs-rollout log-prob gap, kept on the device so that it is read once per step,
    not once per micro-batch."""
    if not any(rows):
        return
    weight = mask * to_device(torch.tensor(rows, dtype=mask.dtype), mask.device)[:, None]
    d = ((logprobs - behaviour).abs() * weight).double()
    acc[0] = torch.maximum(acc[0], d.max())
    acc[1] += d.sum()
    acc[2] += weight.sum()


class TrainStep:
    """One ``train_step``: an optimiser update per mini-batch (``chunks``: the batch's
    trainable trajectories split ``mini_batches`` ways); for each, :meth:`micro_batches`
    (this rank's, loss inputs filled) and :meth:`loss_fn`, after the update
    :meth:`add_grad_norm`; at the end :meth:`finish`.

    ``held_version``: the weight version the trainer published the current weights as (the
    log-prob gap is measured on trajectories that version alone generated, before the first
    update). ``recomputed``: the trainer's log-probs per ``traj_id`` from ``compute_logprobs``
    (needed when ``algorithm.off_policy`` is not ``none``).
    """

    def __init__(
        self,
        batch: TrainBatch,
        algorithm: Any,
        layout: BatchLayout,
        *,
        mini_batches: int,
        max_len: int,
        held_version: int,
        recomputed: dict[str, Tensor],
    ) -> None:
        self.algo = algorithm
        self.layout = layout
        self.max_len = max_len
        self.held = held_version
        self.recomputed = recomputed
        self.trajs = trainable(batch.trajectories)
        self.chunks = split_mini_batches(len(self.trajs), mini_batches) if self.trajs else []
        self.advantages = group_advantages(self.trajs, algorithm) if self.trajs else torch.zeros(0)
        self.sums: dict[str, Tensor] = {}
        self.agreement = torch.zeros(3, dtype=torch.float64, device=layout.device)

    def micro_batches(self, c: int) -> list[MicroBatch]:
        """Mini-batch ``c``'s micro-batches for this rank, with their loss inputs."""
        chunk = self.chunks[c]
        mbs = plan_micro_batches(self.trajs, chunk, self.layout)
        for mb in mbs:
            if mb.index:
                self._fill(mb)
        return mbs

    def _fill(self, mb: MicroBatch) -> None:
        trajs, width = self.trajs, mb.width
        mb.loss_mask = padded([trajs[i].response_mask() for i in mb.index], width)
        mb.behaviour_logprobs = padded([trajs[i].logprobs for i in mb.index], width)
        mb.advantages = self.advantages[mb.index]
        coef = getattr(self.algo, "distill_coef", 0.0)
        if coef > 0:  # on-policy distillation: each token's own advantage
            rows = []
            for i in mb.index:
                t = trajs[i]
                if len(t.teacher_logprobs) != len(t.response_ids):
                    raise RuntimeError(
                        f"algorithm.distill_coef={coef!r} needs the teacher's log-probs of "
                        f"every response token (trajectory {t.traj_id} has "
                        f"{len(t.teacher_logprobs)} for {len(t.response_ids)}): is "
                        f"algorithm.teacher set for the run that generated it?"
                    )
                rows.append(t.teacher_logprobs)
            mb.teacher_logprobs = padded(rows, width)
            mb.advantages = distill_advantages(
                mb.advantages, mb.behaviour_logprobs, mb.teacher_logprobs, mb.loss_mask, coef
            )
        if self.algo.off_policy != "none":
            recomputed = []
            for i in mb.index:
                got = self.recomputed.get(trajs[i].traj_id)
                if got is None:
                    raise RuntimeError(
                        f"algorithm.off_policy={self.algo.off_policy!r} needs compute_logprobs "
                        f"before train_step (trajectory {trajs[i].traj_id} has no recomputed "
                        f"log-probs)"
                    )
                recomputed.append(got)
            mb.old_logprobs = padded(recomputed, width)

    def loss_fn(self, c: int) -> LossFn:
        """The loss of mini-batch ``c``'s micro-batches (see :data:`LossFn`): core's
        ``policy_loss_terms`` on the micro-batch, scaled by its share of the mini-batch (its
        loss-mask tokens under ``token_mean``, else its sequences with any), its metrics
        summed on the device on reporting ranks."""
        chunk, trajs, algo = self.chunks[c], self.trajs, self.algo
        token_level = algo.loss_agg == "token_mean"
        # only the tokens the model generated count (``Trajectory.loss_mask``: a tool's output
        # appended between turns is 0); sequences with none do not count as sequences either
        counts = {i: sum(1 for m in trajs[i].response_mask() if m) for i in chunk}
        tokens = sum(counts.values())
        total = max(1, tokens if token_level else sum(1 for i in chunk if counts[i]))
        dev, reports, first = self.layout.device, self.layout.reports, c == 0

        def loss_fn(mb: MicroBatch, logprobs: Tensor, entropy: Tensor | None = None) -> Tensor:
            if not mb.index or mb.loss_mask is None:
                raise ValueError(
                    "loss_fn got a micro-batch with nothing to learn (an empty one, or one "
                    "not from TrainStep.micro_batches): run it with zero weight instead"
                )
            _check_response_shape("loss_fn's logprobs", logprobs, mb)
            mask = to_device(mb.loss_mask, dev)
            behaviour = to_device(mb.behaviour_logprobs, dev)  # type: ignore[arg-type]
            old = None if mb.old_logprobs is None else to_device(mb.old_logprobs, dev)
            loss, metrics = policy_loss_terms(
                algo,
                logprobs,
                behaviour,
                to_device(mb.advantages, dev),  # type: ignore[arg-type]
                mask,
                old_logprobs=old,
                proximal_logprobs=old,
                max_len=self.max_len,
            )
            mine = [counts[i] for i in mb.index]
            frac = (sum(mine) if token_level else sum(1 for n in mine if n)) / total
            if reports:
                for k, v in metrics.items():
                    self._add(k, v.double() * frac)
                if mb.teacher_logprobs is not None:  # the student's reverse KL to its teacher
                    rkl = reverse_kl(behaviour, to_device(mb.teacher_logprobs, dev), mask)
                    n = mask.sum().clamp_min(1).double()
                    self._add("distill_reverse_kl", rkl.sum().double() / n * frac)
                if entropy is not None:
                    _check_response_shape("loss_fn's entropy", entropy, mb)
                    self._add("entropy", (entropy.detach() * mask).sum().double() / max(1, tokens))
                if first:  # against the version the run published these weights as
                    rows = [trajs[i].generated_only_by(self.held) for i in mb.index]
                    add_logprob_agreement(self.agreement, logprobs.detach(), behaviour, mask, rows)
            return loss * frac

        return loss_fn

    def _add(self, key: str, value: Tensor) -> None:
        got = self.sums.get(key)
        self.sums[key] = value if got is None else got + value

    def add_grad_norm(self, norm: Tensor | float | None) -> None:
        """The update's gradient norm (the whole model's, the same on every rank; ``None``:
        not computed): counted once per data-parallel group."""
        if norm is None or not self.layout.reports:
            return
        dev = self.layout.device
        value = torch.as_tensor(norm, dtype=torch.float64)
        self._add("grad_norm", to_device(value, dev).double() / self.layout.dp_size)

    def finish(self, lr: float) -> dict[str, float]:
        """The step's metrics, the same on every rank: each summed figure over ranks and
        averaged over mini-batches, ``lr``, ``trained_trajectories`` and, when any token
        counted, ``logprob_abs_diff_max`` / ``_mean`` / ``logprob_diff_tokens``. Collective
        (one all-reduce of every figure, one of the gap's max) and the step's one host read."""
        dev = self.layout.device
        world = dist.get_world_size() if dist.is_initialized() else 1
        keys = sorted(self.sums)
        if world > 1:  # a rank that ran only empty micro-batches has no keys: the union
            every: list[list[str]] = [[] for _ in range(world)]
            dist.all_gather_object(every, keys)
            keys = sorted(set().union(*every))
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        flat = torch.stack([self.sums.get(k, zero) for k in keys] + list(self.agreement[1:]))
        top = self.agreement[:1].clone()
        if world > 1:
            dist.all_reduce(flat)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        flat, top = flat.cpu(), top.cpu()  # the step's one wait for the device
        parts = max(1, len(self.chunks))
        out = {k: flat[i].item() / parts for i, k in enumerate(keys)}
        out["lr"] = float(lr)
        out["trained_trajectories"] = float(len(self.trajs))
        tokens = flat[-1].item()
        if tokens:
            out["logprob_abs_diff_max"] = top.item()
            out["logprob_abs_diff_mean"] = flat[-2].item() / tokens
            out["logprob_diff_tokens"] = tokens
        return out


def _check_response_shape(what: str, t: Tensor, mb: MicroBatch) -> None:
    want = (len(mb.index), mb.width)
    if tuple(t.shape) != want:
        raise ValueError(
            f"{what} have shape {tuple(t.shape)}; the micro-batch needs {want} (its "
            f"trajectories x longest response): map per-position values with "
            f"laminar_core.training.responses(values, micro_batch.spans)"
        )

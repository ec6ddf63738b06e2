"""Outcome-reward advantage estimators.

Every estimator takes one scalar reward per trajectory and returns one advantage per
trajectory; the caller broadcasts it over the trajectory's response tokens.

Common contract:
    rewards: ``Tensor[N]``, any real dtype. Integer/bool rewards are promoted to float32;
        float16/bfloat16 are computed in float32 (statistics over 8k samples lose too much in
        half precision) and the result is returned in float32.
    group_ids: ``Tensor[N]`` of an integer dtype, same device as ``rewards``. Trajectories of
        the same prompt share an id. Ids need not be contiguous or sorted, and groups may have
        different sizes (e.g. after filtering failed samples).
    returns: ``Tensor[N]`` advantages, float32 or float64 (float64 only if rewards are).

Group statistics use ``torch.unique(return_inverse=True)`` + ``index_add_`` so the cost is a
few vectorised kernels regardless of the number of groups; there is no Python loop over groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .config import ADVANTAGE_ESTIMATORS, unknown_choice

__all__ = ["compute_advantages", "dr_grpo", "grpo", "no_advantage", "reinforce_pp", "rloo"]


def _as_float(rewards: Tensor) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    return rewards.to(dtype)


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Group statistics: ``(index [N], count [G], total [G])``.

    ``index[i]`` is the dense group index (0..G-1) of trajectory ``i``; ``count`` and ``total``
    are each group's size (as ``rewards.dtype``) and reward sum, so ``total[index]`` is the
    group sum seen from each trajectory.
    """
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids shape {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    # Dense re-indexing keeps the scatter targets small ([G]) whatever the raw id values are.
    uniq, index = torch.unique(group_ids, return_inverse=True)
    num_groups = uniq.numel()
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    count.index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    total.index_add_(0, index, rewards)
    return index, count, total


def grpo(
    rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, std_normalize: bool = True
) -> Tensor:
    """GRPO: ``(r - mean_g) / (std_g + eps)`` within each group.

    ``std_g`` is the *unbiased* sample std (Bessel's correction, ``torch.std``'s default
    ``correction=1``), as in verl's GRPO. A group of size 1 has no spread to normalise by: its
    advantage is 0 (its deviation from its own mean is 0). A group whose rewards are all equal
    also gets 0 everywhere. With ``std_normalize=False`` this is ``dr_grpo``.
    """
    r = _as_float(rewards)
    index, count, total = _group_stats(r, group_ids)
    centered = r - (total / count)[index]
    if not std_normalize:
        return centered
    sq = torch.zeros_like(count).index_add_(0, index, centered.square())
    # Size-1 groups: squared deviation is 0; clamp the divisor so var is 0 rather than 0/0.
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    return centered / (std[index] + eps)


def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO: ``r - mean_g`` (no std normalisation).

    Dr.GRPO's other change, dropping per-sequence length normalisation, belongs to the loss:
    use ``loss_agg="seq_mean_token_sum_norm"`` with a constant ``max_len``.
    """
    r = _as_float(rewards)
    index, count, total = _group_stats(r, group_ids)
    return r - (total / count)[index]


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: ``r_i - mean of the other samples of i's group`` (leave-one-out baseline).

    A group of size 1 has no other sample to form a baseline from: its advantage is 0.
    """
    r = _as_float(rewards)
    index, count, total = _group_stats(r, group_ids)
    count, total = count[index], total[index]
    # Size-1 groups: clamp the divisor to avoid 0/0, then force their advantage to 0.
    adv = r - (total - r) / (count - 1).clamp_min(1)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def reinforce_pp(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    eps: float = 1e-6,
    baseline: bool = False,
) -> Tensor:
    """REINFORCE++: global batch whitening ``(x - mean(x)) / (std(x) + eps)``.

    With ``baseline=False`` (plain REINFORCE++), ``x = r`` and ``group_ids`` is ignored (it is
    accepted so callers can pass it uniformly). With ``baseline=True`` ("REINFORCE++-baseline")
    ``x = r - mean_g`` first subtracts each group's mean, then whitens over the whole batch;
    ``group_ids`` is then required. ``std`` is the unbiased sample std over the batch; a batch
    of fewer than 2 trajectories has std 0 and therefore advantage 0.
    """
    x = _as_float(rewards)
    if baseline:
        if group_ids is None:
            raise ValueError("reinforce_pp: baseline=True needs group_ids")
        index, count, total = _group_stats(x, group_ids)
        x = x - (total / count)[index]
    n = x.numel()
    if n == 0:
        return x
    centered = x - x.mean()
    std = (centered.square().sum() / max(n - 1, 1)).sqrt()
    return centered / (std + eps)


def no_advantage(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """``none``: 0 for every trajectory: the reward is logged (and evaluated), not learned
    from. Only meaningful with another signal per token: on-policy distillation
    (``algorithm.distill_coef``) from the reward-bearing task's own samples."""
    return torch.zeros_like(_as_float(rewards))


_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "none": no_advantage,
}


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **kw) -> Tensor:
    """Dispatch to the estimator called ``name``; ``kw`` is forwarded unchanged.

    Note ``eps`` is only accepted by ``grpo`` and ``reinforce_pp`` (the others raise
    ``TypeError`` on it), and ``reinforce_pp``'s ``baseline`` flag must be passed in ``kw``.

    Raises:
        ValueError: ``name`` is not one of ``ADVANTAGE_ESTIMATORS`` (the message lists them).
    """
    fn = _ESTIMATORS.get(name)
    if fn is None:
        raise unknown_choice("advantage estimator", name, ADVANTAGE_ESTIMATORS)
    return fn(rewards, group_ids, **kw)

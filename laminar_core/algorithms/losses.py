"""Policy-gradient losses, off-policy corrections and the KL penalty.

Common contract:
    Per-token tensors are padded ``[B, T]`` (B sequences, T response positions), all of the
    same shape, floating dtype. ``mask`` is ``[B, T]``, bool or 0/1 float/int; a non-zero entry
    marks a response token that counts. Padded positions may hold anything (even ``-inf``
    log-probs): every function selects with ``torch.where`` *before* ``exp`` so garbage in
    padding can produce neither NaN values nor NaN gradients.

    Only ``logprobs`` (the current policy's, with grad) receives gradient. Behaviour, old,
    proximal and reference log-probs, advantages and importance weights are detached here,
    whatever the caller passes.

    Losses are 0-dim tensors to minimise; metrics are plain Python floats (``*_terms``: 0-dim
    tensors on the loss's device, for trainers that sum them over micro-batches).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .config import (
    IS_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LOSSES,
    unknown_choice,
    validate_algorithm,
)

__all__ = [
    "aggregate",
    "cispo_loss",
    "gspo_loss",
    "is_band_mask",
    "is_weights",
    "kl_penalty",
    "metric_floats",
    "policy_loss",
    "policy_loss_terms",
    "ppo_clip_loss",
    "truncated_is_weights",
]


def _check_like(name: str, t: Tensor, ref: Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} must match {tuple(ref.shape)}")


def _check_2d(name: str, t: Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(t.shape)}")


def aggregate(
    per_token: Tensor, mask: Tensor, mode: str = "token_mean", max_len: int | None = None
) -> Tensor:
    """Reduce a ``[B, T]`` per-token quantity over the masked tokens to a 0-dim tensor.

    Modes:
        ``token_mean``: sum over all masked tokens / number of masked tokens (every token
            weighs the same, so long sequences weigh more; DAPO's "token-level" loss).
        ``seq_mean_token_mean``: mean over each sequence's masked tokens, then mean over
            sequences (every sequence weighs the same; original GRPO).
        ``seq_mean_token_sum_norm``: sum over each sequence's masked tokens / the constant
            ``max_len``, then mean over sequences (Dr.GRPO: no per-length normalisation).
            ``max_len`` is required and should be fixed for the run (e.g. the generation
            ``max_tokens``), not the padded width of the batch.

    Sequence means run over the rows with at least one masked token: fully-masked rows are
    batch padding and must not dilute the mean. An all-zero mask gives 0 (not NaN) in every
    mode. The reduction is per call: under gradient accumulation each micro-batch is
    normalised on its own.

    Raises:
        ValueError: unknown ``mode`` or, for ``seq_mean_token_sum_norm``, a missing or
            non-positive ``max_len``.
    """
    _check_2d("per_token", per_token)
    _check_like("mask", mask, per_token)
    m = mask.bool()
    x = torch.where(m, per_token, 0.0)
    if mode == "token_mean":
        return x.sum() / m.sum().clamp_min(1)
    if mode not in LOSS_AGGREGATIONS:
        raise unknown_choice("loss aggregation", mode, LOSS_AGGREGATIONS)
    tokens = m.sum(-1)
    if mode == "seq_mean_token_mean":
        seq = x.sum(-1) / tokens.clamp_min(1)
    else:  # seq_mean_token_sum_norm
        if max_len is None or max_len <= 0:
            raise ValueError(f"aggregate: mode {mode!r} needs a positive max_len, got {max_len!r}")
        seq = x.sum(-1) / max_len
    # Empty rows contribute 0 to the sum (x is 0 there) and are left out of the count.
    return seq.sum() / (tokens > 0).sum().clamp_min(1)


def truncated_is_weights(
    target_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float | None
) -> Tensor:
    """Per-token importance weights ``min(exp(target - behaviour), cap)``, detached.

    ``target_logprobs`` is the policy the update is anchored to (trainer-recomputed "old"
    log-probs for TIS, proximal log-probs for decoupled PPO); ``behaviour_logprobs`` are the
    log-probs reported by the rollout engine that sampled the tokens. ``cap=None`` leaves the
    weights uncapped. Only the top is truncated: weights below 1 are kept as they are.

    Returns:
        ``[B, T]`` weights in the dtype of ``target_logprobs``; 0 at unmasked positions.
    """
    return is_weights(target_logprobs, behaviour_logprobs, mask, "token", cap)


def _log_is_ratio(
    target_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, level: str
) -> Tensor:
    """``log(target / behaviour)`` per token (``token``), summed over the sequence
    (``sequence``: the log of the product of the token ratios) or averaged over it
    (``geometric``: the log of their geometric mean), broadcast over the sequence's tokens;
    detached, 0 off the mask."""
    _check_2d("target_logprobs", target_logprobs)
    _check_like("behaviour_logprobs", behaviour_logprobs, target_logprobs)
    _check_like("mask", mask, target_logprobs)
    m = mask.bool()
    d = torch.where(m, target_logprobs.detach() - behaviour_logprobs.detach(), 0.0)
    if level == "token":
        return d
    if level not in IS_LEVELS:
        raise unknown_choice("IS level", level, IS_LEVELS)
    seq = d.sum(-1, keepdim=True)
    if level == "geometric":
        seq = seq / m.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(m, seq.expand_as(d), 0.0)


def is_weights(
    target_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    level: str = "token",
    cap: float | None = None,
) -> Tensor:
    """Rollout-correction importance weights ``min(rho, cap)``, detached, ``[B, T]``.

    With ``d_t = target_t - behaviour_t`` (``target``: the policy the update is anchored to,
    the trainer's recomputed log-probs; ``behaviour``: the rollout engine's) over a
    sequence's masked tokens:

        ``token``:     ``rho_t = exp(d_t)`` (TIS; Yao et al. 2025, "Your efficient RL
                       framework secretly brings you off-policy RL training");
        ``sequence``:  ``rho_t = exp(sum_t d_t)`` for every token of the sequence (the
                       sequence's likelihood ratio: unbiased, high variance);
        ``geometric``: ``rho_t = exp(mean_t d_t)`` (the geometric mean of the token ratios:
                       length-independent, as GSPO's ratio; verl's rollout correction
                       ``geometric``, slime's MIS).

    ``cap=None`` leaves them uncapped; only the top is truncated. 0 at unmasked positions.
    """
    log_w = _log_is_ratio(target_logprobs, behaviour_logprobs, mask, level)
    w = log_w.exp()
    if cap is not None:
        w = w.clamp_max(cap)
    return torch.where(mask.bool(), w, 0.0)


def is_band_mask(
    target_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    level: str,
    low: float,
    high: float,
) -> Tensor:
    """Which masked tokens keep their place in the loss: bool ``[B, T]``, True where the
    ``level`` ratio (``is_weights``'s ``rho``, uncapped) lies in ``[low, high]``.

    ``token`` drops single tokens whose trainer/rollout ratio left the band (IcePop; slime's
    MIS token mode); ``sequence`` / ``geometric`` drop whole sequences whose product /
    geometric-mean ratio left it (verl's rollout rejection sampling). Compared in log space,
    so a long sequence's product cannot overflow. False off the mask.
    """
    if level not in IS_LEVELS:
        raise unknown_choice("IS mask level", level, IS_LEVELS)
    log_w = _log_is_ratio(target_logprobs, behaviour_logprobs, mask, level)
    lo = math.log(low) if low > 0 else -math.inf
    return mask.bool() & (log_w >= lo) & (log_w <= math.log(high))


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(-1).expand_as(like)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] or [B, T] = {tuple(like.shape)}, got {tuple(advantages.shape)}"
    )


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token_mean",
    is_weights: Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with separate low/high epsilons ("clip-higher", DAPO).

    Per token, with ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A``::

        loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) * w_t

    where ``w_t`` is ``is_weights`` (detached) or 1, then reduced with ``aggregate(agg,
    max_len)``.

    Args:
        logprobs: ``[B, T]`` current-policy log-probs of the sampled tokens (with grad).
        old_logprobs: ``[B, T]`` log-probs the ratio is anchored to (detached here).
        advantages: ``[B]`` (one per sequence, broadcast over T) or ``[B, T]``.
        mask: ``[B, T]`` response-token mask.
        is_weights: optional ``[B, T]`` per-token weights (detached here).

    Returns:
        ``(loss, metrics)``; metrics are over masked tokens (0.0 if there are none):
        ``clip_fraction`` share of tokens where the clipped branch is active, i.e. strictly
        lowers the objective (``clip_low_fraction``: ratio < 1 - clip_low with A < 0;
        ``clip_high_fraction``: ratio > 1 + clip_high with A > 0); ``ratio_mean``;
        ``approx_kl`` mean of ``old_logprobs - logprobs`` (k1 estimate of KL(old || new)).
    """
    loss, terms = _surrogate_terms(
        "ppo", logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, is_weights,
        max_len,
    )  # fmt: skip
    return loss, metric_floats(terms)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq_mean_token_mean",
    is_weights: Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: PPO's clipped surrogate on a sequence-level ratio (Zheng et al. 2025, "Group
    Sequence Policy Optimization", arXiv:2507.18071, eq. 5-7 and the GSPO-token form, eq. 13).

    With ``s_i = exp(mean_t (logprobs_t - old_t))`` over sequence ``i``'s masked tokens (the
    geometric mean of its token ratios)::

        loss_i = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)

    computed per token in the GSPO-token form ``s_it = sg(s_i) * exp(logprobs_t -
    sg(logprobs_t))`` (value ``s_i``, gradient ``s_i * grad logprobs_t``): with one advantage
    per sequence and ``agg="seq_mean_token_mean"`` (the paper's) it is GSPO exactly, value and
    gradient; other aggregations weigh each sequence's term as they weigh its tokens (e.g.
    ``token_mean``: ``sum_i |y_i| loss_i / sum_i |y_i|``). A clipped sequence gives no
    gradient at all. The paper clips at ``3e-4`` / ``4e-4`` (the defaults here; set
    ``algorithm.clip_low`` / ``clip_high`` so: the sequence ratio moves far less than a
    token's). Arguments, returns and metrics as ``ppo_clip_loss`` (ratios are ``s_i``).
    """
    loss, terms = _surrogate_terms(
        "gspo", logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, is_weights,
        max_len,
    )  # fmt: skip
    return loss, metric_floats(terms)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token_mean",
    is_weights: Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax, 2025,
    "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv:2506.13585, eq. 4-5; NeMo-RL 0.7's CISPO).

    Per token, with ``r_t = exp(logprobs_t - old_t)``::

        loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A * logprobs_t * w_t

    Unlike PPO, no token's gradient is ever dropped: the weight is clipped, not the update
    (the paper's point: PPO's clip silences the rare "fork" tokens that matter most for long
    reasoning). The paper leaves the lower bound off in practice (a large ``clip_low``, e.g.
    0.99 here) and tunes only the upper. The loss value is that of the paper's objective
    (``log pi`` times the weight), not a ratio surrogate: compare its gradient, not its value,
    with PPO's. Metrics as ``ppo_clip_loss``, with ``clip_*_fraction`` counting tokens whose
    weight was clipped (whatever the advantage's sign).
    """
    loss, terms = _surrogate_terms(
        "cispo", logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, is_weights,
        max_len,
    )  # fmt: skip
    return loss, metric_floats(terms)


def metric_floats(terms: dict[str, Tensor]) -> dict[str, float]:
    """0-dim metric tensors -> Python floats, in one device->host transfer (through float64:
    float32 values come out exact and float64 sums keep their precision)."""
    if not terms:
        return {}
    values = torch.stack([v.detach().double() for v in terms.values()]).tolist()
    return dict(zip(terms.keys(), values, strict=True))


def _surrogate_terms(
    kind: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    agg: str,
    is_weights: Tensor | None,
    max_len: int | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The ``kind`` loss (``ppo``, ``gspo``, ``cispo``) with its metrics as 0-dim tensors on
    the loss's device."""
    _check_2d("logprobs", logprobs)
    _check_like("old_logprobs", old_logprobs, logprobs)
    _check_like("mask", mask, logprobs)
    if is_weights is not None:
        _check_like("is_weights", is_weights, logprobs)
    adv = _broadcast_advantages(advantages, logprobs).detach()
    m = mask.bool()

    # Mask before exp: padded log-probs may be -inf and inf * 0 would poison the gradient.
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), 0.0)
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    if kind == "cispo":
        ratio = log_ratio.exp()
        weight = ratio.detach().clamp(lo, hi)
        per_token = -weight * adv * torch.where(m, logprobs, 0.0)
        low_hit = m & (ratio < lo)
        high_hit = m & (ratio > hi)
    else:
        if kind == "gspo":
            seq = log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
            # value s_i on every token, gradient s_i * d logprobs_t (GSPO-token, eq. 13)
            log_ratio_used = torch.where(m, seq.detach() + log_ratio - log_ratio.detach(), 0.0)
        elif kind == "ppo":
            log_ratio_used = log_ratio
        else:
            raise unknown_choice("loss", kind, LOSSES)
        ratio = log_ratio_used.exp()
        per_token = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        low_hit = m & (ratio < lo) & (adv < 0)
        high_hit = m & (ratio > hi) & (adv > 0)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, agg, max_len=max_len)

    with torch.no_grad():
        n = m.sum().clamp_min(1)
        metrics = {
            "clip_fraction": (low_hit | high_hit).sum() / n,
            "clip_low_fraction": low_hit.sum() / n,
            "clip_high_fraction": high_hit.sum() / n,
            "ratio_mean": torch.where(m, ratio, 0.0).sum() / n,
            "approx_kl": -log_ratio.sum() / n,  # log_ratio is 0 off the mask
        }
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(current || reference) from sampled-token log-probs.

    With ``d = logprobs - ref_logprobs`` (Schulman's estimators):
        ``k1 = d`` (unbiased, high variance, can be negative);
        ``k2 = 0.5 * d**2``;
        ``k3 = exp(-d) + d - 1 = exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0, low
        variance; GRPO's choice).

    Gradient flows through ``logprobs`` only. No clamping is applied to ``k3``.

    Returns:
        ``[B, T]`` per-token values, 0 at unmasked positions; reduce with ``aggregate``.
    """
    _check_2d("logprobs", logprobs)
    _check_like("ref_logprobs", ref_logprobs, logprobs)
    _check_like("mask", mask, logprobs)
    m = mask.bool()
    d = torch.where(m, logprobs - ref_logprobs.detach(), 0.0)
    if kind == "k1":
        kl = d
    elif kind == "k2":
        kl = 0.5 * d.square()
    elif kind == "k3":
        kl = torch.exp(-d) + d - 1.0
    else:
        raise unknown_choice("kl estimator", kind, KL_ESTIMATORS)
    return torch.where(m, kl, 0.0)


def _require(value: Tensor | None, arg: str, why: str) -> Tensor:
    if value is None:
        raise ValueError(f"policy_loss: {why} needs {arg}, got None")
    return value


def policy_loss(
    cfg: Any,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    old_logprobs: Tensor | None = None,
    proximal_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The full policy objective configured by ``cfg`` (an ``AlgorithmConfig`` or equivalent).

    The off-policy correction ``cfg.off_policy`` picks the ratio's anchor and the weights:
        ``none``: ratio against ``behaviour_logprobs`` (the rollout engine's), no weights
            (Laminar's choice).
        ``tis``: truncated IS (LlamaRL's AIPO): ratio against ``old_logprobs`` (the trainer's
            recomputation under the same weights), weighted by
            ``min(exp(old - behaviour), cfg.is_cap)``.
        ``decoupled``: decoupled PPO (AReaL): ratio against ``proximal_logprobs``, weighted by
            ``min(exp(proximal - behaviour), cfg.is_cap)`` (``is_cap=None``: uncapped). Note
            AReaL's reference code *drops* tokens whose weight exceeds the cap; here it is
            truncated like TIS, so one cap means one thing.

    Numerically ``tis`` and ``decoupled`` are the same formula; they differ in which
    recomputed log-probs they expect the trainer to supply. Inputs a correction does not use
    are ignored. With ``tis`` / ``decoupled``, ``cfg.is_level`` forms the weight per token,
    per sequence or as the sequence's geometric mean (``is_weights``), and ``cfg.is_mask``
    zeroes the weight of tokens (or whole sequences) whose ratio leaves ``[cfg.mask_low,
    cfg.mask_high]`` (``is_band_mask``).

    ``cfg.loss`` picks the surrogate: ``ppo`` (``ppo_clip_loss``), ``gspo`` (``gspo_loss``)
    or ``cispo`` (``cispo_loss``), each with ``cfg.clip_low`` / ``cfg.clip_high``, the IS
    weights above and ``cfg.loss_agg``.

    If ``cfg.kl_coef > 0`` the loss adds ``kl_coef * aggregate(kl_penalty(logprobs,
    ref_logprobs, mask, cfg.kl_estimator), mask, cfg.loss_agg)``. ``max_len`` is forwarded to
    ``aggregate`` (required for ``loss_agg="seq_mean_token_sum_norm"``).

    Returns:
        ``(loss, metrics)``: the loss's metrics (``ppo_clip_loss``) plus ``pg_loss``, ``loss``, and
        ``kl`` when the penalty is on, and ``is_weight_mean`` / ``is_capped_fraction`` (share
        of masked tokens whose weight hit the cap) for ``tis`` / ``decoupled``, and
        ``is_masked_fraction`` (share of masked tokens dropped by the band) with ``is_mask``.

    Raises:
        ValueError: ``cfg`` is invalid (see ``validate_algorithm``), or an input the
            configuration needs is missing (the message names the argument and the reason).
    """
    loss, terms = policy_loss_terms(
        cfg, logprobs, behaviour_logprobs, advantages, mask,
        old_logprobs, proximal_logprobs, ref_logprobs, max_len,
    )  # fmt: skip
    return loss, metric_floats(terms)


def policy_loss_terms(
    cfg: Any,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    old_logprobs: Tensor | None = None,
    proximal_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``policy_loss`` with its metrics as 0-dim tensors on the loss's device: no
    device->host transfer, so a trainer summing them over micro-batches lets the host run
    ahead of the GPU and reads them once per step (``metric_floats``)."""
    validate_algorithm(cfg)
    correction = cfg.off_policy
    weights: Tensor | None = None
    keep: Tensor | None = None
    if correction == "none":
        anchor = behaviour_logprobs
    else:
        if correction == "tis":
            anchor = _require(old_logprobs, "old_logprobs", "off_policy 'tis'")
        else:  # decoupled; validate_algorithm rejected anything else
            anchor = _require(proximal_logprobs, "proximal_logprobs", "off_policy 'decoupled'")
        _check_like("behaviour_logprobs", behaviour_logprobs, anchor)
        weights = is_weights(anchor, behaviour_logprobs, mask, cfg.is_level, cfg.is_cap)
        if cfg.is_mask != "none":
            keep = is_band_mask(
                anchor, behaviour_logprobs, mask, cfg.is_mask, cfg.mask_low, cfg.mask_high
            )
            # a dropped token keeps its place in the normalisation: the step is smaller,
            # not rescaled onto the tokens that remain
            weights = weights * keep

    ref = None
    if cfg.kl_coef > 0:
        ref = _require(ref_logprobs, "ref_logprobs", f"kl_coef={cfg.kl_coef} > 0")

    pg_loss, metrics = _surrogate_terms(
        cfg.loss,
        logprobs,
        anchor,
        advantages,
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        agg=cfg.loss_agg,
        is_weights=weights,
        max_len=max_len,
    )
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    if ref is not None:
        kl = aggregate(
            kl_penalty(logprobs, ref, mask, cfg.kl_estimator), mask, cfg.loss_agg, max_len
        )
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl.detach()
    if weights is not None:
        m = mask.bool()
        n = m.sum().clamp_min(1)
        metrics["is_weight_mean"] = weights.sum() / n  # weights are 0 off the mask
        if cfg.is_cap is not None:
            metrics["is_capped_fraction"] = (m & (weights >= cfg.is_cap)).sum() / n
        if keep is not None:
            metrics["is_masked_fraction"] = (m & ~keep).sum() / n
    metrics["loss"] = loss.detach()
    return loss, metrics

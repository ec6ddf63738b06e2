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

from typing import Any

import torch
from torch import Tensor

from .config import KL_ESTIMATORS, LOSS_AGGREGATIONS, unknown_choice, validate_algorithm

__all__ = [
    "aggregate",
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
    _check_2d("target_logprobs", target_logprobs)
    _check_like("behaviour_logprobs", behaviour_logprobs, target_logprobs)
    _check_like("mask", mask, target_logprobs)
    m = mask.bool()
    log_w = torch.where(m, target_logprobs.detach() - behaviour_logprobs.detach(), 0.0)
    w = log_w.exp()
    if cap is not None:
        w = w.clamp_max(cap)
    return torch.where(m, w, 0.0)


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
    loss, terms = _ppo_clip_terms(
        logprobs, old_logprobs, advantages, mask, clip_low, clip_high, agg, is_weights, max_len
    )
    return loss, metric_floats(terms)


def metric_floats(terms: dict[str, Tensor]) -> dict[str, float]:
    """0-dim metric tensors -> Python floats, in one device->host transfer (through float64:
    float32 values come out exact and float64 sums keep their precision)."""
    if not terms:
        return {}
    values = torch.stack([v.detach().double() for v in terms.values()]).tolist()
    return dict(zip(terms.keys(), values, strict=True))


def _ppo_clip_terms(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token_mean",
    is_weights: Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``ppo_clip_loss`` with its metrics as 0-dim tensors on the loss's device."""
    _check_2d("logprobs", logprobs)
    _check_like("old_logprobs", old_logprobs, logprobs)
    _check_like("mask", mask, logprobs)
    if is_weights is not None:
        _check_like("is_weights", is_weights, logprobs)
    adv = _broadcast_advantages(advantages, logprobs).detach()
    m = mask.bool()

    # Mask before exp: padded log-probs may be -inf and inf * 0 would poison the gradient.
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), 0.0)
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, agg, max_len=max_len)

    with torch.no_grad():
        n = m.sum().clamp_min(1)
        clip_low_hit = m & (ratio < 1.0 - clip_low) & (adv < 0)
        clip_high_hit = m & (ratio > 1.0 + clip_high) & (adv > 0)
        metrics = {
            "clip_fraction": (clip_low_hit | clip_high_hit).sum() / n,
            "clip_low_fraction": clip_low_hit.sum() / n,
            "clip_high_fraction": clip_high_hit.sum() / n,
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
    are ignored.

    If ``cfg.kl_coef > 0`` the loss adds ``kl_coef * aggregate(kl_penalty(logprobs,
    ref_logprobs, mask, cfg.kl_estimator), mask, cfg.loss_agg)``. ``max_len`` is forwarded to
    ``aggregate`` (required for ``loss_agg="seq_mean_token_sum_norm"``).

    Returns:
        ``(loss, metrics)``: ``ppo_clip_loss``'s metrics plus ``pg_loss``, ``loss``, and
        ``kl`` when the penalty is on, and ``is_weight_mean`` / ``is_capped_fraction`` (share
        of masked tokens whose weight hit the cap) for ``tis`` / ``decoupled``.

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
    if correction == "none":
        anchor = behaviour_logprobs
    else:
        if correction == "tis":
            anchor = _require(old_logprobs, "old_logprobs", "off_policy 'tis'")
        else:  # decoupled; validate_algorithm rejected anything else
            anchor = _require(proximal_logprobs, "proximal_logprobs", "off_policy 'decoupled'")
        _check_like("behaviour_logprobs", behaviour_logprobs, anchor)
        weights = truncated_is_weights(anchor, behaviour_logprobs, mask, cfg.is_cap)

    ref = None
    if cfg.kl_coef > 0:
        ref = _require(ref_logprobs, "ref_logprobs", f"kl_coef={cfg.kl_coef} > 0")

    pg_loss, metrics = _ppo_clip_terms(
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
    metrics["loss"] = loss.detach()
    return loss, metrics

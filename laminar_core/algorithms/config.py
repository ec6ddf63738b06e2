"""Algorithm settings: which advantage estimator, off-policy correction and loss shape to use.

``AlgorithmConfig`` (the ``algorithm:`` section) lives with the rest of the schema in
``config.schema``; the choices it accepts and their validation live here. This module
deliberately does not import torch: loading and validating a config must not pay for it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from laminar_core.config.schema import AlgorithmConfig

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_FILTERS",
    "IS_LEVELS",
    "IS_MASKS",
    "KL_ESTIMATORS",
    "LOSSES",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "AlgorithmConfig",
    "DynamicSampling",
    "dynamic_sampling",
    "unknown_choice",
    "validate_algorithm",
    "validate_distill",
]

# Names accepted by ``compute_advantages`` (see ``advantages.py``).
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "none")
# Names accepted by ``policy_loss`` for ``off_policy`` (see ``losses.py``).
OFF_POLICY_CORRECTIONS: tuple[str, ...] = ("none", "tis", "decoupled")
# Names accepted by ``aggregate`` (see ``losses.py``).
LOSS_AGGREGATIONS: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
)
# Names accepted by ``kl_penalty`` (see ``losses.py``).
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
# Policy losses (``algorithm.loss``; see ``losses.py``).
LOSSES: tuple[str, ...] = ("ppo", "gspo", "cispo")
# How the rollout-correction weight is formed (``algorithm.is_level``; ``is_weights``).
IS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
# Which ratios leave the ``[mask_low, mask_high]`` band (``algorithm.is_mask``; ``is_band_mask``).
IS_MASKS: tuple[str, ...] = ("none", "token", "sequence", "geometric")
# Named group filters of ``algorithm.dynamic_sampling`` (see ``filters.py``); a
# ``package.module:function`` names one of the user's.
GROUP_FILTERS: tuple[str, ...] = ("zero_variance",)


def unknown_choice(field: str, value: Any, known: tuple[str, ...]) -> ValueError:
    """Build the uniform "unknown name" error: field, bad value, sorted known choices (and the
    closest of them when one is close)."""
    close = difflib.get_close_matches(str(value), list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"{field}: unknown {value!r}{hint}; known: {', '.join(sorted(known))}")


@dataclass(frozen=True)
class DynamicSampling:
    """``algorithm.dynamic_sampling`` read (see ``AlgorithmConfig``): which groups are dropped
    (``filter``), and when the run stops because too many are (more than ``max_rate`` of a
    step's worth of groups, ``patience`` times in a row; 0: never)."""

    filter: str = "zero_variance"
    max_rate: float = 0.95
    patience: int = 10


def dynamic_sampling(cfg: Any) -> DynamicSampling | None:
    """``cfg.dynamic_sampling`` (``false``, ``true`` or a mapping) as a ``DynamicSampling``;
    ``None`` when off.

    Raises:
        ValueError: one line naming ``algorithm.dynamic_sampling`` and the fix.
    """
    value = getattr(cfg, "dynamic_sampling", False)
    key = "algorithm.dynamic_sampling"
    if value is None or value is False:
        return None
    if value is True:
        return DynamicSampling()
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{key}: expected true, false or a mapping {{filter, max_rate, patience}}, got "
            f"{value!r}"
        )
    known = [f.name for f in fields(DynamicSampling)]
    for k in value:
        if k not in known:
            raise unknown_choice(f"{key}: key", k, tuple(known))
    out = DynamicSampling(**{k: value[k] for k in value})
    if not isinstance(out.filter, str) or not (out.filter in GROUP_FILTERS or ":" in out.filter):
        raise ValueError(
            f"{key}.filter: unknown {out.filter!r}; known: {', '.join(GROUP_FILTERS)}, or a "
            f"function 'package.module:function' (rewards -> True to drop the group)"
        )
    if not 0 < out.max_rate <= 1:
        raise ValueError(f"{key}.max_rate: must be in (0, 1], got {out.max_rate!r}")
    if not isinstance(out.patience, int) or out.patience < 0:
        raise ValueError(
            f"{key}.patience: must be an integer >= 0 (0: never stop), got {out.patience!r}"
        )
    return out


def validate_algorithm(cfg: Any) -> None:
    """Check an ``AlgorithmConfig`` (or an OmegaConf node with the same fields).

    Raises:
        ValueError: naming the field (``algorithm.<field>``), the bad value and, for name
            fields, the known choices. Numeric fields must be non-negative; ``clip_low`` must
            also be below 1 (else the lower clip bound ``1 - clip_low`` is not positive) and
            ``is_cap`` must be positive (a zero cap would zero every weighted token); the
            rollout correction (``is_level`` other than ``token``, ``is_mask``) needs
            ``off_policy`` ``tis`` or ``decoupled``; the mask band must hold 1; and
            ``dynamic_sampling`` must read (``dynamic_sampling``); ``distill_coef`` needs
            ``teacher.model`` (and ``teacher.replicas >= 1``), and advantage ``none`` needs
            ``distill_coef`` (else nothing is learned).
    """
    for field, known in (
        ("advantage", ADVANTAGE_ESTIMATORS),
        ("off_policy", OFF_POLICY_CORRECTIONS),
        ("loss_agg", LOSS_AGGREGATIONS),
        ("kl_estimator", KL_ESTIMATORS),
        ("loss", LOSSES),
        ("is_level", IS_LEVELS),
        ("is_mask", IS_MASKS),
    ):
        value = getattr(cfg, field)
        if value not in known:
            raise unknown_choice(f"algorithm.{field}", value, known)

    for field in ("clip_low", "clip_high", "kl_coef", "adv_eps"):
        value = getattr(cfg, field)
        if value < 0:
            raise ValueError(f"algorithm.{field}: must be >= 0, got {value!r}")
    if cfg.clip_low >= 1:
        raise ValueError(f"algorithm.clip_low: must be < 1, got {cfg.clip_low!r}")

    if cfg.is_cap is None:
        # Truncated IS without truncation is plain IS; refuse rather than silently run it.
        if cfg.off_policy == "tis":
            raise ValueError(
                "algorithm.is_cap: None (uncapped) is not allowed with off_policy 'tis'"
            )
    elif cfg.is_cap <= 0:
        raise ValueError(f"algorithm.is_cap: must be > 0, got {cfg.is_cap!r}")

    if cfg.off_policy == "none":
        # the rollout correction needs the trainer's recomputed log-probs to form a ratio
        for field, plain in (("is_level", "token"), ("is_mask", "none")):
            if getattr(cfg, field) != plain:
                raise ValueError(
                    f"algorithm.{field}: {getattr(cfg, field)!r} corrects the rollout/trainer "
                    f"mismatch, which off_policy 'none' does not measure: set "
                    f"algorithm.off_policy to tis or decoupled (or {field} to {plain!r})"
                )
    if cfg.is_level == "sequence" and cfg.is_cap is None:
        raise ValueError(
            "algorithm.is_cap: None (uncapped) is not allowed with is_level 'sequence': a "
            "product of token ratios overflows; set a cap (e.g. 2.0)"
        )
    if not 0 <= cfg.mask_low < 1 < cfg.mask_high:
        raise ValueError(
            f"algorithm.mask_low/mask_high: the band [{cfg.mask_low!r}, {cfg.mask_high!r}] "
            f"must hold 1 (0 <= mask_low < 1 < mask_high), else it drops on-policy tokens; "
            f"e.g. mask_low: 0.5, mask_high: 2.0"
        )
    dynamic_sampling(cfg)
    validate_distill(cfg)


def validate_distill(cfg: Any) -> None:
    """``algorithm.distill_coef`` / ``algorithm.teacher`` / advantage ``none`` (see
    ``validate_algorithm``); the engine's capability and the vocabulary are checked where
    the plugins are (``runtime.resolve``)."""
    coef = getattr(cfg, "distill_coef", 0.0)
    teacher = getattr(cfg, "teacher", None)
    model = getattr(teacher, "model", "") if teacher is not None else ""
    if coef < 0:
        raise ValueError(f"algorithm.distill_coef: must be >= 0 (0: off), got {coef!r}")
    if coef > 0 and not model:
        raise ValueError(
            f"algorithm.distill_coef: {coef!r} needs a teacher to distill from: set "
            "algorithm.teacher.model to its model directory (or distill_coef: 0)"
        )
    if model and coef == 0:
        raise ValueError(
            "algorithm.teacher: a teacher is set but algorithm.distill_coef is 0, so its "
            "scores would not be used: set distill_coef (e.g. 1.0) or remove the teacher"
        )
    if teacher is not None and model and teacher.replicas < 1:
        raise ValueError(f"algorithm.teacher.replicas: must be >= 1, got {teacher.replicas!r}")
    if cfg.advantage == "none" and coef == 0:
        raise ValueError(
            "algorithm.advantage: 'none' learns nothing from the reward; it is for on-policy "
            "distillation alone: set algorithm.distill_coef and algorithm.teacher (or another "
            "advantage)"
        )

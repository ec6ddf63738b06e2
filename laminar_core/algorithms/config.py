"""Algorithm settings: which advantage estimator, off-policy correction and loss shape to use.

``AlgorithmConfig`` is embedded in the OmegaConf structured config, so it holds only plain
types with defaults. This module deliberately does not import torch: loading and validating a
config must not pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Names accepted by ``compute_advantages`` (see ``advantages.py``).
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
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


@dataclass
class AlgorithmConfig:
    """RL objective settings (the ``algorithm:`` section of the run config).

    Attributes:
        advantage: outcome-reward advantage estimator, one of ``ADVANTAGE_ESTIMATORS``.
        clip_low: PPO lower clip epsilon; the ratio is clipped at ``1 - clip_low``.
        clip_high: PPO upper clip epsilon ("clip-higher", DAPO); clipped at ``1 + clip_high``.
        off_policy: off-policy correction, one of ``OFF_POLICY_CORRECTIONS``.
        is_cap: cap ``rho`` on the per-token importance weight used by ``tis`` and
            ``decoupled``. ``None`` means uncapped, which only ``decoupled`` accepts.
        kl_coef: weight of the KL penalty to the reference policy; 0 disables it (and then
            no reference log-probs are needed).
        kl_estimator: per-token KL estimator, one of ``KL_ESTIMATORS``.
        loss_agg: how per-token losses are reduced, one of ``LOSS_AGGREGATIONS``.
        adv_eps: epsilon added to the std in the std-normalising estimators.
    """

    advantage: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    off_policy: str = "none"
    is_cap: float | None = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg: str = "token_mean"
    adv_eps: float = 1e-6


def unknown_choice(field: str, value: Any, known: tuple[str, ...]) -> ValueError:
    """Build the uniform "unknown name" error: field, bad value, sorted known choices."""
    return ValueError(f"{field}: unknown {value!r}; known: {', '.join(sorted(known))}")


def validate_algorithm(cfg: Any) -> None:
    """Check an ``AlgorithmConfig`` (or an OmegaConf node with the same fields).

    Raises:
        ValueError: naming the field (``algorithm.<field>``), the bad value and, for name
            fields, the known choices. Numeric fields must be non-negative; ``clip_low`` must
            also be below 1 (else the lower clip bound ``1 - clip_low`` is not positive) and
            ``is_cap`` must be positive (a zero cap would zero every weighted token).
    """
    for field, known in (
        ("advantage", ADVANTAGE_ESTIMATORS),
        ("off_policy", OFF_POLICY_CORRECTIONS),
        ("loss_agg", LOSS_AGGREGATIONS),
        ("kl_estimator", KL_ESTIMATORS),
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

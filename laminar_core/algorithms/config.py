"""Algorithm settings: which advantage estimator, off-policy correction and loss shape to use.

``AlgorithmConfig`` (the ``algorithm:`` section) lives with the rest of the schema in
``config.schema``; the choices it accepts and their validation live here. This module
deliberately does not import torch: loading and validating a config must not pay for it.
"""

from __future__ import annotations

from typing import Any

from laminar_core.config.schema import AlgorithmConfig

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "AlgorithmConfig",
    "unknown_choice",
    "validate_algorithm",
]

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

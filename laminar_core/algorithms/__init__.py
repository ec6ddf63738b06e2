"""RL objectives as pure torch functions: advantage estimators, policy losses, corrections.

No engine, no I/O: every function maps tensors to tensors (plus metrics as Python floats, or
as device tensors from ``policy_loss_terms``).
"""

from .advantages import compute_advantages, dr_grpo, grpo, no_advantage, reinforce_pp, rloo
from .config import (
    ADVANTAGE_ESTIMATORS,
    GROUP_FILTERS,
    IS_LEVELS,
    IS_MASKS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LOSSES,
    OFF_POLICY_CORRECTIONS,
    AlgorithmConfig,
    DynamicSampling,
    dynamic_sampling,
    validate_algorithm,
)
from .distill import distill_advantages, reverse_kl
from .filters import group_filter, zero_variance
from .logprobs import chunked_logprobs, full_logprobs
from .losses import (
    aggregate,
    cispo_loss,
    gspo_loss,
    is_band_mask,
    is_weights,
    kl_penalty,
    metric_floats,
    policy_loss,
    policy_loss_terms,
    ppo_clip_loss,
    truncated_is_weights,
)

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
    "aggregate",
    "chunked_logprobs",
    "cispo_loss",
    "compute_advantages",
    "distill_advantages",
    "dr_grpo",
    "dynamic_sampling",
    "full_logprobs",
    "group_filter",
    "grpo",
    "gspo_loss",
    "is_band_mask",
    "is_weights",
    "kl_penalty",
    "metric_floats",
    "no_advantage",
    "policy_loss",
    "policy_loss_terms",
    "ppo_clip_loss",
    "reinforce_pp",
    "reverse_kl",
    "rloo",
    "truncated_is_weights",
    "validate_algorithm",
    "zero_variance",
]

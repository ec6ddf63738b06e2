"""Group filters of dynamic sampling: which finished GRPO groups carry no learning signal.

DAPO (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at scale",
arXiv:2503.14476, sec. 3.2 "Dynamic Sampling") drops every group whose samples all got the
same reward: with a group-relative baseline each of its advantages is 0, so it adds tokens to
the step and nothing to the gradient (and under ``token_mean`` dilutes the others). A filter
is a plain function ``rewards -> bool`` (True: drop the group), with no torch: the loop calls
it on every finished group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from laminar_core.plugins.manager import import_spec

from .config import GROUP_FILTERS

__all__ = ["GroupFilter", "group_filter", "zero_variance"]

GroupFilter = Callable[[Sequence[float]], bool]


def zero_variance(rewards: Sequence[float]) -> bool:
    """True when every reward of the group is the same (solved by all or by none): GRPO,
    Dr.GRPO and RLOO give such a group 0 advantage everywhere. A group of one sample has no
    spread either, and is dropped."""
    return max(rewards) == min(rewards) if rewards else True


def group_filter(name: str) -> GroupFilter:
    """The filter ``name``: one of ``GROUP_FILTERS`` or ``package.module:function``.

    Raises:
        ValueError: an unknown name, or a function that cannot be imported (the message
            names the cause).
    """
    if name == "zero_variance":
        return zero_variance
    if ":" not in name:
        raise ValueError(
            f"unknown group filter {name!r}; known: {', '.join(GROUP_FILTERS)}, or "
            f"'package.module:function'"
        )
    try:
        fn = import_spec(name)
    except Exception as e:
        raise ValueError(
            f"cannot import group filter {name!r} ({type(e).__name__}: {e}); check the module "
            f"is importable and the function name"
        ) from None
    if not callable(fn):
        raise ValueError(f"group filter {name!r} is not callable")
    return fn

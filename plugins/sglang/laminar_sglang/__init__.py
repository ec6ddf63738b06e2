"""Laminar rollout engine on SGLang's ``Engine`` (``rollout.engine: sglang``)."""

from laminar_sglang.engine import SGLangRolloutEngine
from laminar_sglang.options import SGLangOptions

__all__ = ["SGLangOptions", "SGLangRolloutEngine"]

"""Laminar rollout engine on vLLM's ``AsyncLLM`` (``rollout.engine: vllm``)."""

from laminar_vllm.engine import VLLMRolloutEngine
from laminar_vllm.options import VLLMOptions

__all__ = ["VLLMOptions", "VLLMRolloutEngine"]

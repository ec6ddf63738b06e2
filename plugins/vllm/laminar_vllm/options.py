"""``rollout.vllm`` options, validated by core's config loader."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VLLMOptions:
    """What a replica passes to vLLM's ``AsyncEngineArgs`` (the rest stays vLLM's default).

    ``dtype``: ``auto`` takes ``model.dtype``. ``kv_cache_mb``: KV-cache memory per replica
    (0: vLLM's own sizing from ``gpu_memory_utilization``; on CPU give a figure, since vLLM
    otherwise reserves most of the host's memory). ``max_num_seqs``: continuous-batching
    width. ``enforce_eager``: no CUDA graphs / compilation (fast start, the CPU default).
    """

    dtype: str = "auto"
    max_model_len: int = 1024
    max_num_seqs: int = 256
    kv_cache_mb: int = 0
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    log_level: str = "WARNING"  # vLLM's own logging; INFO prints every request

"""``rollout.sglang`` options, validated by core's config loader."""

from __future__ import annotations

from dataclasses import dataclass

_DEVICES = ("auto", "cuda", "cpu")


@dataclass
class SGLangOptions:
    """What a replica passes to SGLang's ``Engine`` (the rest stays SGLang's default).

    ``device``: ``auto`` is ``cuda`` when torch sees a GPU, else ``cpu`` (SGLang's CPU
    engine, ``SGLANG_USE_CPU_ENGINE=1``). ``dtype``: ``auto`` takes ``model.dtype``.
    ``tp_size``: tensor-parallel ranks per replica (0: the replica's GPUs,
    ``cluster.gpus_per_replica``; always 1 on CPU). ``max_total_tokens``: KV-cache capacity
    in tokens (0: SGLang sizes it from ``mem_fraction_static``; required on CPU, where that
    sizing reserves ~15 GB). ``max_running_requests``: continuous-batching width (0:
    SGLang's default). ``context_length``: 0 takes the model's. ``stream_interval``: SGLang
    reports a running request's tokens every this many decode steps (what ``partials``
    sees; ``abort`` always returns every token). ``attention_backend``: ``auto`` is
    ``torch_native`` on CPU (the default ``intel_amx`` needs SGLang's CPU kernels) and
    SGLang's choice on GPU. ``sleep_on_idle``: the scheduler blocks instead of polling while
    nothing runs (frees a core while the trainer works). ``start_timeout_s``: how long the
    engine may take to start before the replica reports failure. ``seed``: the base of the
    replicas' ``random_seed``: replica ``i`` gets ``seed + 1000 * run.seed + i``
    (``BuildContext.seed``), so no two replicas of a run draw the same stream.
    """

    device: str = "auto"
    dtype: str = "auto"
    tp_size: int = 0
    max_total_tokens: int = 0
    mem_fraction_static: float = 0.0  # 0: SGLang's default (GPU)
    max_running_requests: int = 0
    context_length: int = 0
    stream_interval: int = 1
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    sleep_on_idle: bool = True
    seed: int = 0
    start_timeout_s: float = 600.0
    log_level: str = "warning"  # SGLang's own logging; info prints every batch

    def __post_init__(self) -> None:
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {', '.join(_DEVICES)}, got {self.device!r}")
        for name in ("tp_size", "max_total_tokens", "max_running_requests", "context_length"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"{name} must be >= 0 (0: SGLang's default), got {getattr(self, name)}"
                )
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not 0.0 <= self.mem_fraction_static < 1.0:
            raise ValueError(
                f"mem_fraction_static must be in [0, 1) (0: SGLang's default), got "
                f"{self.mem_fraction_static}"
            )
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")

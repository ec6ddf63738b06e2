"""Options of the simulated engines and transport (validated like any plugin's options)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LengthsConfig:
    """Output-length distribution: ``lognormal`` (median, p99/p50) or ``histogram`` (file)."""

    kind: str = "lognormal"
    median: float = 1500.0
    p99_over_p50: float = 10.0
    file: str = ""

    def __post_init__(self) -> None:
        # Checked when the config is resolved, so a bad choice fails before anything runs.
        if self.kind not in ("histogram", "lognormal"):
            raise ValueError(f"lengths.kind: unknown {self.kind!r}; known: histogram, lognormal")
        if self.kind == "histogram" and not self.file:
            raise ValueError("lengths.file: kind 'histogram' needs a length histogram file")
        if self.kind == "lognormal" and not (self.median > 0 and self.p99_over_p50 >= 1):
            raise ValueError(
                "lengths: lognormal needs median > 0 and p99_over_p50 >= 1 "
                f"(got {self.median}, {self.p99_over_p50})"
            )


@dataclass
class FailureSpec:
    """Kill replica number ``replica`` at virtual time ``at_s`` (fault-injection studies)."""

    replica: int = 0
    at_s: float = 0.0


@dataclass
class SimRolloutConfig:
    """A replica modelled from a roofline: decode is memory-bound below ``roofline_batch``.

    One decode step takes ``decode_step_s`` for any batch up to ``roofline_batch`` requests
    and grows linearly above it. Admitting a request stalls decoding for its prefill
    (``prefill_s_per_token`` per prompt-plus-prefix token). A request is admitted while the KV
    cache (``kv_capacity_tokens``) has room for its prompt and prefix, up to
    ``max_num_seqs`` at once; preemption on KV overflow is not modelled.
    """

    decode_step_s: float = 0.025
    roofline_batch: int = 128
    prefill_s_per_token: float = 5e-5
    kv_capacity_tokens: int = 1_000_000
    max_num_seqs: int = 1024
    weight_load_s: float = 1.0
    lengths: LengthsConfig = field(default_factory=LengthsConfig)
    failures: list[FailureSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("roofline_batch", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("decode_step_s", "prefill_s_per_token", "kv_capacity_tokens", "weight_load_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")


@dataclass
class SimTrainerConfig:
    """A trainer whose step takes ``gpu_seconds_per_token / gpus`` per token plus overhead."""

    gpu_seconds_per_token: float = 1e-4
    step_overhead_s: float = 1.0
    scaling_exponent: float = 1.0  # step time ~ 1 / gpus**exponent (1.0: linear speed-up)


@dataclass
class SimTransportConfig:
    """A link modelled as ``t_start + bytes * t_byte`` per bucket, one bucket at a time."""

    link_gbps: float = 400.0  # between relays (GB/s = gbps / 8)
    start_s: float = 1e-3  # per-bucket start-up latency
    push_gbps: float = 800.0  # trainer ranks -> master relay, all ranks together

    def __post_init__(self) -> None:
        for name in ("link_gbps", "push_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.start_s < 0:
            raise ValueError(f"start_s must be >= 0 (got {self.start_s})")

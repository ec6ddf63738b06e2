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
    """A replica modelled on vLLM V1's scheduler (see ``sim.rollout``).

    A step reads the weights (``decode_step_s`` for any batch up to ``roofline_batch``
    requests, growing linearly above) and every resident KV token (``kv_read_s_per_token``),
    and computes its tokens at ``prefill_s_per_token`` each; it takes the longer of the memory
    and the compute time. Prefill is chunked into the decode steps: a step carries at most
    ``max_num_batched_tokens`` tokens (one per decoding request, the rest prefill). A request
    is admitted while the KV cache (``kv_capacity_tokens``) has room for its prompt and
    prefix, up to ``max_num_seqs`` at once; on overflow the newest decoding request is
    preempted and recomputed later. ``prefix_caching``: samples of one prompt share
    its prefill and KV on a replica.

    ``tool_kv`` (multi-turn, ``env.name: sim_tool``): what a replica does with a trajectory's
    KV while its tool runs. ``release``: dropped when the turn ends; the next turn re-prefills
    prompt + everything so far. ``keep``: it stays resident and counts against
    ``kv_capacity_tokens`` (the trajectory holds no batch slot); the next turn, if it comes
    back to this replica, prefills only the observation. Kept KV is evicted (oldest first)
    when admission or decoding needs the room, and dropped when the replica loads new weights.

    ``uniform_groups`` (``null``: trajectories carry no reward): simulated rewards, for
    dynamic sampling (``algorithm.dynamic_sampling``). That share of prompts, drawn per prompt
    from its index, gets the same reward (1.0) on every sample, which the filter drops; every
    other group alternates 1/0 by sample.
    """

    decode_step_s: float = 0.025
    roofline_batch: int = 128
    kv_read_s_per_token: float = 0.0  # a step also reads every resident KV token
    prefill_s_per_token: float = 5e-5
    kv_capacity_tokens: int = 1_000_000
    max_num_seqs: int = 1024
    # vLLM V1's offline default on H100-class GPUs (vllm/engine/arg_utils.py)
    max_num_batched_tokens: int = 16384
    prefix_caching: bool = True
    weight_load_s: float = 1.0
    tool_kv: str = "release"
    lengths: LengthsConfig = field(default_factory=LengthsConfig)
    failures: list[FailureSpec] = field(default_factory=list)
    uniform_groups: float | None = None

    def __post_init__(self) -> None:
        if self.uniform_groups is not None and not 0 <= self.uniform_groups <= 1:
            raise ValueError(f"uniform_groups must be in [0, 1] (got {self.uniform_groups})")
        if self.tool_kv not in ("keep", "release"):
            raise ValueError(f"tool_kv: unknown {self.tool_kv!r}; known: keep, release")
        for name in ("roofline_batch", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in (
            "decode_step_s",
            "kv_read_s_per_token",
            "prefill_s_per_token",
            "kv_capacity_tokens",
            "weight_load_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")


@dataclass
class SimTrainerConfig:
    """How long one trainer step takes (``sim.trainer``).

    ``kind: flops`` (the calibrated model): model FLOPs of the batch (``flops_per_param_token``
    x parameters x tokens, plus causal attention from ``layers`` and ``hidden``) at ``mfu`` of
    ``peak_tflops`` per GPU; a pipeline bubble ``(pp - 1) / (m + pp - 1)`` with ``m``
    micro-batches of ``micro_batch_tokens`` per pipeline per mini-batch; one gradient
    all-reduce (ring, ``grad_bytes_per_param``) over the data-parallel group per mini-batch
    (``trainer.mini_batches``) at ``dp_gbps`` per GPU, ``comm_overlap`` of it hidden behind
    backward; an optimizer step per mini-batch reading and writing ``optimizer_bytes_per_param``
    of sharded state at ``hbm_tbps``; and ``step_overhead_s``. Data-parallel efficiency falls
    with scale because the all-reduce does not shrink with more GPUs while the compute does,
    and pipeline efficiency because fewer micro-batches per pipeline leave a larger bubble.

    ``kind: linear`` (the default, for small and toy configs):
    ``step_overhead_s + tokens * gpu_seconds_per_token / gpus**scaling_exponent``. The paper
    setups (``examples/sim``) use ``flops``.

    Co-located ``sync`` (verl's hybrid engine) also pays the switch between rollout and
    training every step: ``switch_gib_per_gpu`` GiB per GPU (the rollout's weights offloaded
    and back, plus the trainer's state with ``switch_trainer_state``) at ``switch_s_per_gib``.
    ``switch: false`` turns it off (the baseline's best case).
    """

    kind: str = "linear"
    # -- kind: flops --
    peak_tflops: float = 989.0  # dense BF16 per GPU (H100/H800 SXM)
    mfu: float = 0.35
    flops_per_param_token: float = 8.0  # 6 (forward + backward) + 2 (old-policy log-probs)
    layers: int = 28
    hidden: int = 3584
    tp: int = 1
    pp: int = 1
    micro_batch_tokens: int = 16384
    grad_bytes_per_param: float = 2.0
    dp_gbps: float = 320.0  # per GPU, ring all-reduce bus bandwidth
    comm_overlap: float = 0.5
    optimizer_bytes_per_param: float = 16.0
    hbm_tbps: float = 3.35
    # -- kind: linear --
    gpu_seconds_per_token: float = 1e-4
    scaling_exponent: float = 1.0  # step time ~ 1 / gpus**exponent (1.0: linear speed-up)
    # -- both --
    step_overhead_s: float = 1.0
    # -- co-located sync: the rollout <-> training switch --
    switch: bool = True
    switch_s_per_gib: float = 0.04
    switch_trainer_state: bool = True
    trainer_state_bytes_per_param: float = 16.0

    def __post_init__(self) -> None:
        if self.kind not in ("flops", "linear"):
            raise ValueError(f"kind: unknown {self.kind!r}; known: flops, linear")
        for name in ("peak_tflops", "mfu", "hbm_tbps", "dp_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.mfu > 1:
            raise ValueError(f"mfu is a fraction of peak, <= 1 (got {self.mfu})")
        if not 0 <= self.comm_overlap <= 1:
            raise ValueError(f"comm_overlap must be in [0, 1] (got {self.comm_overlap})")
        for name in ("tp", "pp", "micro_batch_tokens", "layers", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")


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

"""``rollout.vllm`` options, validated by core's config loader."""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_CORES = ("auto", "inproc", "process")


@dataclass
class VLLMOptions:
    """What a replica passes to vLLM's ``AsyncEngineArgs`` (the rest stays vLLM's default).

    ``dtype``: ``auto`` takes ``model.dtype``. ``kv_cache_mb``: KV-cache memory per replica
    (0: vLLM's own sizing from ``gpu_memory_utilization``; on CPU give a figure, since vLLM
    otherwise reserves most of the host's memory). ``max_num_seqs``: continuous-batching
    width. ``enforce_eager``: no CUDA graphs / compilation (fast start, the CPU default); with
    the core in the replica's process, vLLM's small ``torch.compile``'d helpers run eagerly
    too (no inductor compile on the first ``generate``).
    ``engine_core``: where vLLM's engine core (scheduler + model) runs. ``process``: its own
    process under ``AsyncLLM`` (vLLM's usual layout). ``inproc``: inside the replica's
    process (``laminar_vllm.inproc``), one process and one vLLM import fewer per replica;
    only for a process that hosts this one engine. ``auto``: ``inproc`` where the runtime
    gives the engine its own process (a Ray replica actor) and there is no CUDA (the CPU
    quickstart), else ``process``. ``worker_in_core``: in ``process`` mode on CPU, run the
    model inside the engine core (vLLM's ``uni`` executor) instead of a separate Worker
    process (GPU runs with one device per replica do already). ``seed``: the base of the
    replicas' sampling seeds: replica ``i`` samples with ``seed + 1000 * run.seed + i``
    (``BuildContext.seed``), so no two replicas of a run draw the same stream.
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
    engine_core: str = "auto"
    worker_in_core: bool = True

    def __post_init__(self) -> None:
        if self.engine_core not in ENGINE_CORES:
            raise ValueError(
                f"engine_core: unknown {self.engine_core!r}; known: {', '.join(ENGINE_CORES)}"
            )

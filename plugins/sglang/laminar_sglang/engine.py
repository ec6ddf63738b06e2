"""``SGLangRolloutEngine``: one Laminar rollout replica on SGLang's ``Engine``.

SGLang does the continuous batching: every ``generate`` call is one SGLang request, streamed
with incremental output, so this engine always knows the tokens and log-probs each
trajectory has produced so far. That running record (core's ``InFlightTrajectories``) is
what ``abort`` and ``partials`` return, and what a resumed trajectory starts from (prompt +
partial response re-prefilled, the prefix's log-probs kept). Log-probs are SGLang's
sampled-token log-probs after temperature scaling, ``log_softmax(logits / T)``: what the
trainer recomputes.

The SGLang ``Engine`` runs in a host process of this replica's own (``laminar_sglang.host``;
one per replica, tensor parallel inside it on GPU), because SGLang kills the process that
holds its engine when one of its children fails: isolated there, such a failure closes the
host's channel and every call of this replica raises ``ReplicaFailure`` instead of taking
the driver (or the Ray actor) down with it.

Weights are loaded in place: the new version is named by a file in the node's shared memory
(the node relay's own file for ``SharedWeights``; a safetensors file this engine writes for
tensors in memory, in core's ``ShmScratch``), and SGLang's schedulers map it through a
custom loader (``laminar_sglang.loader``) inside ``begin_weight_update`` /
``update_weights_from_tensor`` / ``end_weight_update``; the prefix cache is flushed after.

With ``trainer.lora`` a version is a LoRA adapter (PEFT names, ``laminar_core.training.lora``):
written as a PEFT adapter directory in the same shared-memory scratch and loaded with SGLang's
``load_lora_adapter`` under a name of its own, which every request started after the update
names (``lora_path``); the base weights never change. A request keeps the adapter it started
with; the previous adapter is unloaded after the new one is in, and SGLang's unload waits
until no request running with it is left. On CPU SGLang's ``torch_native`` LoRA backend runs
the adapters (its pinned-memory requests made no-ops: ``cpu_support.pinning``).

SGLang is imported only in the host process, so validating a config or listing plugins
stays fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import psutil
import torch

import laminar_core
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
    shm_files_of,
)
from laminar_core.training import LoRASpec, write_adapter
from laminar_sglang import channel, cpu_support, loader
from laminar_sglang.options import SGLangOptions

_STOP_WAIT_S = 60.0
# Timings use the monotonic clock: the one the driver's event loop reads (on one node).


def _import_root(module: Any) -> str:
    """The directory a package is imported from (its parent), for the host's import path;
    ``module`` is the package or a module directly inside it."""
    return str(Path(module.__file__).resolve().parent.parent)


class SGLangRolloutEngine(RolloutEngine):
    """An SGLang replica. ``replica_id`` names it; ``model_path`` is a local HF directory;
    ``gpus`` is the replica's GPU count (its tensor-parallel size unless options say)."""

    Options = SGLangOptions
    hot_loads_lora = True  # trainer.lora: versions load as SGLang LoRA adapters
    scores_tokens = True  # algorithm.teacher: input log-probs over given ids (``score``)

    @classmethod
    def from_config(cls, ctx: BuildContext) -> SGLangRolloutEngine:
        cfg = ctx.config
        opt = ctx.options or SGLangOptions()
        return cls(
            ctx.name or f"r{ctx.index}",
            cfg.model.path,
            # each replica samples from a stream of its own (run.seed and its index)
            dataclasses.replace(opt, seed=ctx.seed(opt.seed)),
            model_dtype=cfg.model.dtype,
            gpus=ctx.gpus,
            lora=LoRASpec.of(cfg.trainer.lora),
        )

    def __init__(
        self,
        replica_id: str,
        model_path: str,
        options: SGLangOptions | None = None,
        model_dtype: str = "bfloat16",
        gpus: int = 1,
        lora: LoRASpec | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.model_path = model_path
        self.opt = options or SGLangOptions()
        self.dtype = model_dtype if self.opt.dtype == "auto" else self.opt.dtype
        self.gpus = gpus
        self.version = 0
        #: The host process's pid and SGLang's child processes' (scheduler, detokenizer).
        self.host_pid: int | None = None
        self.child_pids: list[int] = []
        self._proc: subprocess.Popen | None = None
        self._tmp: str | None = None  # the host's TMPDIR (SGLang's IPC socket files)
        # files SGLang leaves in /dev/shm: its load snapshot's from before the host starts
        # (this replica names SGLang's instance), the rest once SGLang is ready
        self._leftovers: list[str] = []
        self._ready = False  # SGLang answered ready: stop() may ask the host to shut down
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        # the trajectories in flight (by SGLang request id too): what abort and partials return
        self._inflight = InFlightTrajectories(replica_id)
        self._scratch = ShmScratch("laminar-sglang-")  # weight files in shared memory
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._capacity_tokens = 0
        self._dead: str | None = None
        self._stopping = False
        self.lora = lora  # versions are adapters of this shape (trainer.lora)
        self._adapter: tuple[str, Path] | None = None  # (name, directory) new requests use
        self._adapter_ids = itertools.count(1)

    # -- lifecycle ---------------------------------------------------------------------------
    def device(self) -> str:
        if self.opt.device != "auto":
            return self.opt.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def engine_kwargs(self, path: str) -> dict[str, Any]:
        """The keyword arguments of SGLang's ``Engine`` (its ``ServerArgs``) for this replica."""
        device = self.device()
        opt = self.opt
        kw: dict[str, Any] = {
            "model_path": path,
            "dtype": self.dtype,
            "device": device,
            "tp_size": 1 if device == "cpu" else (opt.tp_size or max(1, self.gpus)),
            "random_seed": opt.seed,
            "log_level": opt.log_level,
            # each streamed piece holds only the new tokens (the default resends all of them)
            "incremental_streaming_output": True,
            "stream_interval": opt.stream_interval,
            "disable_radix_cache": not opt.enable_prefix_caching,
            "sleep_on_idle": opt.sleep_on_idle,
            "custom_weight_loader": [loader.LOAD_FORMAT],
        }
        if opt.attention_backend != "auto":
            kw["attention_backend"] = opt.attention_backend
        elif device == "cpu":
            kw["attention_backend"] = "torch_native"  # the default needs SGLang's CPU kernels
        optional = {
            "max_total_tokens": opt.max_total_tokens,
            "mem_fraction_static": opt.mem_fraction_static,
            "max_running_requests": opt.max_running_requests,
            "context_length": opt.context_length,
        }
        kw.update({k: v for k, v in optional.items() if v})
        if self.lora is not None:
            kw.update(lora_engine_args(self.lora, device))
        return kw

    def _host_env(self, device: str) -> dict[str, str]:
        env = dict(os.environ)
        # The host imports this package and core exactly as this process does.
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        for root in (_import_root(channel), _import_root(laminar_core)):
            if root not in paths:
                paths.append(root)
        if device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            standins = cpu_support.import_path()
            if standins is not None:  # appended: an installed package is found first
                paths.append(standins)
        env["PYTHONPATH"] = os.pathsep.join(paths)
        # SGLang names its IPC sockets with NamedTemporaryFile(delete=False) and never
        # removes them: a directory of the host's own, removed at stop, keeps /tmp clean.
        self._tmp = tempfile.mkdtemp(prefix=f"laminar-sglang-{self.replica_id}-")
        env["TMPDIR"] = self._tmp
        return env

    async def start(self) -> None:
        path = str(model_dir(self.model_path, f"rollout replica {self.replica_id}"))
        device = self.device()
        if device == "cpu" and not self.opt.max_total_tokens:
            raise ValueError(
                f"rollout replica {self.replica_id}: rollout.sglang.max_total_tokens must be "
                "set on CPU (SGLang otherwise reserves ~15 GB of KV cache); e.g. 16384"
            )
        if importlib.util.find_spec("sglang") is None:
            raise ImportError(
                "rollout.engine=sglang needs SGLang: `pip install laminar-sglang[gpu]` on a GPU "
                "machine, or `bash scripts/install.sh` (the CPU recipe) on CPU"
            )
        self._scratch.remove_orphans()
        # SGLang's instance id names its load-snapshot file; chosen here, the file is this
        # replica's to remove from the start on, whenever the host dies (``_kill_host``)
        instance_id = uuid.uuid4().hex[:12]
        snapshot = snapshot_path(instance_id)
        self._leftovers = [snapshot]
        self._ready = False
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "laminar_sglang.host", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=self._host_env(device),
                # its own process group: stop() and failures remove SGLang's children with
                # it, and a Ctrl-C meant for the driver does not hit them half-way
                start_new_session=True,
            )
        finally:
            theirs.close()
        proc = self._proc
        self.host_pid = proc.pid
        self._reader, self._writer = await asyncio.open_connection(sock=ours)
        first = {"engine_kwargs": self.engine_kwargs(path), "instance_id": instance_id}
        channel.send(self._writer, {**first, "snapshot": snapshot})
        try:
            msg = await asyncio.wait_for(channel.recv(self._reader), self.opt.start_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            code = proc.poll()
            if self._dead is not None:  # stop() came first and removed the host
                raise RuntimeError(
                    f"rollout replica {self.replica_id}: stopped while SGLang was starting"
                ) from None
            await self._abandon("did not start")
            what = (
                f"did not start within {self.opt.start_timeout_s:.0f} s "
                "(rollout.sglang.start_timeout_s)"
                if isinstance(e, asyncio.TimeoutError)
                else f"host process exited with code {code} while starting"
            )
            raise RuntimeError(
                f"rollout replica {self.replica_id}: SGLang {what} on {path}; its log lines "
                "above give the cause"
            ) from None
        if msg["t"] == "failed":
            await self._abandon("failed to start")
            raise RuntimeError(
                f"rollout replica {self.replica_id}: SGLang failed to start on {path}: "
                f"{msg['error']}. The lines above from SGLang give the root cause; on CPU the "
                "usual fixes are rollout.sglang.max_total_tokens (memory) and "
                "rollout.sglang.context_length."
            )
        self.child_pids = list(msg["pids"])
        self._leftovers = sorted({*self._leftovers, *msg["leftovers"]})
        self._capacity_tokens = int(msg["capacity"])
        self._ready = True
        self._reading = asyncio.ensure_future(self._read())

    async def stop(self) -> None:
        """Shut SGLang down and remove what it left; a replica still starting (``start``
        waits for SGLang) kills its host at once, which makes that ``start`` raise."""
        if self._proc is None:
            return
        if self._dead is None and self._ready:
            self._stopping = True  # the channel closing from now on is the host exiting as asked
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call("stop"), _STOP_WAIT_S)
            proc = self._proc  # None once a failed start was abandoned meanwhile
            with contextlib.suppress(subprocess.TimeoutExpired):
                if proc is not None:
                    await asyncio.to_thread(proc.wait, _STOP_WAIT_S)
        self._dead = self._dead or "stopped"
        await self._kill_host()
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        if self._writer is not None:
            self._writer.close()
        self._proc = None
        if self._adapter is not None:
            shutil.rmtree(self._adapter[1], ignore_errors=True)
            self._adapter = None
        self._scratch.release()

    async def _abandon(self, reason: str) -> None:
        """A start that failed: nothing of the host is left, and the engine is dead."""
        self._dead = reason
        await self._kill_host()
        if self._writer is not None:
            self._writer.close()
        self._proc = None

    async def _kill_host(self) -> None:
        """Remove the host and whatever SGLang left of its process group, reap the host and
        wait (bounded) until SGLang's processes are gone, so their memory is free again."""
        proc = self._proc
        if proc is None:
            return
        # SGLang's processes, whether or not it got as far as naming them (a start cut
        # short): the files go only once none of them can still create one
        descendants: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            descendants = psutil.Process(proc.pid).children(recursive=True)
        children = {p.pid: p for p in descendants}
        for pid in self.child_pids:
            with contextlib.suppress(psutil.Error):
                children.setdefault(pid, psutil.Process(pid))
        # and what SGLang made in /dev/shm that they hold (its load snapshot, known already,
        # and multiprocessing's named semaphores); not a relay's weights, mapped there too
        made = [
            f
            for f in shm_files_of(proc.pid)
            if os.path.basename(f).startswith(("sglang_", "sem.mp-"))
        ]
        # multiprocessing's resource tracker unlinks the named semaphores it was told of once
        # every process that could use them is gone: it goes last (killed by the group kill,
        # it could not, and a start cut short has not told the replica their names)
        trackers = [p for p in descendants if _is_resource_tracker(p)]
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        for p in descendants:
            if p not in trackers:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, 30)
        others = [p for p in children.values() if p not in trackers]
        if others:  # orphans now: init reaps them once they exit
            await asyncio.to_thread(psutil.wait_procs, others, 30)
        if trackers:
            await asyncio.to_thread(psutil.wait_procs, trackers, 10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of SGLang's processes
        for path in sorted({*self._leftovers, *made}):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- the host channel --------------------------------------------------------------------
    async def _read(self) -> None:
        assert self._reader is not None
        try:
            while True:
                msg = await channel.recv(self._reader)
                if msg["t"] == "out":
                    live = self._inflight.find(msg["rid"])
                    if live is None:
                        continue
                    live.tokens.extend(msg["ids"])
                    live.logprobs.extend(msg["lps"])
                    live.finish = msg["fin"] or live.finish
                    if msg.get("error"):
                        live.error = msg["error"]
                    if msg["done"]:
                        live.done.set()
                elif msg["t"] == "reply":
                    fut = self._calls.pop(msg["id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            if self._stopping:
                return
            code = self._proc.poll() if self._proc is not None else None
            self._fail(f"SGLang host process exited (code {code})")

    def _fail(self, reason: str) -> None:
        """The host is gone: every waiting call and trajectory learns it now."""
        if self._dead is None:
            self._dead = reason
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(ReplicaFailure(f"replica {self.replica_id}: {self._dead}"))
        self._calls.clear()
        for live in self._inflight:
            live.done.set()
        if self._proc is not None:  # SGLang's children may outlive a killed host
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    def _check(self) -> None:
        if self._dead is not None:
            raise ReplicaFailure(f"replica {self.replica_id} is dead: {self._dead}")
        if self._proc is None or self._writer is None:
            raise RuntimeError(f"replica {self.replica_id}: start() has not been called")
        code = self._proc.poll()
        if code is not None:
            self._fail(f"SGLang host process exited (code {code})")
            raise ReplicaFailure(f"replica {self.replica_id} is dead: {self._dead}")

    async def _send(self, msg: dict[str, Any]) -> None:
        assert self._writer is not None
        channel.send(self._writer, msg)
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self._fail(f"SGLang host channel broken: {e}")
            raise ReplicaFailure(f"replica {self.replica_id}: {self._dead}") from e

    async def _call(self, op: str, **args: Any) -> Any:
        self._check()
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        await self._send({"op": op, "id": call_id, "args": args})
        reply = await fut
        if "error" in reply:
            raise RuntimeError(f"replica {self.replica_id}: SGLang {op} failed: {reply['error']}")
        return reply["value"]

    # -- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> Trajectory:
        self._check()
        tid = request.traj_id
        # a resumed trajectory is a new SGLang request
        with self._inflight.track(request, self.version, f"{tid}#{next(self._ids)}") as live:
            if live.remaining > 0:
                await self._stream(live)
        if self._dead is not None and live.finish is None:
            raise ReplicaFailure(
                f"replica {self.replica_id}: trajectory {tid} lost with the engine: {self._dead}"
            )
        if live.error is not None:
            raise RuntimeError(
                f"replica {self.replica_id}: SGLang refused trajectory {tid}: {live.error}"
            )
        return self._inflight.trajectory(live)

    async def _stream(self, live: LiveTrajectory) -> None:
        """One SGLang request; ``_read`` appends its tokens to ``live`` and sets ``done``."""
        s = live.request.sampling
        sampling: dict[str, Any] = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_new_tokens": live.remaining,
        }
        if s.stop:
            sampling["stop"] = list(s.stop)
        if s.stop_token_ids:
            sampling["stop_token_ids"] = list(s.stop_token_ids)
        if s.seed is not None:  # honoured by SGLang's deterministic-inference mode
            sampling["sampling_seed"] = s.seed
        msg = {"op": "generate", "rid": live.request_id, "input_ids": live.input_ids}
        if self._adapter is not None:  # the adapter this request runs with to its end
            msg["lora"] = self._adapter[0]
        try:
            await self._send({**msg, "sampling": sampling})
            await live.done.wait()
        except asyncio.CancelledError:
            if self._dead is None and not live.done.is_set():
                with contextlib.suppress(Exception):
                    await self._send({"op": "abort", "rids": [live.request_id]})
            raise

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The response tokens' log-probs given their prefixes (``RolloutEngine.score``):
        SGLang's input-token log-probs of ``prompt_ids + response_ids`` (``return_logprob``
        from ``logprob_start_len`` 0; the host's ``_op_score``)."""
        if not response_ids:
            return []
        ids = [*prompt_ids, *response_ids]
        got = await self._call("score", input_ids=ids, start=len(prompt_ids))
        return [float(x) for x in got]

    async def abort(self, traj_ids: list[str]) -> list[PartialTrajectory]:
        self._check()
        # SGLang hands back the aborted requests' last tokens through their streams: the
        # helper waits for them, so the partials hold everything the trajectories produced
        return await self._inflight.abort(
            traj_ids,
            lambda lives: self._send({"op": "abort", "rids": [v.request_id for v in lives]}),
        )

    async def partials(self, traj_ids: list[str] | None = None) -> list[PartialTrajectory]:
        self._check()
        return self._inflight.partials(traj_ids)

    # -- weights -----------------------------------------------------------------------------
    async def update_weights(self, weights: WeightsRef) -> None:
        """Hold ``weights.version``: load a node relay's ``SharedWeights`` or in-memory
        ``TensorWeights``; a ``ModelOnly`` version has no tensors (only the number changes)."""
        self._check()
        self._inflight.require_idle()
        if self.lora is not None and not isinstance(weights, ModelOnly):
            await self._load_adapter(weights)
        elif isinstance(weights, SharedWeights):
            # The node relay's own file: every scheduler maps it (no copy of ours). Opening
            # it here first makes a missing or replaced version fail before SGLang loads:
            # a loader error inside SGLang's scheduler would kill the replica.
            iter(weights)
            ref = {
                "kind": "shared",
                "root": str(weights.root),
                "relay_id": int(weights.relay_id),
                "version": int(weights.version),
            }
            await self._call("update", ref=ref)
        elif isinstance(weights, TensorWeights):
            with self._scratch.safetensors(weights, self.replica_id) as path:
                await self._call("update", ref={"kind": "safetensors", "path": path})
        elif not isinstance(weights, ModelOnly):
            raise TypeError(
                f"replica {self.replica_id}: update_weights takes TensorWeights, SharedWeights "
                f"or ModelOnly, got {type(weights).__name__}"
            )
        self.version = weights.version

    async def _load_adapter(self, weights: WeightsRef) -> None:
        """A LoRA version: a PEFT adapter directory in scratch, loaded by SGLang under a new
        name before any request uses it (an adapter that does not fit the base model fails
        here, not in a request); then the previous adapter is unloaded and its files go."""
        n = next(self._adapter_ids)
        path = self._scratch.dir() / f"{self.replica_id}-adapter{n}"
        name = f"laminar-v{weights.version}-{n}"
        await asyncio.to_thread(write_adapter, path, iter(weights), self.lora, self.model_path)
        try:
            await self._call("load_lora", name=name, path=str(path))
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(e, ReplicaFailure):
                raise
            raise RuntimeError(
                f"replica {self.replica_id}: SGLang could not load version {weights.version}'s "
                f"LoRA adapter ({e}); the trainer's trainer.lora and model.path must match "
                "this replica's base model"
            ) from e
        old, self._adapter = self._adapter, (name, path)
        if old is not None:
            await self._call("unload_lora", name=old[0])
            shutil.rmtree(old[1], ignore_errors=True)

    async def stats(self) -> EngineStats:
        # SGLang's scheduler publishes its load (running, waiting, KV tokens in use) every
        # few steps; our own record of in-flight requests is exact, so the scheduler's view
        # splits those into running and waiting and says how full the KV cache is.
        sched = await self._call("stats")
        inflight = len(self._inflight)
        waiting = min(inflight, sched["waiting"]) if sched else 0
        capacity = (sched or {}).get("capacity") or self._capacity_tokens
        if inflight and sched:
            kv_use = sched["used"] / capacity if capacity else 0.0
        else:
            kv_use = self._inflight.held_tokens() / capacity if capacity else 0.0
        return EngineStats(
            running=inflight - waiting,
            waiting=waiting,
            kv_use=min(1.0, kv_use),
            kv_capacity_tokens=capacity,
            version=self.version,
        )


def snapshot_path(instance_id: str) -> str:
    """The load-snapshot file SGLang's instance ``instance_id`` (hex digits) creates in
    /dev/shm: ``sglang.srt.managers.load_snapshot.shm_path_for``, computed here so the
    replica knows it without importing SGLang (the host refuses to start if they differ)."""
    digest = hashlib.blake2s(instance_id.encode(), digest_size=4).hexdigest()
    return f"/dev/shm/sglang_loads_{instance_id}_{digest}.shm"


def _is_resource_tracker(p: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def lora_engine_args(lora: LoRASpec, device: str) -> dict[str, Any]:
    """SGLang's engine arguments for adapters of ``lora``'s shape: no adapter at start, room
    for two (the version running and the one replacing it), SGLang's pure-torch LoRA
    backend on CPU (its default kernels are Triton's)."""
    kw: dict[str, Any] = {
        "enable_lora": True,
        "max_lora_rank": lora.rank,
        "lora_target_modules": sorted(lora.target_modules),
        "max_loras_per_batch": 2,
        "max_loaded_loras": 2,
    }
    if device == "cpu":
        kw["lora_backend"] = "torch_native"
    return kw

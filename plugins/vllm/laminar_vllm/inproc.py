"""``InprocLLM``: vLLM's engine core inside this process, driven from asyncio.

``AsyncLLM`` always runs the engine core (scheduler + model) in a process of its own and
talks to it over ZMQ. A replica that already has a process to itself -- a Ray actor hosting
one engine -- then costs two processes, and each imports vLLM: on a small CPU machine that
second import is most of a replica's start-up (~10-17 s of CPU here). ``InprocLLM`` keeps the
same calls the engine makes on ``AsyncLLM`` (``generate`` streaming ``RequestOutput`` deltas,
``abort``, ``collective_rpc``, ``reset_prefix_cache``, ``add_lora``/``remove_lora``,
``errored``/``dead_error``, ``shutdown``) over vLLM's synchronous ``LLMEngine`` with its
in-process core client.

Contract: one background task steps the engine while it has requests; each ``step`` runs
on one worker thread (the model's torch ops release the GIL, so the actor's event loop keeps
answering calls). Every other call on the engine waits for the step in progress to end (an
``asyncio.Lock`` serialises them: ``LLMEngine`` is not thread-safe), so a request is added,
aborted or the weights reloaded between two steps, never during one. An aborted request's
stream ends at once; what it produced is what its stream had delivered. A step that raises
marks the engine dead (``errored``) and ends every stream with that error.

Use it only in a process that hosts this one engine: vLLM's CPU worker sets process-wide
state when it starts (``torch.set_num_threads`` becomes a no-op, a gloo group of one, the
global seed, NUMA memory binding).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_END = object()  # a stream's end marker (the request finished or was aborted)


class InprocLLM:
    """The subset of ``AsyncLLM`` a replica uses, with the engine core in this process."""

    def __init__(self, engine: Any, eager: bool = False) -> None:
        self.engine = engine
        self.vllm_config = engine.vllm_config
        self.errored = False
        self.dead_error: BaseException | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        # the thread every step runs on: ``eager`` holds there too (dynamo's flag is per thread)
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="vllm-step", initializer=eager_only if eager else None
        )
        self._driver: asyncio.Task | None = None
        self._aborts: set[asyncio.Future] = set()  # held until done (the loop keeps weak refs)

    @classmethod
    def from_engine_args(
        cls, args: Any, stat_loggers: list | None = None, eager: bool = False
    ) -> InprocLLM:
        """Build the engine from ``AsyncEngineArgs`` (an ``EngineArgs``) in this process;
        ``eager``: nothing is compiled (``eager_only``), in this thread and the step's."""
        from vllm.v1.engine.llm_engine import LLMEngine

        if eager:
            eager_only()
        engine = LLMEngine.from_engine_args(
            args, stat_loggers=stat_loggers, enable_multiprocessing=False
        )
        return cls(engine, eager)

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self, prompt: Any, params: Any, request_id: str, lora_request: Any = None
    ) -> AsyncIterator[Any]:
        """The request's ``RequestOutput`` s as the engine produces them, until it finishes
        or is aborted. Leaving the loop early (cancelled) aborts the request."""
        self._raise_if_dead()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            async with self._lock:
                self._raise_if_dead()
                self.engine.add_request(request_id, prompt, params, lora_request=lora_request)
            self._ensure_driver()
            self._wake.set()
            while True:
                item = await queue.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = bool(item.finished)
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if not finished and not self.errored:
                # cancelled mid-request: vLLM must not keep generating for nobody
                task = asyncio.ensure_future(self._abort_in_engine([request_id]))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    async def abort(self, request_ids: list[str]) -> None:
        """Stop the requests; their streams end (after the step in progress, if any)."""
        await self._abort_in_engine(request_ids)
        for rid in request_ids:
            queue = self._streams.pop(rid, None)
            if queue is not None:
                queue.put_nowait(_END)

    async def _abort_in_engine(self, request_ids: list[str]) -> None:
        async with self._lock:
            if not self.errored and self.engine is not None:  # dead or shut down: nothing runs
                self.engine.abort_request(list(request_ids))

    # -- control -----------------------------------------------------------------------------
    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        """Call ``method`` on the worker (the weight loader's), between two steps."""
        async with self._lock:
            self._raise_if_dead()
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._pool, lambda: self.engine.collective_rpc(method, args=args, kwargs=kwargs)
            )

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter (between two steps)."""
        async with self._lock:
            self._raise_if_dead()
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        async with self._lock:
            self._raise_if_dead()
            return self.engine.remove_lora(lora_id)

    async def reset_prefix_cache(self) -> bool:
        async with self._lock:
            self._raise_if_dead()
            return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop stepping, end every stream, release the engine (idempotent)."""
        if self._driver is not None:
            self._driver.cancel()
            self._driver = None
        for queue in self._streams.values():
            queue.put_nowait(RuntimeError("the vLLM engine was shut down"))
        self._streams.clear()
        self._pool.shutdown(wait=True)  # a step in progress ends before the core goes
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.engine_core.shutdown()

    # -- the stepping loop -------------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self.errored:
            raise RuntimeError(f"the vLLM engine died: {self.dead_error!r}")
        if self.engine is None:
            raise RuntimeError("the vLLM engine was shut down")

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            async with self._lock:
                if self.engine is None:
                    return
                # cleared under the lock: a request added after this check sets it again
                self._wake.clear()
                busy = self.engine.has_unfinished_requests()
                if busy:
                    try:
                        outputs = await loop.run_in_executor(self._pool, self.engine.step)
                    except Exception as e:
                        self._die(e)
                        return
            if not busy:
                await self._wake.wait()
                continue
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self._streams[out.request_id]
            # let calls queued on the lock (add, abort, reload) in before the next step
            await asyncio.sleep(0)

    def _die(self, error: BaseException) -> None:
        self.errored = True
        self.dead_error = error
        for queue in self._streams.values():
            queue.put_nowait(RuntimeError(f"the vLLM engine died: {error!r}"))
        self._streams.clear()


def eager_only() -> None:
    """No ``torch.compile`` in the calling thread: what it would compile runs eagerly.

    With ``enforce_eager`` vLLM runs the model eagerly, but still decorates a few small
    functions with ``torch.compile`` (on CPU: the sampled token's log-prob rank,
    ``batched_count_greater_than``), and the first step compiles them with inductor: a
    vector-ISA probe and g++ runs in subprocesses. On the 2-core machine that was ~1 s of CPU
    in each replica and ~2-6 s more in its compilers, between the replicas' start and the
    first trajectory, for an op that runs as fast eagerly on a replica's batch. Dynamo's
    ``disable`` flag is per thread (a user override of torch's config is thread-local), so
    it is set in each thread that builds or steps the engine.
    """
    import torch._dynamo

    torch._dynamo.config.disable = True

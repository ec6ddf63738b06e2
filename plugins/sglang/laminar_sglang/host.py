"""The SGLang host: a process of its own that runs one SGLang ``Engine`` for one replica.

``python -m laminar_sglang.host FD`` is started by ``SGLangRolloutEngine.start`` with one
end of a socket pair as ``FD``; everything else arrives over it (``channel``).

Why a process of its own: SGLang treats the process that holds its ``Engine`` (and its
tokenizer manager) as its own. When a scheduler or detokenizer child fails, it signals that
process (SIGQUIT) and SGLang's handler kills the whole process tree, the holder included
(exit 137); ``Engine.shutdown`` kills every child of the holder, whoever started them (the
Ray daemons of a driver, another engine's workers). Here the tree is this host and SGLang's
own children, so the replica survives and sees the host's end of the socket close: a
``ReplicaFailure``. The host also exits when the replica's end closes, so a replica that
dies leaves no SGLang processes behind.

Messages in: first ``{"engine_kwargs", "instance_id", "snapshot"}`` (SGLang's ``Engine``
arguments, the instance id the replica chose for it, and the load-snapshot file that id
names); then ``{"op": "generate", "rid", "input_ids", "sampling", "lora"?}`` (``lora``: the
loaded adapter's name the request runs with), ``{"op": "abort", "rids"}``, ``{"op": "stats" |
"update" | "load_lora" | "unload_lora" | "stop", "id", ...}``. Messages out: ``{"t":
"ready" | "failed"}`` once, ``{"t": "out", "rid", "ids", "lps", "fin", "done"}`` per
streamed piece of a request, ``{"t": "reply", "id", "value" | "error"}`` per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
import traceback
from pathlib import Path
from typing import Any


def _die_with_the_host() -> None:
    """In SGLang's children (they re-import this module as ``__mp_main__``, before anything
    of SGLang): SIGKILL when the host dies, however it dies. SGLang sets the same only once
    a child's own imports are done (seconds on CPU); a host killed meanwhile (a run ending
    while a replica restarts: Ray kills the actor's host) left a scheduler and a detokenizer
    orphaned, with their load snapshot in /dev/shm."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the host died before the line above
        os._exit(1)


if __name__ == "__mp_main__" and sys.platform == "linux":
    _die_with_the_host()

# after the hook above, so a child spends as little as it can without it
from laminar_sglang import channel, loader  # noqa: E402
from laminar_sglang.cpu_support import pinning  # noqa: E402

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    # SGLang's LoRA layers ask for pinned host memory, which a CPU-only torch cannot give
    # (``cpu_support.pinning``). At import, so SGLang's spawned schedulers, which re-import
    # this module as ``__mp_main__``, install it before they build their LoRA layers.
    pinning.install()


class _Host:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.engine: Any = None
        self.aborted: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self.semaphores_before: set[str] = set()

    async def run(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(sock=self.sock)
        cfg = await channel.recv(self.reader)
        try:
            from sglang.srt.entrypoints.engine import Engine

            _name_instance(cfg["instance_id"], cfg["snapshot"])
            self.semaphores_before = _semaphores()
            self.engine = Engine(**cfg["engine_kwargs"])
        except BaseException as e:  # reported to the replica, then exit
            channel.send(
                self.writer,
                {
                    "t": "failed",
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc(),
                },
            )
            await self.writer.drain()
            return
        self.tm = self.engine.tokenizer_manager
        info = await self._info()
        try:
            # a replica gone while SGLang started: the send fails, SGLang still goes below
            channel.send(self.writer, {"t": "ready", **info})
            await self.writer.drain()
            await self._serve()
        except (ConnectionError, OSError):
            pass
        finally:
            self.engine.shutdown()
            # what SGLang leaves behind; the replica removes it too, unless it is the one gone
            for path in info["leftovers"]:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            tmp = os.environ.get("TMPDIR", "")
            if os.path.basename(tmp).startswith("laminar-sglang-"):
                shutil.rmtree(tmp, ignore_errors=True)

    async def _info(self) -> dict[str, Any]:
        capacity = 0
        with contextlib.suppress(Exception):  # a snapshot may not be published yet
            loads = await self.tm.get_loads()
            capacity = int(loads[0].max_total_num_tokens) if loads else 0
        if not capacity:
            state = (await self.tm.get_internal_state())[0]
            capacity = int(state.get("max_total_num_tokens", 0))
        leftovers = []
        with contextlib.suppress(Exception):  # SGLang's load-snapshot file, left at exit
            from sglang.srt.managers.load_snapshot import shm_path_for

            leftovers.append(shm_path_for(self.engine.port_args.instance_id))
        pids = list(self.engine.get_all_child_pids())
        # SGLang's named semaphores (multiprocessing under spawn): their unlinker, the
        # resource tracker, is one of the children SGLang's shutdown kills, so they stay in
        # /dev/shm. New names since this engine began are its own, unless another engine
        # started on the node in that same window (then its name goes early: a process that
        # has the semaphore open keeps it; SGLang opens them by name only while starting).
        leftovers += sorted(_semaphores() - self.semaphores_before)
        return {
            "pids": pids,
            "capacity": capacity,
            "leftovers": leftovers,
        }

    async def _serve(self) -> None:
        while True:
            try:
                msg = await channel.recv(self.reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the replica is gone: shut down
            op = msg["op"]
            if op == "generate":
                self._spawn(self._generate(msg))
            elif op == "abort":
                for rid in msg["rids"]:
                    self.aborted.add(rid)
                    self.tm.abort_request(rid=rid)
            elif op == "stop":
                for t in list(self.tasks):
                    t.cancel()
                channel.send(self.writer, {"t": "reply", "id": msg["id"], "value": None})
                await self.writer.drain()
                return
            else:
                self._spawn(self._call(msg))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- generation ----------------------------------------------------------------------
    async def _generate(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        fin = None
        try:
            stream = await self.engine.async_generate(
                input_ids=msg["input_ids"],
                sampling_params=msg["sampling"],
                return_logprob=True,
                stream=True,
                rid=rid,
                lora_path=msg.get("lora"),
            )
            async for chunk in stream:
                meta = chunk["meta_info"]
                reason = meta.get("finish_reason")
                fin = reason["type"] if reason else None
                # incremental_streaming_output: each piece holds only the new tokens and
                # their log-probs (the sampled token's, after temperature scaling)
                ids = list(chunk["output_ids"])
                lps = [float(t[0]) for t in meta["output_token_logprobs"]]
                channel.send(
                    self.writer,
                    {"t": "out", "rid": rid, "ids": ids, "lps": lps, "fin": fin, "done": False},
                )
                if fin is None and rid in self.aborted:
                    # an abort that came before SGLang registered the request was a no-op
                    self.tm.abort_request(rid=rid)
                await self.writer.drain()
            channel.send(
                self.writer,
                {"t": "out", "rid": rid, "ids": [], "lps": [], "fin": fin, "done": True},
            )
        except Exception as e:  # a bad request fails that request only
            channel.send(
                self.writer,
                {
                    "t": "out",
                    "rid": rid,
                    "ids": [],
                    "lps": [],
                    "fin": fin,
                    "done": True,
                    "error": f"{type(e).__name__}: {e}",
                },
            )
        finally:
            self.aborted.discard(rid)

    # -- calls ---------------------------------------------------------------------------
    async def _call(self, msg: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"t": "reply", "id": msg["id"]}
        try:
            reply["value"] = await getattr(self, f"_op_{msg['op']}")(**msg.get("args", {}))
        except Exception as e:  # the replica raises it
            reply["error"] = f"{type(e).__name__}: {e}"
        channel.send(self.writer, reply)
        await self.writer.drain()

    async def _op_score(self, input_ids: list[int], start: int) -> list[float]:
        """``RolloutEngine.score``: the input log-probs of ``input_ids[start:]`` (each given
        the tokens before it; raw logits, temperature 1), one token generated and dropped.
        ``logprob_start_len`` 0 keeps SGLang from serving the positions from its radix cache
        without logits."""
        out = await self.engine.async_generate(
            input_ids=input_ids,
            sampling_params={"max_new_tokens": 1, "temperature": 1.0},
            return_logprob=True,
            logprob_start_len=0,
        )
        got = out["meta_info"]["input_token_logprobs"]  # (logprob, token id, text) each
        skip = len(got) - len(input_ids)  # 0: position 0 is listed (logprob None); -1: not
        if skip not in (0, -1):
            raise RuntimeError(f"{len(got)} input log-probs for {len(input_ids)} tokens")
        rows = got[start + skip :]
        for (_, tid, *_), want in zip(rows, input_ids[start:], strict=True):
            if tid is not None and int(tid) != want:
                raise RuntimeError(f"input log-prob of token {tid}, expected {want}")
        return [float(lp) for lp, *_ in rows]

    async def _op_stats(self) -> dict[str, int] | None:
        loads = await self.tm.get_loads()
        if not loads:
            return None
        s = loads[0]
        return {
            "running": int(s.num_running_reqs),
            "waiting": int(s.num_waiting_reqs),
            "used": int(s.num_used_tokens),
            "capacity": int(s.max_total_num_tokens),
        }

    async def _op_load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` as adapter ``name`` (requests name it)."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        out = await self.tm.load_lora_adapter(
            LoadLoRAAdapterReqInput(lora_name=name, lora_path=path), None
        )
        if not out.success:
            raise RuntimeError(f"load_lora_adapter {name}: {out.error_message}")

    async def _op_unload_lora(self, name: str) -> None:
        """Unload adapter ``name``; SGLang waits until no request running with it is left."""
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        out = await self.tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)
        if not out.success:
            raise RuntimeError(f"unload_lora_adapter {name}: {out.error_message}")

    async def _op_update(self, ref: dict[str, Any]) -> None:
        """Load the version ``ref`` names (``loader``) between SGLang's begin/end of a weight
        update, then flush the prefix cache: its KV entries came from the old weights."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        ok, message = await self.tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise RuntimeError(f"begin_weight_update: {message}")
        try:
            # one serialised copy per TP rank, as SGLang's Engine does (a shared tensor's
            # handle is consumed by the rank that opens it)
            tp = int(self.engine.server_args.tp_size)
            per_rank = [MultiprocessingSerializer.serialize(loader.encode(ref)) for _ in range(tp)]
            req = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=per_rank,
                load_format=loader.LOAD_FORMAT,
                flush_cache=False,
            )
            ok, message = await self.tm.update_weights_from_tensor(req, None)
            if not ok:
                raise RuntimeError(f"update_weights_from_tensor: {message}")
        finally:
            end_ok, end_message = await self.tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not end_ok:
            raise RuntimeError(f"end_weight_update: {end_message}")
        # The scheduler refuses to flush while requests are still being torn down (an
        # aborted request's last step): retry briefly.
        for _ in range(200):
            result = await self.tm.flush_cache()
            if result.success:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"flush_cache after the weight update failed: {result.message}")


def _name_instance(instance_id: str, snapshot: str) -> None:
    """Make the SGLang engine about to start use the replica's ``instance_id`` (SGLang draws
    a random one in ``PortArgs.init_new``), so the replica knows the name of SGLang's
    load-snapshot file (``snapshot``) before SGLang creates it, and removes it however the
    start ends (the host killed half-way leaves it: nothing of SGLang unlinks it then).
    Refuses to start if SGLang would name that file otherwise than the replica expects."""
    from sglang.srt.managers.load_snapshot import shm_path_for
    from sglang.srt.server_args import PortArgs

    if shm_path_for(instance_id) != snapshot:
        raise RuntimeError(
            f"this SGLang names its load snapshot {shm_path_for(instance_id)}, not {snapshot}: "
            "laminar_sglang.engine.snapshot_path must follow "
            "sglang.srt.managers.load_snapshot.shm_path_for"
        )
    made = PortArgs.init_new

    def init_new(*args: Any, **kwargs: Any) -> Any:
        port_args = made(*args, **kwargs)
        port_args.instance_id = instance_id
        return port_args

    PortArgs.init_new = staticmethod(init_new)  # type: ignore[method-assign]


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.set_inheritable(False)  # SGLang's children must not hold the replica's channel open
    asyncio.run(_Host(sock).run())


def _semaphores() -> set[str]:
    """The named semaphores multiprocessing has in ``/dev/shm`` now."""
    return {str(p) for p in Path("/dev/shm").glob("sem.mp-*")}


if __name__ == "__main__":  # SGLang's children are spawned: they re-import this as __mp_main__
    main()

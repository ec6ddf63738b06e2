"""A relay in its own process, driven over a pipe: what real transports run between.

``RelayProcess`` spawns a process hosting one ``relay.server.RelayServer`` (its
``NodeRelay``, its transport endpoint, optionally the node's shared-memory store) and is the
driver's ``RemoteRelay`` for it, so the ``RelayTier`` drives it exactly like an in-process
relay. The control channel is a ``multiprocessing`` pipe carrying small RPCs (the manifest,
version numbers, ranks); bucket bytes only ever travel on the transport.

A process that exits (crash, ``kill``) fails every pending call with ``RelayDied`` at once and
reports ``is_alive() == False``, which is how the tier notices a dead relay. The Ray runtime
hosts the same server in an actor instead (``runtime.relay_actor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from laminar_core.interfaces import WeightTransport
from laminar_core.net import settle
from laminar_core.relay.protocol import RelayDied
from laminar_core.relay.remote import RemoteRelay
from laminar_core.relay.server import RelayServer

log = logging.getLogger(__name__)

__all__ = ["RelayDied", "RelayProcess"]


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _serve(conn: Any, spec: dict[str, Any]) -> None:
    """Child entry point: host one relay and answer RPCs until ``close``."""
    os.environ.update(spec.get("env") or {})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=spec.get("log_level", logging.WARNING))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        transport: WeightTransport = spec["transport_factory"]()
        server = RelayServer(
            spec["relay_id"],
            spec["node"],
            spec["rank"],
            transport,
            shm_root=spec.get("shm_dir"),
            die_at=spec.get("die_at"),
        )
        stop = asyncio.Event()
        send_lock = threading.Lock()

        def reply(msg: tuple) -> None:
            with send_lock:
                try:
                    conn.send(msg)
                except (OSError, EOFError):
                    stop.set()

        async def handle(rid: int, method: str, args: tuple) -> None:
            try:
                reply((rid, True, await server.call(method, *args)))
            except BaseException as e:
                reply((rid, False, _picklable(e)))
            if method == "close":
                stop.set()

        running: set[asyncio.Future] = set()  # held: the loop keeps only weak references

        def start(rid: int, method: str, args: tuple) -> None:
            task = asyncio.ensure_future(handle(rid, method, args))
            running.add(task)
            task.add_done_callback(running.discard)

        def reader() -> None:
            while True:
                try:
                    rid, method, args = conn.recv()
                except (EOFError, OSError):
                    loop.call_soon_threadsafe(stop.set)
                    return
                loop.call_soon_threadsafe(start, rid, method, args)

        threading.Thread(target=reader, daemon=True).start()
        await stop.wait()

    asyncio.run(main())
    os._exit(0)  # skip interpreter teardown of transport threads


class RelayProcess(RemoteRelay):
    """Driver-side handle to a relay hosted in a spawned process (see module docstring).

    ``transport_factory`` must be picklable (a class, or ``functools.partial`` of one with its
    options): the child builds its own endpoint from it.
    """

    _ctx = mp.get_context("spawn")

    def __init__(
        self,
        relay_id: int,
        node: int,
        rank: int,
        transport_factory: Callable[[], WeightTransport],
        *,
        shm_dir: str | None = None,
        die_at: tuple[int, int] | None = None,
        env: dict[str, str] | None = None,
        log_level: int = logging.WARNING,
    ) -> None:
        super().__init__(relay_id, node, shm_dir)
        self.rank = rank
        parent, child = self._ctx.Pipe()
        spec = {
            "relay_id": relay_id,
            "node": node,
            "rank": rank,
            "transport_factory": transport_factory,
            "shm_dir": shm_dir,
            "die_at": die_at,
            "env": env,
            "log_level": log_level,
        }
        self._conn = parent
        self._proc = self._ctx.Process(
            target=_serve, args=(child, spec), daemon=True, name=f"laminar-relay-{relay_id}"
        )
        self._proc.start()
        child.close()
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._reader, daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _alive(self) -> bool:
        return self._proc.is_alive()

    def _reader(self) -> None:
        while True:
            try:
                rid, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                entry = self._pending.pop(rid, None)
            if entry is not None:
                loop, fut = entry
                loop.call_soon_threadsafe(settle, fut, ok, value)
        self._died(f"process {self._proc.pid} exited")
        with self._lock:
            pending, self._pending = self._pending, {}
        err = RelayDied(f"relay {self.relay_id} (pid {self._proc.pid}) died")
        for loop, fut in pending.values():
            loop.call_soon_threadsafe(settle, fut, False, err)

    async def _call(self, method: str, *args: Any) -> Any:
        self._check()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = next(self._ids)
        with self._lock:
            self._pending[rid] = (loop, fut)
        try:
            self._conn.send((rid, method, args))
        except (OSError, EOFError, BrokenPipeError) as e:
            with self._lock:
                self._pending.pop(rid, None)
            self._died(e)
            raise RelayDied(f"relay {self.relay_id} is unreachable: {e}") from e
        return await fut

    async def close(self, timeout_s: float = 10.0) -> None:
        """Close the transport in the child and wait for it to exit (kill it if it hangs)."""
        self._closed = True
        if self.is_alive():
            with contextlib.suppress(TimeoutError, RelayDied):
                await asyncio.wait_for(self._call("close"), timeout_s)
        await asyncio.to_thread(self._proc.join, timeout_s)
        if self._proc.is_alive():
            self.kill()

    def kill(self) -> None:
        """SIGKILL the relay process (a crash, for fault tests)."""
        if self._proc.pid is not None and self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(10)
        self._died("killed")

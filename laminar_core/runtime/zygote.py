"""A per-node zygote: a plain Python process that imports the engines' modules once and forks
the processes that host them (``runtime.zygote``).

Why: Ray starts every actor as a fresh ``python default_worker.py`` and cannot fork workers
from a template (and forking a Ray worker, with its gRPC threads, is unsafe). On a small CPU
machine most of a run's start-up is every trainer rank and every replica importing torch,
transformers and vLLM again (~9 CPU s per vLLM replica, ~3 per trainer rank). So the driver
starts this process for its own node at the start of a run (``start_zygote``); it imports
the union of the engine factories' ``preload`` modules, then serves fork requests on a unix
socket. A Ray actor (``runtime.hosts``) that may use it stays thin: it asks the zygote for a
child (``Forked.open``) that builds the very same host object and serves its method calls
over the connection the actor opened; the actor forwards each call there.

Protocol (one connection per child, on the zygote's socket): the actor sends its stdout and
stderr with ``socket.send_fds``, then one framed request ``{target, args, kwargs, env, cwd,
kind, engine, name}``. The zygote forks; the child answers ``("ready", pid)`` once it has
built ``target(*args, **kwargs)`` (or ``("error", exception)``; ``("declined", reason)`` comes
from the zygote itself when it cannot fork safely, ``("optout", reason)`` when the engine
declares no ``preload``). Then the
actor sends ``(id, method, args, kwargs)`` and the child answers ``(id, ok, result or
exception)``, concurrently (calls are multiplexed by id). Frames are 8-byte lengths and
pickles.

Lifetimes: the child kills its process group (itself and whatever it started) as soon as
the connection reaches EOF, whatever it is doing (a reader thread waits on it), so an actor
killed with ``kill -9`` leaves nothing; the actor exits as soon as its child's connection
closes (``os._exit``), so Ray reports the actor dead and the run's restart path runs. The
zygote dies with its parent (``PR_SET_PDEATHSIG``), its children with it, and ``close``
removes the socket. The zygote stays single-threaded (checked before every fork, from
``/proc/self/task``) and freezes its heap before forking (``gc.freeze``): children share the
imported pages copy-on-write and their collector never walks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import inspect
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from laminar_core.net import settle

log = logging.getLogger(__name__)

_LEN = struct.Struct("!Q")
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
# what every host the zygote forks imports, whatever the engine (core's own actor code)
CORE_PRELOAD = (
    "laminar_core.interfaces",
    "laminar_core.plugins",
    "laminar_core.runtime.hosts",
    "laminar_core.runtime.resolve",
    "psutil",
    "yaml",
)


class ZygoteUnavailable(RuntimeError):
    """The zygote cannot fork this host (not running, declined, not safe to fork): the
    actor builds its host in its own process instead, as without a zygote. ``by_design``:
    the engine declares no ``preload`` (nothing to say in the log)."""

    def __init__(self, reason: str, by_design: bool = False) -> None:
        super().__init__(reason)
        self.by_design = by_design


# --- framing ---------------------------------------------------------------------------------


def _send(sock: socket.socket, obj: Any, lock: threading.Lock | None = None) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if lock is None:
        sock.sendall(_LEN.pack(len(data)) + data)
        return
    with lock:
        sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    """The next framed object; ``EOFError`` when the peer closed the connection."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        raise EOFError("connection closed")
    body = _recv_exact(sock, _LEN.unpack(head)[0])
    if body is None:
        raise EOFError("connection closed")
    return pickle.loads(body)


def _picklable_error(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (its type is kept for the caller), else a
    ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _prctl(option: int, arg: Any) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except Exception:  # not Linux: lifetimes then rest on the connections alone
        pass


def _set_name(name: str) -> None:
    """The process's name (``/proc/PID/comm``, what ``ps -o comm`` and ``psutil`` show):
    a forked child's command line is the zygote's, its name says which host it is."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


# --- the driver's side ---------------------------------------------------------------------


class Zygote:
    """The driver's handle on a zygote process: ``path`` is its socket; ``close`` ends it
    (and the children it still has) and removes the socket. Idempotent."""

    def __init__(self, proc: subprocess.Popen, path: str, workdir: str) -> None:
        self.proc, self.path, self._workdir = proc, path, workdir

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # its SIGTERM handler kills its children's groups first
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in (self.path, self._workdir):
            with contextlib.suppress(OSError):
                os.rmdir(p) if p == self._workdir else os.unlink(p)


def start_zygote(engines: Iterable[tuple[str, str]], env: dict[str, str] | None = None) -> Zygote:
    """Start a zygote serving ``engines`` (``(kind, engine name)`` pairs: ``("rollout",
    "vllm")``); returns at once (it imports while the caller goes on; requests wait for it).
    ``env``: variables set in its environment (and so its children's, before each child
    takes its actor's own)."""
    workdir = tempfile.mkdtemp(prefix="laminar-zygote-")
    path = os.path.join(workdir, "sock")
    args = [sys.executable, "-m", "laminar_core.runtime.zygote", path, str(os.getpid())]
    args += [f"{kind}={name}" for kind, name in engines]
    proc = subprocess.Popen(
        args,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # the terminal's Ctrl-C is the driver's to handle
    )
    return Zygote(proc, path, workdir)


# --- the zygote process ------------------------------------------------------------------------


def preload_modules(engines: Iterable[tuple[str, str]]) -> dict[tuple[str, str], tuple[str, ...]]:
    """Each engine's ``preload`` (``RolloutEngine.preload`` / ``TrainerEngine.preload``):
    the modules its process imports; an engine that declares none is not forked here."""
    from laminar_core.plugins import default_manager

    out = {}
    for kind, name in engines:
        try:
            factory = default_manager().get(kind, name)
        except Exception as e:  # the actor will say what is wrong, in its own process
            log.warning("zygote: %s engine %r not preloaded: %s", kind, name, e)
            continue
        mods = tuple(getattr(factory, "preload", ()) or ())
        if mods:
            out[(kind, name)] = mods
    return out


def serve(path: str, parent: int, engines: list[tuple[str, str]]) -> None:
    """The zygote's main: bind ``path``, import what ``engines`` preload, fork on request
    until SIGTERM or ``parent`` goes."""
    # SIGTERM, not SIGKILL: ``stop`` then kills its children and removes its socket
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the driver went before the line above took effect
        return
    _set_name("laminar-zygote")
    children: set[int] = set()

    def stop(*_: Any) -> None:
        for pid in children:  # each child leads its own process group
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        for pid in children:  # reaped here: orphaned, they would linger as zombies
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
        for remove in (os.unlink, os.rmdir):  # the socket, then its private directory
            with contextlib.suppress(OSError):
                remove(path if remove is os.unlink else os.path.dirname(path))
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when this ends
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # first: actors may connect while the imports run (they queue)
    listener.listen(64)
    gc.disable()  # the imports build ~a million objects for good: no collection passes
    served = preload_modules(engines)
    for mod in dict.fromkeys([*CORE_PRELOAD, *(m for ms in served.values() for m in ms)]):
        try:
            importlib.import_module(mod)
        except Exception as e:  # the child imports it again, and says so if it fails
            print(f"laminar zygote: could not preload {mod}: {e}", file=sys.stderr, flush=True)
    gc.freeze()
    listener.settimeout(1.0)
    while True:
        while children:  # reap
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        child: int | None = None
        try:
            child = _fork_one(conn, listener, served)
        except Exception as e:  # a request that broke off: the actor falls back
            print(f"laminar zygote: a fork request failed: {e}", file=sys.stderr, flush=True)
        finally:
            conn.close()
        if child:
            children.add(child)


def _fork_one(
    conn: socket.socket, listener: socket.socket, served: dict[tuple[str, str], tuple[str, ...]]
) -> int | None:
    _, fds, _, _ = socket.recv_fds(conn, 1, 2)
    try:
        request = _recv(conn)
        key = (request["kind"], request["engine"])
        if key not in served:
            _send(conn, ("optout", f"the {key[0]} engine '{key[1]}' declares no preload"))
            return None
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            reason = f"the zygote has {threads} threads (something it imported started them)"
            _send(conn, ("declined", f"cannot fork safely: {reason}"))
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            try:
                listener.close()
                _child(conn, fds, request)
            finally:
                os._exit(1)
        return pid
    finally:
        for fd in fds:
            os.close(fd)  # (the child closes its copies once it has them as 1 and 2)


# --- a forked child ----------------------------------------------------------------------------


def _child(conn: socket.socket, fds: list[int], request: dict) -> None:
    """Become the actor's host process: its output, environment and directory; build the
    host; serve its calls until the actor's connection closes."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # collection as in any process (the zygote's was off for its imports): the host holds it
    # off for its own start-up and turns it on after (``startup_gc``)
    gc.enable()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote went: so does this
    os.setpgid(0, 0)  # its own group: what it starts dies with it (``_watch``)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for target, fd in zip((1, 2), fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _set_name(request["name"])
    asyncio.run(_serve_host(conn, request))


def _watch(conn: socket.socket, loop: asyncio.AbstractEventLoop, handle: Any) -> None:
    """The reader thread: hand each call to the loop; at EOF (the actor is gone) kill this
    process's group at once, whatever the loop is doing."""
    try:
        while True:
            msg = _recv(conn)
            loop.call_soon_threadsafe(handle, msg)
    except BaseException:
        pass
    os.killpg(0, signal.SIGKILL)


async def _serve_host(conn: socket.socket, request: dict) -> None:
    loop = asyncio.get_running_loop()
    lock = threading.Lock()
    ready = asyncio.Event()
    box: dict[str, Any] = {}
    tasks: set[asyncio.Future] = set()

    async def run(msg: tuple) -> None:
        rid, method, args, kwargs = msg
        await ready.wait()
        try:
            result = getattr(box["host"], method)(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            reply = (rid, True, result)
        except BaseException as e:
            reply = (rid, False, _picklable_error(e))
        try:
            _send(conn, reply, lock)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _send(conn, (rid, False, RuntimeError(f"{method}: result not picklable: {e}")), lock)

    def handle(msg: tuple) -> None:
        task = asyncio.ensure_future(run(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    threading.Thread(target=_watch, args=(conn, loop, handle), daemon=True).start()
    module, _, qualname = request["target"].partition(":")
    try:
        cls = getattr(importlib.import_module(module), qualname)
        box["host"] = cls(*request["args"], **request["kwargs"])
    except BaseException as e:
        _send(conn, ("error", _picklable_error(e)), lock)
        # the actor reports it and goes; this process waits for that (EOF) in ``_watch``
        await asyncio.Event().wait()
    _send(conn, ("ready", os.getpid()), lock)
    ready.set()
    await asyncio.Event().wait()  # until the actor goes (``_watch`` ends the process)


# --- the actor's side -------------------------------------------------------------------------


class Forked:
    """An actor's connection to the child the zygote forked for it: ``call`` runs a method
    of the child's host and returns its result (or raises its exception). The actor process
    exits as soon as the child is gone."""

    def __init__(self, sock: socket.socket, pid: int, on_lost: Callable[[], Any] | None) -> None:
        self.sock, self.pid, self._on_lost = sock, pid, on_lost
        self._lock = threading.Lock()
        self._ids = iter(range(1 << 62))
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        threading.Thread(target=self._read, daemon=True, name="laminar-forked").start()

    @classmethod
    def open(
        cls,
        path: str,
        target: str,
        args: tuple,
        kwargs: dict,
        *,
        kind: str,
        engine: str,
        name: str,
        wait_s: float = 30.0,
        on_lost: Callable[[], Any] | None = None,
    ) -> Forked:
        """Ask the zygote at ``path`` for a child that builds ``target(*args, **kwargs)``
        (``"module:Class"``) and serves it; returns once it is built. Raises
        ``ZygoteUnavailable`` when there is no zygote there or it declines (the caller then
        builds the host itself), or the host's own exception when building it failed.
        ``on_lost``: what happens once the child is gone (its process group killed first);
        ``None``: this process exits (``os._exit(1)``), as an actor must."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + wait_s
        while True:  # the zygote binds its socket a moment after the driver starts it
            try:
                sock.connect(path)
                break
            except ConnectionRefusedError as e:  # its socket is there, it is not
                sock.close()
                raise ZygoteUnavailable(f"the zygote at {path} is gone: {e}") from None
            except FileNotFoundError as e:
                if time.monotonic() > deadline:
                    sock.close()
                    raise ZygoteUnavailable(f"no zygote at {path}: {e}") from None
                time.sleep(0.1)
        request = {
            "target": target,
            "args": args,
            "kwargs": kwargs,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "kind": kind,
            "engine": engine,
            "name": name,
        }
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            socket.send_fds(sock, [b"F"], [1, 2])
            _send(sock, request)
            reply = _recv(sock)
        except (OSError, EOFError) as e:
            sock.close()
            raise ZygoteUnavailable(f"the zygote broke off: {e}") from None
        if reply[0] == "ready":
            return cls(sock, reply[1], on_lost)
        sock.close()  # the child (if any) sees EOF and goes
        if reply[0] in ("declined", "optout"):
            raise ZygoteUnavailable(reply[1], by_design=reply[0] == "optout")
        raise reply[1]

    async def call(self, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = next(self._ids)
        self._pending[rid] = (loop, fut)
        try:
            _send(self.sock, (rid, method, args, kwargs or {}), self._lock)
            return await fut
        finally:
            self._pending.pop(rid, None)

    def _read(self) -> None:
        try:
            while True:
                rid, ok, value = _recv(self.sock)
                waiter = self._pending.get(rid)
                if waiter is not None:
                    loop, fut = waiter
                    loop.call_soon_threadsafe(settle, fut, ok, value)
        except BaseException:
            pass
        # the child is gone: so is this actor (Ray reports it dead; the run restarts it),
        # and whatever the child had started (its process group)
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)
        if self._on_lost is not None:
            for loop, fut in list(self._pending.values()):
                err = EOFError(f"the host process {self.pid} is gone")
                loop.call_soon_threadsafe(settle, fut, False, err)
            self._on_lost()
            return
        print(f"laminar: the host process {self.pid} is gone; this actor exits", flush=True)
        os._exit(1)


def main(argv: list[str]) -> None:
    path, parent, *specs = argv
    engines = [tuple(s.split("=", 1)) for s in specs]
    serve(path, int(parent), engines)  # type: ignore[arg-type]


if __name__ == "__main__":
    main(sys.argv[1:])

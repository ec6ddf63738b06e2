"""A warm pool of local sandboxes: one fresh, isolated process per run, started ahead.

Each of ``workers`` slots owns one uid (from :class:`~laminar_sandbox.isolation.UidLease`)
and keeps one sandbox warm: namespaces built, interpreter started, ``preload`` modules
imported, waiting for code on stdin. A run hands the code to the slot's warm sandbox, reads
its output (bounded), and enforces the wall clock: past ``timeout_s`` the sandbox is killed,
and with it its pid namespace, so everything the code started dies too. Then the slot checks
that no process of its uid survived (killing and counting any that did: ``stats
["strays_killed"]``), and warms the next sandbox in the background. Nothing is reused
between runs: no file, process or module state carries over.

Each slot's sandboxes live in the slot's cgroup v2 leaf where the host gives one
(``cgroup.py``: memory, processes and CPU as one budget), and run under the seccomp
allow-list (``seccomp.py``). What a run hit is decided from what the pool observed -- its own
clock and output count, the cgroup's OOM kills, the code's CPU time from ``wait4`` -- never
from an exit status the code could choose.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from laminar_core import EnvFailure, EnvUnavailable
from laminar_sandbox import isolation as iso
from laminar_sandbox import seccomp
from laminar_sandbox.cgroup import SandboxCgroups
from laminar_sandbox.result import CodeExecutor, RunResult, signal_name

log = logging.getLogger("laminar.sandbox")

_RUNNER = Path(__file__).with_name("runner.py").read_text()
# the runner's convention (kept in sync with runner.py, which must stay stdlib-only)
EXIT_SETUP = 121
#: CPU time within this of the limit, with the signal of the limit, is the limit
CPU_SLACK_S = 0.1

_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # threads count against RLIMIT_NPROC: one BLAS/OpenMP thread per process
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class Limits:
    """Per-run limits of a local sandbox (see the README for what each one bounds)."""

    memory_mb: int = 1024  # RLIMIT_AS of each process; the cgroup's memory.max when there is one
    cpu_s: int = 30  # RLIMIT_CPU of each process (the wall clock is the run's timeout_s)
    processes: int = 64  # RLIMIT_NPROC of the sandbox's uid (threads count); and pids.max
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file the code may write
    disk_mb: int = 64  # size of the private /tmp (and of /dev/shm, and of System V shm)
    files: int = 10_000  # inodes of the private /tmp (and of /dev/shm): files and directories
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 16384  # kept of stdout (its head) and of stderr (its tail)
    output_kill_bytes: int = 8 << 20  # printing more than this in all kills the run

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox limit {name} must be a positive integer, got {value!r}")


class _SpawnFailed(Exception):
    """A sandbox did not come up (the message is its one-line reason)."""


class _PreloadFailed(_SpawnFailed):
    """A ``preload`` module could not be imported inside the sandbox."""


class _Capture:
    """Keeps the head (or the tail) of a stream, at most ``limit`` bytes, counting it all."""

    def __init__(self, limit: int, tail: bool) -> None:
        self.limit, self.tail, self.total = limit, tail, 0
        self.buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.tail:
            self.buf += chunk
            del self.buf[: max(0, len(self.buf) - self.limit)]
        elif len(self.buf) < self.limit:
            self.buf += chunk[: self.limit - len(self.buf)]

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


@dataclass
class _Worker:
    """One started sandbox: the outer process (bwrap, setpriv/unshare, or the runner)."""

    proc: asyncio.subprocess.Process
    status: asyncio.StreamReader
    status_transport: asyncio.BaseTransport
    cgroup_kill: Callable[[], None] | None = None

    def kill(self) -> None:
        if self.proc.returncode is None:  # not reaped yet: the pid is still this process's
            iso.kill_tree(self.proc.pid)
        if self.cgroup_kill is not None:
            self.cgroup_kill()

    async def wait(self, timeout_s: float = 10.0) -> None:
        """Wait for the sandbox to end. ``Process.wait`` returns once the process exited
        and its pipes closed, i.e. once nothing in the sandbox holds them any more."""
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("python_sandbox: sandbox %d did not end; dropping it", self.proc.pid)
            transport = getattr(self.proc, "_transport", None)
            if transport is not None:
                transport.close()

    async def discard(self) -> None:
        self.kill()
        await self.wait()
        self.status_transport.close()


class _Slot:
    def __init__(self, index: int, uid: int | None) -> None:
        self.index = index
        self.uid = uid
        self.warm: asyncio.Future[_Worker] | None = None
        self.busy: _Worker | None = None


class SandboxPool(CodeExecutor):
    """Local sandboxes for model-written Python (see the module docstring).

    ``isolation``: ``auto`` | ``bwrap`` | ``namespaces`` | ``none`` (see ``isolation.py``);
    ``start`` refuses with ``IsolationUnavailable`` when it cannot be had. ``python``: the
    interpreter inside the sandbox (default: this one); its installation is made visible
    read-only, as are ``ro_paths``. ``preload``: modules imported while warming (one that
    cannot be imported there is an ``EnvUnavailable`` naming it). ``cgroup``: ``auto`` |
    ``required`` | ``off``, and ``cpus`` (cores, 0: no CPU budget): see ``cgroup.py``.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        isolation: str = "auto",
        workers: int = 4,
        python: str = "",
        preload: tuple[str, ...] | list[str] = (),
        ro_paths: tuple[str, ...] | list[str] = (),
        startup_timeout_s: float = 60.0,
        cgroup: str = "auto",
        cpus: float = 0.0,
    ) -> None:
        if isolation not in iso.ISOLATIONS:
            raise ValueError(
                f"isolation must be one of {', '.join(iso.ISOLATIONS)}, got {isolation!r}"
            )
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.limits = limits or Limits()
        self.requested = isolation
        self.isolation = ""
        self.workers = workers
        self.python = python or sys.executable
        self.preload = list(preload)
        self.ro_paths = list(ro_paths)
        self.startup_timeout_s = startup_timeout_s
        self.stats = {"runs": 0, "timeouts": 0, "strays_killed": 0, "respawns": 0}
        self._slots: list[_Slot] = []
        self._free: asyncio.Queue[_Slot] | None = None
        self._lease: iso.UidLease | None = None
        self._root_dir = ""
        self._layout = iso.Layout()
        self._host_pidns = os.readlink("/proc/self/ns/pid")
        self._tools: dict[str, str] = {}
        self._closed = False
        self.cgroups = SandboxCgroups(
            cgroup, self.limits.memory_mb << 20, self.limits.processes, cpus
        )
        self._seccomp = (seccomp.program(os.uname().machine) or b"").hex()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        mechanisms, reasons = iso.candidates(self.requested)
        python = shutil.which(self.python) or self.python
        if not os.access(python, os.X_OK):
            raise iso.IsolationUnavailable(f"sandbox python {self.python!r} is not executable")
        self.python = python
        for tool in ("bwrap", "unshare", "setpriv"):
            self._tools[tool] = shutil.which(tool) or tool
        dirs = await self._python_dirs()
        self._layout = iso.filesystem_view(
            dirs, self.ro_paths, self.limits.disk_mb << 20, self.limits.files
        )
        self.cgroups.setup(self.workers)
        if os.geteuid() == 0:
            self._lease = iso.UidLease(self.workers)
        uids = self._lease.uids if self._lease else [None] * self.workers
        self._slots = [_Slot(i, uid) for i, uid in enumerate(uids)]
        # namespaces: the (empty) mount point each sandbox builds its root on, privately;
        # none: the shared working directory (the code sees the host anyway)
        _remove_stale_dirs()
        self._root_dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        first: _Worker | None = None
        for mech in mechanisms:
            self.isolation = mech
            try:
                first = await self._spawn(self._slots[0])
                break
            except _PreloadFailed as e:  # not the isolation's doing: say what it is
                await self.close()
                raise EnvUnavailable(
                    f"python_sandbox: {e}; fix: install it into the sandbox's interpreter "
                    f"({self.python}: env.options.python), or drop it from env.options.preload"
                ) from None
            except _SpawnFailed as e:
                reasons.append(f"{mech}: {e}")
        if first is None:
            await self.close()
            raise iso.refusal(self.requested, reasons)
        if self.isolation == "none":
            os.chmod(self._root_dir, 0o1777)
            log.warning(
                "python_sandbox: isolation=none: model-written code runs WITHOUT namespaces, "
                "seeing this host's files and network (rlimits%s only)",
                " and a separate uid" if self._lease else "",
            )
        elif reasons:
            log.info("python_sandbox: using %s (%s)", self.isolation, "; ".join(reasons))
        self._slots[0].warm = _done(first)
        self._free = asyncio.Queue()
        for slot in self._slots:
            if slot.warm is None:
                slot.warm = asyncio.ensure_future(self._spawn(slot))
            self._free.put_nowait(slot)
        try:  # every slot must come up now, not at its first run
            await asyncio.gather(*(s.warm for s in self._slots if s.warm is not None))
        except _SpawnFailed as e:
            await self.close()
            raise EnvFailure(f"python_sandbox: a sandbox failed to start: {e}") from None

    async def close(self) -> None:
        self._closed = True
        for slot in self._slots:
            if slot.busy is not None:
                slot.busy.kill()
            if slot.warm is not None:
                slot.warm.cancel()
                with contextlib.suppress(BaseException):
                    await (await slot.warm).discard()
                slot.warm = None
        for slot in self._slots:
            await self._sweep(slot)
        self.cgroups.close()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._root_dir:
            if self.isolation == "none":
                shutil.rmtree(self._root_dir, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.rmdir(self._root_dir)
            self._root_dir = ""

    def busy_pids(self) -> list[int]:
        """Host pids of the sandboxes running code now (their outermost process)."""
        return [s.busy.proc.pid for s in self._slots if s.busy is not None]

    def uids(self) -> list[int]:
        """The sandbox uids this pool holds (empty when not running as root)."""
        return [s.uid for s in self._slots if s.uid is not None]

    # ------------------------------------------------------------------ running code

    async def run(self, code: str, timeout_s: float) -> RunResult:
        if self._closed or self._free is None:
            raise EnvFailure("python_sandbox: the sandbox pool is not running (start() it)")
        slot = await self._free.get()
        try:
            worker = await self._take(slot)
            slot.busy = worker
            try:
                return await self._execute(slot, worker, code, timeout_s)
            finally:
                slot.busy = None
                worker.kill()  # normally gone already; a cancelled run's is not
                await worker.discard()
                await self._sweep(slot)
                if not self._closed:
                    slot.warm = asyncio.ensure_future(self._spawn(slot))
        finally:
            self._free.put_nowait(slot)

    async def _take(self, slot: _Slot) -> _Worker:
        """The slot's warm sandbox, started afresh (once) if warming it failed."""
        warm = slot.warm
        assert warm is not None
        try:
            # shielded: a run cancelled while waiting leaves the sandbox warming for the next
            return await asyncio.shield(warm)
        except _SpawnFailed as e:
            log.warning("python_sandbox: a sandbox failed to warm (%s); starting another", e)
            self.stats["respawns"] += 1
        except asyncio.CancelledError:
            if not warm.cancelled():
                raise  # this run was cancelled, not the warming
        try:
            return await self._spawn(slot)
        except _SpawnFailed as e:
            raise EnvFailure(f"python_sandbox: cannot start a sandbox: {e}") from None

    async def _execute(
        self, slot: _Slot, worker: _Worker, code: str, timeout_s: float
    ) -> RunResult:
        lim = self.limits
        out, err = _Capture(lim.output_bytes, tail=False), _Capture(lim.output_bytes, tail=True)
        over = asyncio.Event()

        async def pump(stream: asyncio.StreamReader, cap: _Capture) -> None:
            while chunk := await stream.read(1 << 16):
                cap.add(chunk)
                if out.total + err.total > lim.output_kill_bytes and not over.is_set():
                    over.set()
                    worker.kill()

        proc = worker.proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        pumps = [
            asyncio.ensure_future(pump(proc.stdout, out)),
            asyncio.ensure_future(pump(proc.stderr, err)),
        ]
        events: list[dict] = []

        async def until_exit() -> None:
            # the runner reports "exit" once the code, and all it started, are gone
            while line := await worker.status.readline():
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
                if events and events[-1].get("event") == "exit":
                    return

        oom_before = self.cgroups.oom_kills(slot.index)
        started = time.monotonic()
        timed_out = False
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(code.encode())
                await proc.stdin.drain()
                proc.stdin.close()
            try:
                await asyncio.wait_for(until_exit(), timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
                worker.kill()
            wall = time.monotonic() - started
            if self.isolation == "none":
                # no pid namespace: what the code left running is found by its uid
                await self._sweep(slot, grace_s=0.2)
            await worker.wait()
            # the pipes reach EOF once every process in the sandbox is gone
            _, pending = await asyncio.wait(pumps, timeout=5.0)
            for task in pending:
                task.cancel()
        except BaseException:
            worker.kill()
            for task in pumps:
                task.cancel()
            raise
        self.stats["runs"] += 1
        self.stats["timeouts"] += timed_out
        oom_kills = self.cgroups.oom_kills(slot.index) - oom_before
        return self._classify(
            events, out, err, wall, timed_out, over.is_set(), timeout_s, oom_kills
        )

    def _classify(
        self,
        events: list[dict],
        out: _Capture,
        err: _Capture,
        wall: float,
        timed_out: bool,
        over: bool,
        timeout_s: float,
        oom_kills: int = 0,
    ) -> RunResult:
        """The run's outcome from what the pool observed: its clock (timeout), its count of
        the output (output limit), the cgroup's OOM kills (memory), the runner's report of
        how the code's process ended and its CPU time from ``wait4`` (CPU time: the limit's
        signal *and* the time used). An exit status is the code's to choose: it is only
        ever reported as one."""
        lim = self.limits
        started = any(e.get("event") == "started" for e in events)
        exit_ev = next((e for e in events if e.get("event") == "exit"), None)
        r = RunResult(
            "ok",
            stdout=out.text(),
            stderr=err.text(),
            stdout_bytes=out.total,
            stderr_bytes=err.total,
            wall_s=round(wall, 4),
        )
        if exit_ev is not None:
            r.exit_code, r.signal = exit_ev.get("exit_code"), exit_ev.get("signal")
            r.cpu_s = exit_ev.get("cpu_s")
        if over:
            r.status = "output_limit"
            r.message = (
                f"output limit exceeded: killed after printing {out.total + err.total} bytes "
                f"(limit {lim.output_kill_bytes})"
            )
        elif timed_out:
            r.status = "timeout"
            r.message = f"timed out after {timeout_s:g} s (wall-clock limit); the run was killed"
        elif oom_kills > 0:
            r.status = "memory"
            r.message = (
                f"memory limit exceeded: the sandbox reached its {lim.memory_mb} MB budget "
                f"and the kernel killed {oom_kills} of its processes"
            )
        elif exit_ev is None:
            r.status = "killed"
            r.message = "the sandbox was killed before the code finished (SIGKILL from outside)"
        elif r.signal is not None:
            cpu_hit = (
                r.signal in (signal.SIGXCPU, signal.SIGKILL)
                and (r.cpu_s or 0) >= lim.cpu_s - CPU_SLACK_S
            )
            r.status = "cpu_time" if cpu_hit else "killed"
            r.message = (
                f"CPU time limit exceeded ({lim.cpu_s} s)"
                if cpu_hit
                else f"killed by {signal_name(r.signal)}"
            )
        elif r.exit_code == EXIT_SETUP and not started:
            raise EnvFailure(
                f"python_sandbox: the sandbox could not be set up: {r.stderr.strip()[-500:]}"
            )
        elif r.exit_code != 0:
            r.status = "error"
        return r

    # ------------------------------------------------------------------ sandboxes

    async def _python_dirs(self) -> list[str]:
        """The interpreter's installation as the host names it: its prefixes (venv and
        base) and its executable's directory, symlinks unresolved (the sandbox recreates
        them)."""
        probe = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix]))"
        proc = await asyncio.create_subprocess_exec(
            self.python, "-I", "-c", probe, stdout=asyncio.subprocess.PIPE
        )
        stdout, _ = await proc.communicate()
        if proc.returncode != 0:
            raise iso.IsolationUnavailable(f"sandbox python {self.python!r} does not run")
        dirs = [*json.loads(stdout), os.path.dirname(os.path.abspath(self.python))]
        return list(dict.fromkeys(dirs))

    def _command(self, slot: _Slot, status_fd: int, config_fd: int) -> tuple[list[str], bytes]:
        """The sandbox's argv and its config (for the pipe ``config_fd``)."""
        cfg = {
            "status_fd": status_fd,
            "mode": self.isolation,
            "layout": self._layout.ops,
            "root": self._root_dir,
            "host_pidns": self._host_pidns,
            "uid": slot.uid,
            "gid": slot.uid,
            "workdir": "/tmp" if self.isolation != "none" else self._root_dir,
            "preload": self.preload,
            "seccomp": self._seccomp,
            "ipc_shm_bytes": self.limits.disk_mb << 20,
            "limits": {
                "memory_bytes": self.limits.memory_mb << 20,
                "cpu_s": self.limits.cpu_s,
                "processes": self.limits.processes,
                "file_bytes": self.limits.file_size_mb << 20,
                "open_files": self.limits.open_files,
            },
        }
        config = json.dumps(cfg).encode()
        if self.isolation == "bwrap":
            # bwrap --die-with-parent: the sandbox dies with this process
            cmd = iso.bwrap_command(self._layout, self.python, _RUNNER, config_fd)
            cmd = [self._tools["bwrap"], *cmd[1:]]
        else:
            cmd = iso.command(self.isolation, self.python, _RUNNER, config_fd)
            if cmd[0] == "unshare":
                cmd[0] = self._tools["unshare"]
            # setpriv --pdeathsig: the outer process dies with this process (and, through
            # unshare --kill-child, the sandbox's pid namespace with it)
            cmd = [self._tools["setpriv"], "--pdeathsig", "KILL", "--", *cmd]
        return self.cgroups.wrap(slot.index, cmd), config

    async def _spawn(self, slot: _Slot) -> _Worker:
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        config_read, config_write = os.pipe()
        try:  # the config goes on a pipe, never on a command line (/proc shows those)
            command, config = self._command(slot, write_fd, config_read)
            _fill_pipe(config_write, config)
        except BaseException:
            for fd in (read_fd, write_fd, config_read):
                os.close(fd)
            raise
        finally:
            os.close(config_write)
        create = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(write_fd, config_read),
                env=dict(_SANDBOX_ENV),
                start_new_session=True,
                cwd="/",
            )
        )
        try:
            # shielded: cancelled mid-way, asyncio would SIGKILL the outer process alone
            # and wait for pipes that the half-started sandbox below it keeps open
            proc = await asyncio.shield(create)
        except asyncio.CancelledError:
            os.close(read_fd)
            with contextlib.suppress(Exception):
                started = await create
                iso.kill_tree(started.pid)
                await asyncio.wait_for(started.wait(), 10.0)
            raise
        except OSError as e:
            os.close(read_fd)
            raise _SpawnFailed(f"cannot execute ({e})") from None
        finally:
            os.close(write_fd)
            os.close(config_read)
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
        )
        worker = _Worker(proc, reader, transport, lambda: self.cgroups.kill(slot.index))
        try:
            line = await asyncio.wait_for(reader.readline(), self.startup_timeout_s)
        except asyncio.TimeoutError:
            await worker.discard()
            raise _SpawnFailed(f"not ready within {self.startup_timeout_s:g} s") from None
        except BaseException:
            await worker.discard()
            raise
        event: dict = {}
        with contextlib.suppress(ValueError):
            event = json.loads(line) if line else {}
        if event.get("event") != "ready":
            worker.kill()
            assert proc.stderr is not None
            stderr = (await proc.stderr.read()).decode(errors="replace").strip()
            await worker.discard()
            step, error = event.get("step", ""), event.get("error", "")
            if step.startswith("preload "):
                raise _PreloadFailed(
                    f"preload module {step[len('preload ') :]!r} cannot be imported inside the "
                    f"sandbox ({error})"
                )
            if step:
                raise _SpawnFailed(f"{step} setup failed: {error}")
            last = stderr.splitlines()[-1] if stderr else "(no output)"
            raise _SpawnFailed(f"exited with status {proc.returncode}: {last}")
        return worker

    async def _sweep(self, slot: _Slot, grace_s: float = 2.0) -> None:
        """Make sure no process of the slot's uid is left; kill (and count) any that is
        still there after ``grace_s`` (a torn-down namespace takes a moment to exit)."""
        if slot.uid is None:
            return
        deadline = time.monotonic() + grace_s
        while (pids := await asyncio.to_thread(iso.processes_of, slot.uid)) and (
            time.monotonic() < deadline
        ):
            await asyncio.sleep(0.02)
        for pid in pids:
            log.warning("python_sandbox: killing stray sandbox process %d (uid %d)", pid, slot.uid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.stats["strays_killed"] += 1


_DIR_PREFIX = "laminar-sandbox-"


def _remove_stale_dirs() -> None:
    """Remove the directories of pools whose process is gone (a pool killed before close)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*-*"):
        pid = path.name[len(_DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def _fill_pipe(fd: int, data: bytes) -> None:
    """Write all of ``data`` into the (empty) pipe ``fd`` before its reader starts: grow the
    pipe to hold it (Linux allows 1 MiB unprivileged, more as root)."""
    if len(data) >= 65536:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, len(data) + 4096)
    os.write(fd, data)


def _done(worker: _Worker) -> asyncio.Future[_Worker]:
    fut: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
    fut.set_result(worker)
    return fut

"""Running an agent's program (``agent.command``) inside a sandbox: ``CommandSandbox``.

Core's ``CommandRunner`` starts an unmodified program per episode; with ``agent.sandbox``
it asks this module for the episode's argv and environment instead of running the program
on the host. Each episode gets:

* **Its own writable directory and nothing else writable.** A fresh host directory (the
  episode's scratch, owned by the episode's uid) is bound read-write at ``/home/agent``,
  its working directory and ``$HOME``; ``$LAMINAR_REWARD_FILE`` lies in it, so the host
  reads the reward after the program exits. The rest of the view is the code sandbox's
  (``isolation.filesystem_view``): the system directories, this interpreter's installation
  and ``ro_paths`` read-only, a private ``/tmp`` and ``/dev/shm`` (tmpfs of ``disk_mb``), a
  minimal ``/dev`` and a ``/proc`` of its own pid namespace. The run directory, the
  repository, ``$HOME`` and ``/etc`` are not there.
* **The gateway and nothing else on the network.** The program runs in a new network
  namespace with only its own loopback. The gateway listens on the host's ``127.0.0.1``,
  which that namespace cannot reach, so the episode's gateway port is carried over a unix
  socket: on the host, a forwarder per episode accepts on a socket file and connects to the
  gateway; the socket file is bound into the sandbox, where a small forwarder listening on
  the sandbox's own ``127.0.0.1:<the gateway's port>`` relays to it. The program sees
  ``OPENAI_BASE_URL=http://127.0.0.1:<port>/v1`` as it would unsandboxed. Why not keep the
  host's network namespace: that would give the program the host's loopback (every service
  on it: Ray, the relay, other sessions' forwarders) and the internet; the socket gives it
  one port, the gateway's, where its key admits it to its own session only.
* **Limits.** It runs as a uid of its own (leased from the code sandbox's range, reused by a
  later episode once no process of it is left), with
  ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_NPROC``
  (``processes``), ``RLIMIT_FSIZE`` (``file_size_mb``), ``RLIMIT_NOFILE`` (``open_files``)
  and no core dumps; the wall clock is ``agent.timeout_s`` (core kills the process group).
  bwrap's pid namespace init is in the episode's process group, so core's ``killpg`` takes
  the whole namespace with it (``setsid`` daemons included); ``--die-with-parent`` too.
* **A clean environment**: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``LAMINAR_ROW``,
  ``LAMINAR_REWARD_FILE``, ``HOME``, ``PATH``, ``LANG`` and ``env`` from the options, no
  variable of the host's.

Not applied here (the code sandbox's pool has them): the seccomp allow-list (it is measured
for CPython running model-written snippets; an agent program may be any program), the
cgroup budget and the ``hidepid`` ``/proc``. The scratch directory is on the host's disk:
its size is bounded per file (``file_size_mb``), not in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import sys
import tempfile
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from laminar_sandbox import isolation as iso

__all__ = ["CommandLimits", "CommandSandbox", "SandboxedEpisode"]

HOME = "/home/agent"
SOCKET = "/run/laminar-gateway.sock"

# Runs inside the sandbox as root (bwrap keeps root's capabilities): binds the gateway port
# on the sandbox's loopback, sets the limits, drops to the episode's uid, forks the relay to
# the gateway's unix socket and execs the program. Standard library only.
_LAUNCHER = r"""
import os, resource, socket, sys, threading
uid, port, sock_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
limits = [int(x) for x in sys.argv[4].split(",")]
argv = sys.argv[sys.argv.index("--") + 1:]
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(64)
for res, value in zip((resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NPROC,
                       resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE, resource.RLIMIT_CORE),
                      limits):
    resource.setrlimit(res, (value, value))
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
if os.fork() == 0:
    def pipe(a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    def serve(conn):
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(sock_path)
        except OSError:
            conn.close()
            return
        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
        pipe(conn, up)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
listener.close()
try:
    os.execvp(argv[0], argv)
except OSError as e:
    sys.exit(f"agent.command: cannot run {argv[0]} inside the sandbox ({e.strerror}); fix: "
             "put it and its files under agent.sandbox_options.ro_paths")
"""


@dataclass(frozen=True)
class CommandLimits:
    """``agent.sandbox_options``: the limits and view of a sandboxed agent program."""

    memory_mb: int = 2048  # RLIMIT_AS of each of its processes
    cpu_s: int = 600  # RLIMIT_CPU of each process (the wall clock is agent.timeout_s)
    processes: int = 64  # RLIMIT_NPROC of the episode's uid (threads count)
    file_size_mb: int = 64  # RLIMIT_FSIZE: the largest file it may write
    disk_mb: int = 256  # size of its private /tmp and /dev/shm (tmpfs, in RAM)
    open_files: int = 256  # RLIMIT_NOFILE
    ro_paths: list[str] = field(default_factory=list)  # host paths it may read (its code)
    env: dict[str, str] = field(default_factory=dict)  # more variables in its environment

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"agent.sandbox_options.{f.name} must be a positive integer, got {value!r}"
                )

    @classmethod
    def of(cls, options: dict[str, Any]) -> CommandLimits:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"agent.sandbox_options: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**options)


@dataclass
class SandboxedEpisode:
    """What ``CommandSandbox.episode`` hands core: the argv and environment to start (in a
    process group of its own) and the host path of the reward file."""

    argv: list[str]
    env: dict[str, str]
    reward_file: Path


class CommandSandbox:
    """Runs ``agent.command`` per episode in a bwrap sandbox (module docstring).

    Constructing it checks the host: ``IsolationUnavailable`` (one line: what is missing
    and the fix) where bwrap is not installed or the process is not root."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.limits = CommandLimits.of(dict(options or {}))
        fix = "or set agent.sandbox=false to run the command on the host"
        if shutil.which("bwrap") is None:
            raise iso.IsolationUnavailable(
                "agent.sandbox needs bubblewrap, which is not installed; fix: apt-get install "
                f"bubblewrap, {fix}"
            )
        if os.geteuid() != 0:
            raise iso.IsolationUnavailable(
                "agent.sandbox needs root on the host (it runs each episode as a uid of its "
                f"own); this process runs as uid {os.geteuid()}; fix: run as root in a "
                f"container, {fix}"
            )
        python_dirs = [sys.prefix, sys.base_prefix, os.path.dirname(sys.executable)]
        self.ro_paths = [os.path.abspath(p) for p in self.limits.ro_paths]
        self.layout = iso.filesystem_view(
            list(dict.fromkeys(python_dirs)), self.ro_paths, self.limits.disk_mb << 20
        )
        # uids leased for this process's lifetime and reused by later episodes once none of
        # their processes is left: a lease scans /proc per candidate uid, too slow per episode
        self._leases: list[iso.UidLease] = []
        self._free: list[int] = []
        self._root = ""  # the episodes' directories: made at the first, removed at exit

    def _episode_dir(self) -> str:
        """A new directory for one episode, under a root removed when this object is
        collected or the process exits, so a run stopped mid-episode (its cleanup never
        reached) leaves nothing in ``/tmp`` either."""
        if not self._root:
            self._root = tempfile.mkdtemp(prefix="laminar-agent-sandbox-")
            os.chmod(self._root, 0o711)
            weakref.finalize(self, shutil.rmtree, self._root, True)
        return tempfile.mkdtemp(dir=self._root)

    async def _take_uid(self) -> int:
        if self._free:
            return self._free.pop()
        lease = await asyncio.to_thread(iso.UidLease, 1)
        self._leases.append(lease)
        return lease.uids[0]

    async def _give_back(self, uid: int) -> None:
        """Kill what is left of ``uid`` (off the event loop: it reads ``/proc``); the uid is
        reused only once nothing of it is left."""

        def sweep() -> bool:
            for pid in iso.processes_of(uid):
                iso.kill_tree(pid)
            return not iso.processes_of(uid)

        if await asyncio.to_thread(sweep):
            self._free.append(uid)

    def _argv(self, command: Sequence[str]) -> list[str]:
        """``command`` as the driver would run it: its program found on the driver's
        ``PATH`` (``python`` is the driver's interpreter, visible inside), and relative paths
        to files under ``ro_paths`` made absolute (the working directory inside is the
        episode's scratch directory)."""
        program = command[0]
        if "/" not in program:
            program = shutil.which(program) or program
        out = [program]
        for arg in command[1:]:
            path = os.path.abspath(arg)
            if (
                not os.path.isabs(arg)
                and os.path.exists(arg)
                and any(path == r or path.startswith(r + "/") for r in self.ro_paths)
            ):
                arg = path
            out.append(arg)
        return out

    @contextlib.asynccontextmanager
    async def episode(
        self, command: Sequence[str], base_url: str, env: dict[str, str]
    ) -> AsyncIterator[SandboxedEpisode]:
        """One episode's sandbox: ``env`` holds the ``OPENAI_*``/``LAMINAR_*`` variables
        core sets (``LAMINAR_REWARD_FILE`` is replaced). On exit the relay stops, every
        process left of the episode's uid is killed and its directories are removed."""
        url = urlsplit(base_url)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        uid = await self._take_uid()
        top = self._episode_dir()
        server: asyncio.AbstractServer | None = None
        try:
            scratch = Path(top) / "home"
            scratch.mkdir()
            os.chown(scratch, uid, uid)
            os.chmod(scratch, 0o700)
            sock = Path(top) / "gateway.sock"
            server = await asyncio.start_unix_server(
                lambda r, w: _relay(r, w, host, port), path=str(sock)
            )
            os.chmod(sock, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IWGRP | 0o006)
            os.chmod(top, 0o711)  # the uid may pass through to the socket, not list it
            inner_url = urlunsplit((url.scheme, f"127.0.0.1:{port}", url.path, "", ""))
            inner_env = {
                "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8",
                **self.limits.env,
                **{k: v for k, v in env.items() if k.startswith(("OPENAI_", "LAMINAR_"))},
                "HOME": HOME,
                "OPENAI_BASE_URL": inner_url,
                "LAMINAR_REWARD_FILE": f"{HOME}/reward",
            }
            lim = self.limits
            limits = [
                lim.memory_mb << 20,
                lim.cpu_s,
                lim.processes,
                lim.file_size_mb << 20,
                lim.open_files,
                0,
            ]
            argv = [
                "bwrap",
                *("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"),
                *("--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent"),
                *self.layout.bwrap_args(),
                *("--proc", "/proc", "--dir", "/run", "--dir", "/home"),
                *("--bind", str(scratch), HOME, "--bind", str(sock), SOCKET),
                *("--remount-ro", "/", "--chdir", HOME, "--clearenv"),
                *[a for k, v in inner_env.items() for a in ("--setenv", k, v)],
                sys.executable,
                *("-I", "-S", "-c", _LAUNCHER, str(uid), str(port), SOCKET),
                ",".join(map(str, limits)),
                "--",
                *self._argv(command),
            ]
            yield SandboxedEpisode(argv, {"PATH": os.environ.get("PATH", "")}, scratch / "reward")
        finally:
            if server is not None:
                server.close()
            try:
                await self._give_back(uid)
            finally:
                shutil.rmtree(top, ignore_errors=True)


async def _relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int
) -> None:
    """One sandbox connection to the gateway's TCP port, bytes both ways."""
    try:
        up_r, up_w = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        return

    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                w.close()

    await asyncio.gather(pump(reader, up_w), pump(up_r, writer))

"""The supervisor that runs inside one sandbox (standard library only; trusted code).

The pool starts it as ``python -I -c <this file's source> <fd>``, inside bwrap's
namespaces, inside ``unshare(1)``'s (then it builds the filesystem view itself and
``pivot_root``\\s into it), or with no isolation; its config (JSON) is on the pipe ``fd``,
never on a command line. It runs as root *inside* the namespaces and never runs model code
itself:

1. (``namespaces``) builds the root: a small tmpfs holding read-only binds of the
   interpreter, the system libraries, a few device nodes and sized tmpfs ``/tmp`` and
   ``/dev/shm``; pivots into it; the host's other files are out of reach.
2. (both) gives each tmpfs its inode cap (``nr_inodes``), caps System V IPC in the sandbox's
   IPC namespace (``kernel.shm*``, ``msg*``, ``sem``; ``shm_rmid_forced``), and mounts
   ``/proc`` with ``hidepid=invisible,subset=pid``: the code sees its own processes and none
   of the host's ``/proc`` files.
3. imports the ``preload`` modules (so each run starts warm) and writes ``ready`` on the
   status pipe, then waits for the code on stdin (until EOF). A step that fails writes
   ``setup_failed`` naming the step and the error.
4. forks the child that runs the code: ``/dev/null`` as stdin, every other inherited file
   closed, the sandbox's own uid/gid (no root, no capabilities, ``no_new_privs``), rlimits
   on address space, CPU time, processes, file size, open files and core dumps, the seccomp
   filter the pool built (``laminar_sandbox.seccomp``), cwd ``/tmp``.
5. when the child exits: kills whatever it left running (every process in the sandbox's pid
   namespace), reaps, and writes ``exit`` with the status and the child's resource usage on
   the status pipe. The pool decides from these observations (and the cgroup's events), not
   from an exit status the code chose, whether a limit was hit.

Exit status convention of the child: ``EXIT_SETUP`` when the sandbox could not be set up
(nothing of the code ran).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import fcntl
import json
import os
import platform
import resource
import signal
import socket
import struct
import sys
import time
import traceback
import types
from collections.abc import Callable

EXIT_SETUP = 121
#: the code's file name in its tracebacks: what Python calls code read from stdin (not a
#: parser's tag, which the observation would escape; not "<string>", the runner's own name)
CODE_NAME = "<stdin>"

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            src.encode() if src else None,
            dst.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {src or fstype} on {dst}",
    )


def build_root(root: str, layout: list[list]) -> None:
    """Make ``root`` (an empty host directory) the sandbox's ``/`` with ``layout``'s mounts.

    Ops: ``["ro", src, dst]`` read-only bind, ``["dev", name]`` the host's ``/dev/name``,
    ``["symlink", target, dst]``, ``["tmpfs", dst, size_bytes, mode]``, ``["proc", dst]``,
    ``["dir", dst]``. Runs in a private mount namespace: the host sees none of it.
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for op in layout:
        kind = op[0]
        if kind == "ro":
            src, dst = op[1], root + op[2]
            if os.path.isdir(src):
                os.makedirs(dst, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                open(dst, "a").close()
            _mount(src, dst, None, MS_BIND)
            _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        elif kind == "dev":
            dst = f"{root}/dev/{op[1]}"
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
            _mount(f"/dev/{op[1]}", dst, None, MS_BIND)
            _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
        elif kind == "symlink":
            dst = root + op[2]
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(op[1], dst)
        elif kind == "tmpfs":
            dst = root + op[1]
            os.makedirs(dst, exist_ok=True)
            _mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, _tmpfs_options(op, mode=True))
        elif kind == "proc":  # mounted after the pivot (private_mounts)
            os.makedirs(root + op[1], exist_ok=True)
        elif kind == "dir":
            os.makedirs(root + op[1], exist_ok=True)
            os.chmod(root + op[1], 0o755)
        else:
            raise ValueError(f"unknown layout op {op!r}")
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(root)
    # pivot_root(".", ".") stacks the old root on the new one; detaching it leaves the new
    # root alone (no directory for the old root is needed)
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _tmpfs_options(op: list, mode: bool) -> str:
    options = f"size={op[2]}"
    if len(op) > 4 and op[4]:
        options += f",nr_inodes={op[4]}"
    return options + (f",mode={op[3]:o}" if mode else "")


#: System V IPC limits of the sandbox's IPC namespace (``/proc/sys/kernel``): segments and
#: queues are few and small, detached segments are freed (``shm_rmid_forced``); ``shmmax``
#: and ``shmall`` come from the config (the sandbox's disk size).
IPC_SYSCTLS = {
    "shmmni": "32",
    "shm_rmid_forced": "1",
    "msgmni": "16",
    "msgmax": "8192",
    "msgmnb": "16384",
    "sem": "32 512 32 16",
}


def loopback_up() -> None:
    """Bring up the network namespace's loopback (``unshare --net`` leaves it down; bwrap
    brings it up itself), so the code can talk to itself on 127.0.0.1 and nothing else."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, request))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def private_mounts(cfg: dict) -> None:
    """Inside the sandbox's namespaces, root on its ``/``: the tmpfs inode caps (bwrap's
    tmpfs are remounted with them), the IPC caps, and the restricted ``/proc``."""
    for op in cfg["layout"]:
        if op[0] == "tmpfs" and cfg["mode"] == "bwrap":
            _mount(None, op[1], None, MS_REMOUNT | MS_NOSUID | MS_NODEV, _tmpfs_options(op, False))
    proc = next((op[1] for op in cfg["layout"] if op[0] == "proc"), None)
    if proc is None:
        return
    # a full /proc for a moment: the IPC sysctls are the writing process's IPC namespace's
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    try:
        shm = cfg["ipc_shm_bytes"]
        sysctls = {**IPC_SYSCTLS, "shmmax": str(shm), "shmall": str(max(1, shm // 4096))}
        for name, value in sysctls.items():
            with open(f"{proc}/sys/kernel/{name}", "w") as f:
                f.write(value)
    finally:
        _check(_libc.umount2(proc.encode(), MNT_DETACH), f"umount {proc}")
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:  # Linux >= 5.8: no /proc file but the processes'
        _mount("proc", proc, "proc", flags, "hidepid=invisible,subset=pid")
    except OSError:
        _mount("proc", proc, "proc", flags, "hidepid=2")


def _install_seccomp(program: bytes) -> None:
    if not program:
        return
    buf = ctypes.create_string_buffer(program)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(
        _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
        "prctl(SECCOMP)",
    )


def _status(fd: int, **fields: object) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _child(code: bytes, cfg: dict) -> None:
    """Runs in the forked child: lock it down, then run the code. Never returns."""
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        if cfg["mode"] == "none":
            os.setsid()  # the supervisor kills the session's group when the code is done
        if cfg.get("uid") is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        lim = cfg["limits"]
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"], lim["processes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
        os.chdir(cfg["workdir"])
        os.umask(0o022)
        _install_seccomp(bytes.fromhex(cfg.get("seccomp", "")))
        # locked down: say so (an exit with EXIT_SETUP after this is the code's own), then
        # close every inherited file, the status pipe included
        _status(cfg["status_fd"], event="started")
        os.closerange(3, 1 << 16)
        sys.argv = [CODE_NAME]
        sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
    except BaseException:
        traceback.print_exc()
        os._exit(EXIT_SETUP)
    rc = 0
    try:
        program = compile(code, CODE_NAME, "exec")
        # a module of its own as __main__, so what it defines can be pickled by name
        # (multiprocessing, concurrent.futures); the runner keeps its own globals
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        main.__builtins__ = builtins
        exec(program, main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException as e:
        rc = 1
        _print_user_traceback(e)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(rc & 0xFF)


def _print_user_traceback(e: BaseException) -> None:
    try:  # drop this file's frames: the model sees its own code's traceback only
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != CODE_NAME:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
    except BaseException:
        os.write(2, f"{type(e).__name__}\n".encode())


def _kill_leftovers(cfg: dict, child: int) -> None:
    """Kill everything the code left running, then reap what is ours to reap."""
    if cfg["mode"] != "none" and os.readlink("/proc/self/ns/pid") != cfg["host_pidns"]:
        # In our own pid namespace, kill(-1) reaches exactly the sandbox's processes (never
        # its init, never the caller). Outside one it would reach the whole host: hence
        # the namespace check, and the process-group kill below for isolation 'none'.
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue


def _read_config(fd: int) -> dict:
    with os.fdopen(fd, "rb") as f:
        return json.loads(f.read())


def _setup(fd: int, step: str, what: Callable[[], object]) -> None:
    """Run one setup step; on failure say which on the status pipe, and exit."""
    try:
        what()
    except BaseException as e:
        _status(fd, event="setup_failed", step=step, error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        sys.exit(EXIT_SETUP)


def main() -> None:
    cfg = _read_config(int(sys.argv[1]))
    fd = cfg["status_fd"]
    if cfg["mode"] == "namespaces":
        _setup(fd, "isolation", lambda: build_root(cfg["root"], cfg["layout"]))
        _setup(fd, "isolation", loopback_up)
    if cfg["mode"] != "none":
        _setup(fd, "isolation", lambda: socket.sethostname("sandbox"))
        _setup(fd, "isolation", lambda: private_mounts(cfg))
    for name in cfg.get("preload", ()):
        _setup(fd, f"preload {name}", lambda name=name: __import__(name))
    _status(fd, event="ready", pid=os.getpid())
    code = sys.stdin.buffer.read()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(code, cfg)
    while True:
        try:
            _, status, usage = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
    wall = time.monotonic() - started
    _kill_leftovers(cfg, pid)
    _status(
        fd,
        event="exit",
        exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        cpu_s=round(usage.ru_utime + usage.ru_stime, 4),
        max_rss_kb=usage.ru_maxrss,
        wall_s=round(wall, 4),
    )


if __name__ == "__main__":
    main()

"""Model-written code against the host's memory, its kernel quotas and what it can learn about
the host, and against the outcome the pool reports: each attack is refused or capped, comes
back as an observation naming what happened, the pool serves the next run and nothing
survives.

Runs against each local isolation mechanism (``bwrap``, ``namespaces``): see conftest.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from laminar_core import EnvUnavailable

pytest.importorskip("laminar_sandbox")
from laminar_sandbox import IsolationUnavailable
from laminar_sandbox.isolation import descendants

Box = Any  # conftest.Sandbox: a started python_sandbox environment and its pool
NewBox = Callable[..., Any]  # conftest.new_sandbox


def observe(sandbox: Box, code: str, *said: str) -> str:
    """Run ``code`` as a model turn; each of ``said`` is in the observation (returned), and
    the pool served the next run with nothing of this one left."""
    observation = sandbox.step(code).observation
    for text in said:
        assert text in observation, observation
    sandbox.assert_recovered()
    return observation


def test_system_v_shared_memory_is_capped(sandbox: Box) -> None:
    """Segments nobody maps are no process's address space. A detached segment is freed
    (``shm_rmid_forced``), and those held are capped at the sandbox's disk size: 32 MB here,
    of 8 x 16 MB asked for each way."""
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p

class ShmInfo(ctypes.Structure):
    _fields_ = [("used_ids", ctypes.c_int), ("shm_tot", ctypes.c_ulong),
                ("rest", ctypes.c_ulong * 4)]

def held_mb():
    info = ShmInfo()
    libc.shmctl(0, 14, ctypes.byref(info))  # SHM_INFO: pages held by all segments
    return info.shm_tot * os.sysconf("SC_PAGE_SIZE") >> 20

for keep in (False, True):
    made = 0
    for _ in range(8):
        shmid = libc.shmget(0, 16 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if shmid < 0:
            print("REFUSED:", os.strerror(ctypes.get_errno()))
            break
        made += 1
        addr = libc.shmat(shmid, None, 0)
        ctypes.memset(addr, 1, 16 << 20)
        if not keep:
            libc.shmdt(ctypes.c_void_p(addr))
    print("ATTACHED" if keep else "DETACHED", made, "HELD_MB", held_mb())
"""
    seen = observe(sandbox, code, "REFUSED: No space left on device")
    detached = seen.split("DETACHED")[1].split()
    attached = seen.split("ATTACHED")[1].split()
    assert detached[2] == "0", seen  # 8 x 16 MB made, each freed when detached
    assert int(attached[0]) * 16 <= sandbox.options["disk_mb"], seen
    assert int(attached[2]) <= sandbox.options["disk_mb"], seen


def test_memfd_create_is_refused(sandbox: Box) -> None:
    """A memfd is RAM that no process maps (the issue's attack held 1.6 GB at 22 MB of RSS)
    and that only a cgroup would count: refused, with or without one."""
    code = """
import os
made = 0
try:
    for _ in range(8):  # 8 MB each (the file size limit), as many as wanted
        fd = os.memfd_create("x")
        made += 1
        os.write(fd, b"x" * ((8 << 20) - 1))
except OSError as e:
    print("REFUSED", e)
print("MADE", made)
"""
    observe(sandbox, code, "REFUSED [Errno 1] Operation not permitted", "MADE 0")


def test_tmp_runs_out_of_inodes_not_the_host(sandbox: Box) -> None:
    """Empty files cost no disk but kernel memory: /tmp holds at most ``files`` of them."""
    code = """
n = 0
try:
    while n < 50_000:
        open(f"/tmp/f{n}", "w").close()
        n += 1
except OSError as e:
    print("STOPPED", e)
print("CREATED", n)
"""
    seen = observe(sandbox, code, "No space left on device")
    assert int(seen.split("CREATED")[1].split()[0]) < 10_000, seen


def test_linux_aio_takes_no_host_quota(sandbox: Box) -> None:
    """``io_setup`` draws on a host-wide quota (``fs.aio-max-nr``): refused."""
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
nr = 206 if os.uname().machine == "x86_64" else 0
for _ in range(4):
    ctx = ctypes.c_ulong(0)
    ret = libc.syscall(nr, 4096, ctypes.byref(ctx))
    print("io_setup", "ALLOWED" if ret == 0 else os.strerror(ctypes.get_errno()))
"""
    before = Path("/proc/sys/fs/aio-nr").read_text()
    seen = observe(sandbox, code)
    assert seen.count("io_setup Operation not permitted") == 4, seen
    assert Path("/proc/sys/fs/aio-nr").read_text() == before or "ALLOWED" not in seen


def test_only_unix_and_ip_sockets(sandbox: Box) -> None:
    """vsock is not namespaced (the host's, or the hypervisor's, ports): refused, as are
    netlink and packet sockets; the network namespace's own sockets work."""
    code = """
import socket
for name, family, kind in [("vsock", 40, 1), ("netlink", 16, 3), ("packet", 17, 3),
                           ("alg", 38, 5), ("unix", 1, 1), ("inet", 2, 1), ("inet6", 10, 2)]:
    try:
        socket.socket(family, kind).close()
        print(name, "OPENED")
    except OSError as e:
        print(name, "REFUSED", e.errno)
"""
    refused = [f"{name} REFUSED 97" for name in ("vsock", "netlink", "packet", "alg")]
    observe(sandbox, code, *refused, *[f"{name} OPENED" for name in ("unix", "inet", "inet6")])


def test_a_syscall_off_the_allow_list_does_not_exist(sandbox: Box) -> None:
    """Not a deny-list: a call nobody listed (here ``personality``, harmless, and allowed
    to anyone by the kernel) is ENOSYS; what the code needs still works."""
    code = """
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = 135 if os.uname().machine == "x86_64" else 92
ret = libc.syscall(nr, 0xFFFFFFFF)
print("personality", "ALLOWED" if ret >= 0 else os.strerror(ctypes.get_errno()))
print(subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout)
"""
    observe(sandbox, code, "personality Function not implemented", "42")


def test_proc_shows_its_own_processes_and_nothing_of_the_host(sandbox: Box) -> None:
    code = """
import os
print("PIDS", sorted(p for p in os.listdir("/proc") if p.isdigit()), "ME", os.getpid())
for p in ["/proc/1/cmdline", "/proc/1/environ", "/proc/cmdline", "/proc/meminfo",
          "/proc/sys/kernel/hostname", "/proc/mounts", "/proc/self/status"]:
    print("SEEN" if os.path.exists(p) else "HIDDEN", p)
print("CGROUPS", {line.split(":", 2)[2] for line in open("/proc/self/cgroup").read().split()})
"""
    hidden = ["/proc/1/cmdline", "/proc/1/environ", "/proc/cmdline", "/proc/meminfo"]
    said = [*(f"HIDDEN {p}" for p in hidden), "SEEN /proc/self/status"]
    seen = observe(sandbox, code, *said, "CGROUPS {'/'}")  # its own cgroup ns: no host path
    me = seen.split("ME ")[1].split()[0]
    assert f"PIDS ['{me}'] ME" in seen, seen


def test_the_config_is_on_no_command_line(sandbox: Box) -> None:
    """The host paths, uids and limits of the sandbox reach its runner on a pipe: no process
    of the sandbox carries them in its argv, which ``/proc`` shows."""
    pool = sandbox.pool
    seen: list[str] = []

    async def look() -> None:
        task = asyncio.ensure_future(pool.run("import time\ntime.sleep(2)", 30.0))
        deadline = time.monotonic() + 20
        while not pool.busy_pids() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        for pid in pool.busy_pids():
            for p in [pid, *descendants(pid)]:
                try:
                    seen.append(Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))
                except OSError:
                    continue
        await task

    sandbox.run(look())
    assert len(seen) >= 2, seen  # the outer process and the runner (at least)
    # values only the config holds: the uid, the host's pid namespace, the limits in bytes
    secrets = [str(sandbox.uids[0]), pool._host_pidns, str(sandbox.options["memory_mb"] << 20)]
    for argv in seen:
        for secret in secrets:
            assert secret not in argv, f"{secret} on a command line: {argv[:300]}"
    sandbox.assert_recovered()


@pytest.mark.parametrize(
    ("code", "error", "said"),
    [
        ("import sys; sys.exit(120)", "exception", ""),  # was reported as "memory"
        ("import os; os._exit(121)", "exception", ""),
        ("raise MemoryError", "exception", "MemoryError"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGXCPU)", "killed", "killed by SIGXCPU"),
    ],
)
def test_an_outcome_the_code_chose_is_not_a_limit(
    sandbox: Box, code: str, error: str, said: str
) -> None:
    r = sandbox.step(code)
    assert r.info["error"] == error, r
    assert said in r.observation
    for claim in ("memory limit exceeded", "CPU time limit exceeded"):
        assert claim not in r.observation, r.observation
    sandbox.assert_recovered()


def test_memory_is_one_budget_where_the_host_gives_a_cgroup(
    sandbox: Box, new_sandbox: NewBox
) -> None:
    """With a cgroup: processes each within their address-space limit, together past the
    sandbox's budget, are stopped by the kernel, and the pool says so from the cgroup's
    events. Without one (this host may bind the memory controller to cgroup v1): the pool
    says why at start, and ``cgroup: required`` refuses, naming the fix."""
    pool = sandbox.pool
    if pool.cgroups.base:
        leaf = pool.cgroups.leaf(0)
        assert Path(f"{leaf}/memory.max").read_text().strip() == str(512 << 20)
        code = """
import os
for _ in range(4):
    if os.fork() == 0:
        x = bytearray(300 << 20)  # 300 MB each, under the 512 MB address-space limit
        os._exit(0)
for _ in range(4):
    os.wait()
print("survived")
"""
        r = sandbox.step(code)
        assert r.info["error"] == "memory", r
        assert "memory limit exceeded" in r.observation
    else:
        assert pool.cgroups.reason
        with pytest.raises(IsolationUnavailable, match=r"cgroup=required.*Fix: .*Delegate=yes"):
            new_sandbox(pool.isolation, cgroup="required", workers=1)
    sandbox.assert_recovered()


# ------------------------------------------------------------------------ the interpreter


@pytest.fixture(scope="module")
def venvs() -> Iterator[dict[str, str]]:
    """Interpreters where CI puts them: a venv under /tmp, and a symlink under /tmp to a
    venv elsewhere; each with a module only it has."""
    made = []
    found = {}
    for name, parent in (("venv under /tmp", "/tmp"), ("symlink under /tmp", "/var/tmp")):
        d = tempfile.mkdtemp(prefix="laminar-sandbox-venv-", dir=parent)
        made.append(d)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", d], check=True)
        (site,) = Path(d).glob("lib/python*/site-packages")
        (site / "laminar_probe.py").write_text("HERE = __file__\n")
        if parent != "/tmp":
            link = tempfile.mktemp(prefix="laminar-sandbox-link-", dir="/tmp")
            os.symlink(d, link)
            made.append(link)
            d = link
        found[name] = d
    yield found
    for d in made:
        if os.path.islink(d):
            os.unlink(d)
        else:
            shutil.rmtree(d)


@pytest.mark.parametrize("where", ["venv under /tmp", "symlink under /tmp"])
@pytest.mark.parametrize("isolation", ["bwrap", "namespaces"])
def test_an_interpreter_under_tmp_is_visible(
    isolation: str, where: str, venvs: dict[str, str], new_sandbox: NewBox
) -> None:
    """The private /tmp does not hide the interpreter: its venv is bound over it."""
    prefix = venvs[where]
    box = new_sandbox(
        isolation, python=f"{prefix}/bin/python", preload=["laminar_probe"], workers=1
    )
    r = box.step("import sys, laminar_probe\nprint(sys.prefix, laminar_probe.HERE)")
    assert r.observation.count(prefix) == 2 and "error" not in r.info, r
    box.assert_recovered()


@pytest.mark.parametrize("isolation", ["bwrap", "namespaces"])
def test_a_preload_module_that_is_missing_is_named(isolation: str, new_sandbox: NewBox) -> None:
    with pytest.raises(EnvUnavailable) as info:
        new_sandbox(isolation, preload=["laminar_no_such_module"], workers=1)
    message = str(info.value)
    assert "preload module 'laminar_no_such_module' cannot be imported" in message, message
    assert "ModuleNotFoundError" in message and "env.options.preload" in message
    assert "not available on this host" not in message  # not the isolation's doing

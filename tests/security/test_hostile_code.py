"""Model-written code that attacks its host: each attack is contained, comes back to the model
as an observation naming what happened, the pool recovers and nothing survives.

Runs against each local isolation mechanism (``bwrap``, ``namespaces``): see conftest.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("laminar_sandbox")
from laminar_sandbox.isolation import processes_of

Sandbox = Any  # conftest.Sandbox: a started python_sandbox environment and its pool


@pytest.fixture(scope="module")
def secrets() -> Iterator[dict[str, Path]]:
    """Files standing in for what a run must keep from the code: its checkpoints. Readable
    and writable by anyone, so only the sandbox's filesystem view keeps them out of reach
    (not file permissions against the sandbox's uid)."""
    run_dir = Path(tempfile.mkdtemp(prefix="laminar-security-run-"))
    ckpt = run_dir / "checkpoints" / "step_7" / "model.safetensors"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_text("SECRET-CHECKPOINT-BYTES")
    for p in (run_dir, ckpt.parent.parent, ckpt.parent, ckpt):
        p.chmod(0o777 if p.is_dir() else 0o666)
    yield {"checkpoint": ckpt, "run_dir": run_dir}
    shutil.rmtree(run_dir)


def test_reading_files_outside_its_directory_fails(sandbox: Sandbox, secrets: dict) -> None:
    targets = [
        secrets["checkpoint"],
        secrets["checkpoint"].parent,
        Path.home() / ".ssh",
        Path.home() / ".ssh" / "id_rsa",
        Path(__file__),  # the repository
        Path("/etc/shadow"),
        Path("/proc/1/environ"),  # the sandbox's own supervisor: root, not the code's uid
    ]
    code = f"""
import os
for p in {[str(t) for t in targets]!r}:
    try:
        if os.path.isdir(p):
            print("LISTED", p, os.listdir(p))
        else:
            with open(p, "rb") as f:
                print("READ", p, f.read(100))
    except OSError as e:
        print("DENIED", p, type(e).__name__)
print("ENV", sorted(os.environ))
"""
    r = sandbox.step(code)
    for t in targets:
        assert f"DENIED {t} " in r.observation, r.observation
    assert "SECRET" not in r.observation
    assert "LAMINAR_SANDBOX_TEST_TOKEN" not in r.observation  # the host's env stays out
    sandbox.assert_recovered()


def test_writing_outside_its_directory_fails(sandbox: Sandbox, secrets: dict) -> None:
    tag = uuid.uuid4().hex[:8]
    host_paths = [
        secrets["run_dir"] / f"pwned-{tag}",
        secrets["checkpoint"],  # overwrite the checkpoint
        Path.home() / f"pwned-{tag}",
        Path(f"/usr/lib/pwned-{tag}"),
        Path(f"/pwned-{tag}"),
    ]
    private = f"/tmp/pwned-{tag}"  # the code's own /tmp: writable, but not the host's
    code = f"""
for p in {[str(p) for p in host_paths]!r} + [{private!r}]:
    try:
        with open(p, "w") as f:
            f.write("pwned")
        print("WROTE", p)
    except OSError as e:
        print("DENIED", p, type(e).__name__)
"""
    r = sandbox.step(code)
    for p in host_paths:
        assert f"DENIED {p} " in r.observation, r.observation
    assert f"WROTE {private}" in r.observation
    assert secrets["checkpoint"].read_text() == "SECRET-CHECKPOINT-BYTES"
    for p in [*host_paths[:1], *host_paths[2:], Path(private)]:
        assert not p.exists(), f"{p} appeared on the host"
    sandbox.assert_recovered()


def _listener() -> tuple[socket.socket, list, threading.Thread]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    thread.stop = stop  # type: ignore[attr-defined]
    return server, accepted, thread


def test_no_network_to_the_host_or_beyond(sandbox: Sandbox) -> None:
    server, accepted, thread = _listener()
    port = server.getsockname()[1]
    try:
        code = f"""
import socket
for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("192.0.2.2", {port}), ("8.8.8.8", 443)]:
    try:
        socket.create_connection(addr, timeout=1).close()
        print("CONNECTED", addr)
    except OSError as e:
        print("NO", addr, e)
try:
    print("RESOLVED", socket.gethostbyname("pypi.org"))
except OSError as e:
    print("NO DNS", e)
"""
        r = sandbox.step(code)
        time.sleep(0.3)  # give a connection that got through time to be accepted
    finally:
        thread.stop.set()  # type: ignore[attr-defined]
        thread.join()
        server.close()
    assert "CONNECTED" not in r.observation and "RESOLVED" not in r.observation, r.observation
    assert r.observation.count("NO ") == 5, r.observation
    assert accepted == [], "the sandbox reached the host's loopback listener"
    sandbox.assert_recovered()


def test_kernel_doors_are_shut(sandbox: Sandbox) -> None:
    """No user namespace (the way to capabilities, and to much of the kernel's attack
    surface), no io_uring or bpf; threads and processes still work."""
    code = """
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
for name, call in [
    ("userns", lambda: libc.unshare(0x10000000)),
    ("mountns", lambda: libc.unshare(0x00020000)),
    ("io_uring", lambda: libc.syscall(425, 8, ctypes.create_string_buffer(120))),
    ("bpf", lambda: libc.syscall(321 if os.uname().machine == "x86_64" else 280, 0, 0, 0)),
]:
    ret = call()
    print(name, "ALLOWED" if ret >= 0 else os.strerror(ctypes.get_errno()))
t = threading.Thread(target=print, args=("thread ok",))
t.start()
t.join()
"""
    r = sandbox.step(code)
    assert "ALLOWED" not in r.observation, r.observation
    assert "userns Operation not permitted" in r.observation
    assert "thread ok" in r.observation
    sandbox.assert_recovered()


def test_fork_bomb_is_contained(sandbox: Sandbox) -> None:
    code = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    r = sandbox.step(code, timeout_s=sandbox.timeout_s)
    assert r.info["error"] == "timeout", r
    assert f"timed out after {sandbox.timeout_s:g} s" in r.observation
    sandbox.assert_recovered()


def test_a_20gb_allocation_fails_with_memory_error(sandbox: Sandbox) -> None:
    """The address-space limit makes it a MemoryError in the code: the code's exception,
    reported as one (a limit is named only when the pool saw it: see test_host_limits)."""
    r = sandbox.step("x = bytearray(20 * 1024**3)\nprint('allocated')")
    assert r.info["error"] == "exception", r
    assert "MemoryError" in r.observation and "allocated" not in r.observation
    sandbox.assert_recovered()


def test_infinite_loop_times_out(sandbox: Sandbox) -> None:
    r = sandbox.step("print('spinning', flush=True)\nwhile True:\n    pass", sandbox.timeout_s)
    assert r.info["error"] == "timeout", r
    assert "spinning" in r.observation  # what it printed before is kept
    assert "wall-clock limit" in r.observation
    sandbox.assert_recovered()


def test_killing_its_parent_and_everyone_fails(sandbox: Sandbox) -> None:
    code = """
import os
for target in (os.getppid(), 1):
    try:
        os.kill(target, 9)
        print("KILLED", target)
    except OSError as e:
        print("DENIED", target, type(e).__name__)
os.kill(-1, 9)  # every process it may signal: only its own, in its namespace
print("survived kill(-1)")
"""
    r = sandbox.step(code)
    assert "KILLED" not in r.observation, r.observation
    assert r.observation.count("DENIED") == 2, r.observation
    assert os.getpid() > 0  # (this process is alive: the test is still running)
    sandbox.assert_recovered()


def test_filling_the_disk_stops_at_its_quota(sandbox: Sandbox) -> None:
    code = """
import os
total = 0
try:
    for i in range(10_000):
        with open(f"/tmp/fill{i}", "wb") as f:
            for _ in range(7):
                f.write(b"x" * (1 << 20))
                total += 1 << 20
except OSError as e:
    print("STOPPED after", total >> 20, "MB:", e)
"""
    r = sandbox.step(code)
    assert "STOPPED after" in r.observation, r.observation
    assert "No space left on device" in r.observation
    mb = int(r.observation.split("STOPPED after")[1].split()[0])
    assert mb <= sandbox.options["disk_mb"]
    sandbox.assert_recovered()


def test_a_single_file_larger_than_the_limit_fails(sandbox: Sandbox) -> None:
    code = """
try:
    with open("/tmp/big", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
except OSError as e:
    print("STOPPED:", e)
"""
    r = sandbox.step(code)
    assert "File too large" in r.observation, r.observation
    sandbox.assert_recovered()


def test_printing_100mb_is_cut_short(sandbox: Sandbox) -> None:
    r = sandbox.step("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)")
    assert r.info["error"] == "output_limit", r
    assert "output limit exceeded" in r.observation
    assert "output truncated" in r.observation
    assert len(r.observation) < 3 * sandbox.options["output_bytes"]
    sandbox.assert_recovered()


@pytest.mark.parametrize("victim", ["outer", "code"])
def test_kill_9_of_a_sandbox_mid_call_is_an_observation(sandbox: Sandbox, victim: str) -> None:
    """SIGKILL from outside, by pid: the sandbox's outermost process (bwrap / unshare), or
    the process running the code."""
    pool = sandbox.pool
    result: dict = {}

    async def call() -> None:
        result["r"] = await sandbox.env.executor.run(
            "print('started', flush=True)\nimport time\ntime.sleep(60)", 30.0
        )

    async def kill_when_running() -> None:
        task = sandbox.loop.create_task(call())
        deadline = time.monotonic() + 20
        pid = None
        while pid is None and time.monotonic() < deadline:
            running = [p for uid in sandbox.uids for p in processes_of(uid)]
            if pool.busy_pids() and running:
                pid = pool.busy_pids()[0] if victim == "outer" else running[0]
            else:
                await asyncio.sleep(0.02)
        assert pid is not None, "the call never started"
        os.kill(pid, signal.SIGKILL)
        await task

    sandbox.run(kill_when_running())
    r = result["r"]
    assert r.status == "killed", r
    expected = "killed before the code finished" if victim == "outer" else "killed by SIGKILL"
    assert expected in r.message, r
    sandbox.assert_recovered()

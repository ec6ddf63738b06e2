"""``runtime.zygote``: host processes forked from a process that imported the engines' modules
once, and the lifetimes that tie each to its Ray actor.

The zygote here serves the FSDP trainer's engine (what it preloads: torch, transformers), and
the host it forks is ``laminar_core.testing.zygote_probe.ProbeHost``, built the way the
trainer's and the replicas' hosts are, without an engine's start-up cost. The full path
(vLLM replicas and FSDP ranks forked in a real run, killed by the chaos tests) runs in
``tests/chaos``, ``tests/test_weights_e2e.py`` and the Ray runtime's tests, which use the
zygote wherever ``runtime.zygote: auto`` turns it on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from laminar_core.testing import require_modules

require_modules("laminar_fsdp", what="zygote tests (the zygote serves the FSDP engine here)")
psutil = pytest.importorskip("psutil")

from laminar_core.runtime.zygote import Forked, ZygoteUnavailable, start_zygote
from laminar_core.testing.zygote_probe import ProbeError, ProbeHost

PROBE = "laminar_core.testing.zygote_probe:ProbeHost"
PRELOADED = ("torch", "transformers", "laminar_fsdp.engine")


@pytest.fixture(scope="module")
def zygote():
    z = start_zygote([("trainer", "fsdp")], {"OMP_NUM_THREADS": "1"})
    yield z
    z.close()
    assert z.proc.poll() is not None
    assert not os.path.exists(z.path) and not os.path.exists(os.path.dirname(z.path))


def _open(z, *args, engine: str = "fsdp", **kwargs) -> tuple[Forked, threading.Event]:
    lost = threading.Event()
    forked = Forked.open(
        z.path,
        PROBE,
        args,
        kwargs,
        kind="trainer",
        engine=engine,
        name="ProbeHost",
        on_lost=lost.set,
    )
    return forked, lost


def _gone(pid: int, within_s: float = 30.0) -> bool:
    """``pid`` has exited (a zombie has: it only waits for its parent to read its status)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def _children(z) -> list[int]:
    return [p.pid for p in psutil.Process(z.proc.pid).children()]


def _no_children_left(z, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while _children(z):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_forked_host_has_the_preloaded_modules_and_its_callers_process_state(
    zygote, capfd, monkeypatch, tmp_path
):
    monkeypatch.setenv("LAMINAR_PROBE", "from the caller")
    monkeypatch.chdir(tmp_path)
    forked, _ = _open(zygote, PRELOADED)

    async def calls():
        info = await forked.call("info")
        await forked.call("say", ("hello from the host",))
        with pytest.raises(ProbeError, match="as asked"):
            await forked.call("boom", ("as asked",))
        # concurrent calls, answered out of order, each to its own caller
        echoes = await asyncio.gather(
            *(forked.call("echo", (i,), {"delay_s": 0.5 - i / 10}) for i in range(5))
        )
        return info, echoes

    info, echoes = asyncio.run(calls())
    # built in a process that already had them: nothing imported again
    assert info["had"] == dict.fromkeys(PRELOADED, True)
    assert info["pid"] == forked.pid != os.getpid()
    assert info["env"]["LAMINAR_PROBE"] == "from the caller"
    assert info["cwd"] == str(tmp_path)
    assert echoes == list(range(5))
    assert "hello from the host" in capfd.readouterr().out  # its output is the caller's
    forked.sock.shutdown(socket.SHUT_RDWR)  # the caller goes: the host goes at once
    assert _gone(forked.pid)


def test_a_host_that_dies_fails_its_callers_calls(zygote):
    forked, lost = _open(zygote)

    async def pending():
        call = asyncio.ensure_future(forked.call("echo", (1,), {"delay_s": 60}))
        await asyncio.sleep(0.5)
        os.kill(forked.pid, signal.SIGKILL)
        with pytest.raises(EOFError):
            await call

    asyncio.run(pending())
    assert lost.wait(30)
    assert _gone(forked.pid)


def test_a_host_that_fails_to_build_raises_its_error_and_leaves_nothing(zygote):
    with pytest.raises(ProbeError, match="no such model"):
        _open(zygote, (), "no such model")
    assert _no_children_left(zygote)


def test_an_engine_that_declares_no_preload_is_not_forked(zygote):
    with pytest.raises(ZygoteUnavailable) as e:
        _open(zygote, engine="sim")
    assert e.value.by_design
    with pytest.raises(ZygoteUnavailable, match="no zygote"):
        Forked.open(
            os.path.join(os.path.dirname(zygote.path), "none"),
            PROBE,
            (),
            {},
            kind="trainer",
            engine="fsdp",
            name="ProbeHost",
            wait_s=0.5,
        )


def test_the_zygote_and_its_socket_go_with_the_driver(tmp_path):
    """A driver killed with ``kill -9`` takes its zygote (and the zygote's socket) along."""
    code = (
        "import sys, time; from laminar_core.runtime.zygote import start_zygote; "
        "z = start_zygote([]); print(z.proc.pid, z.path, flush=True); time.sleep(300)"
    )
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, path = driver.stdout.readline().split()
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(path)
    finally:
        driver.kill()
        driver.wait()
    assert _gone(int(pid))
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


# --- with Ray: a real actor, its forked host, ``kill -9`` -------------------------------------


@pytest.fixture(scope="module")
def ray_zygote(ray_cluster, zygote):
    ray = pytest.importorskip("ray")
    if ray_cluster is None:
        pytest.skip("Ray was started outside the test session's cluster")
    node = ray.get_runtime_context().get_node_id()
    return ray, ray.remote(ProbeHost).options(num_cpus=0), (zygote.path, node, "fsdp")


def test_killing_the_actor_kills_its_host_and_killing_the_host_kills_the_actor(ray_zygote, zygote):
    ray, Probe, spec = ray_zygote
    from ray.exceptions import RayActorError

    a = Probe.remote(PRELOADED, "", None, spec)
    host, actor = ray.get([a.pid.remote(), a.actor_pid.remote()], timeout=120)
    assert host != actor and host in _children(zygote)  # the engine's process is the fork
    assert ray.get(a.info.remote(), timeout=60)["had"] == dict.fromkeys(PRELOADED, True)
    os.kill(actor, signal.SIGKILL)
    assert _gone(host), "the host outlived its actor"

    b = Probe.remote((), "", None, spec)
    host, actor = ray.get([b.pid.remote(), b.actor_pid.remote()], timeout=120)
    os.kill(host, signal.SIGKILL)
    assert _gone(actor), "the actor outlived its host"
    with pytest.raises(RayActorError):  # Ray reports it dead: the run's restart path runs
        ray.get(b.echo.remote(1), timeout=60)
    assert _no_children_left(zygote)


def test_a_host_that_fails_to_build_in_the_fork_is_one_error_naming_it(ray_zygote, zygote):
    ray, Probe, spec = ray_zygote
    from ray.exceptions import RayActorError

    a = Probe.remote((), "model.path: no such model", None, spec)
    with pytest.raises(RayActorError, match=r"ProbeError: model\.path: no such model"):
        ray.get(a.node_id.remote(), timeout=120)
    assert _no_children_left(zygote)


def test_an_actor_on_another_node_builds_its_host_itself(ray_zygote):
    ray, Probe, (path, _, engine) = ray_zygote
    a = Probe.remote((), "", None, (path, "another-node", engine))
    try:
        assert ray.get(a.pid.remote(), timeout=120) == ray.get(a.actor_pid.remote())
    finally:
        ray.kill(a)

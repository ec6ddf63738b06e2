"""An actor's engine processes leave nothing in /dev/shm when Ray ends the actor
(``runtime.ray_calls.detach_resource_tracker``).

Ray starts each actor in a process group of its own; when the actor dies it kills that
group, and ``ray.kill`` kills the actor's child processes with it. Either way,
multiprocessing's resource tracker (a child of the actor) died too, and the named semaphores
a ``spawn`` child had been handed stayed in /dev/shm: what a killed or restarted vLLM replica
with its engine core in a process of its own left behind. Here: a process that stands for
the actor, a spawned child holding a semaphore as vLLM's engine core does, and ``kill -9``
of the group, or of the actor and its children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ACTOR = """
import multiprocessing as mp, sys, time
from laminar_core.runtime.ray_calls import detach_resource_tracker
print(detach_resource_tracker(), flush=True)
ctx = mp.get_context("spawn")
lock = ctx.Lock()  # a named semaphore, registered with the tracker
child = ctx.Process(target=time.sleep, args=(120,))  # holds it, as an engine process does
child.start()
print(lock._semlock.name, child.pid, flush=True)
time.sleep(120)
"""


def _gone(path: Path, pid: int, within_s: float = 20.0) -> tuple[bool, bool]:
    """Whether ``path`` and process ``pid`` are both gone, waiting up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not path.exists() and not psutil.pid_exists(pid):
            break
        time.sleep(0.2)
    return not path.exists(), not psutil.pid_exists(pid)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize("how", ["group", "children"])
def test_what_engine_processes_registered_goes_when_the_actor_is_killed(how: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    actor = subprocess.Popen(
        [sys.executable, "-c", ACTOR],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as Ray gives an actor
    )
    sem: Path | None = None
    try:
        tracker = int(actor.stdout.readline())
        name, child = actor.stdout.readline().split()
        sem = Path("/dev/shm") / f"sem{name.replace('/', '.')}"
        assert sem.exists()
        # the tracker is neither in the group Ray kills nor one of the actor's children
        assert os.getpgid(tracker) != actor.pid and os.getpgid(int(child)) == actor.pid
        assert tracker not in {p.pid for p in psutil.Process(actor.pid).children()}
        if how == "group":  # what Ray does to the group of an actor that died
            os.killpg(actor.pid, signal.SIGKILL)
        else:  # what ray.kill does: the actor and its child processes
            for p in [psutil.Process(actor.pid), *psutil.Process(actor.pid).children()]:
                p.kill()
        actor.wait(timeout=30)
        sem_gone, tracker_gone = _gone(sem, tracker)
        assert sem_gone, f"{sem} was left in /dev/shm"
        assert tracker_gone, "the resource tracker outlived every process it tracked"
    finally:
        if actor.poll() is None:
            os.killpg(actor.pid, signal.SIGKILL)
            actor.wait(timeout=30)
        if sem is not None and sem.exists():
            sem.unlink()


def test_an_already_running_tracker_is_left_alone():
    code = (
        "from multiprocessing import resource_tracker;"
        "resource_tracker.ensure_running();"
        "from laminar_core.runtime.ray_calls import detach_resource_tracker;"
        "print(detach_resource_tracker())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"

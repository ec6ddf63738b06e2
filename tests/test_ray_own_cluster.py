"""``laminar train`` on the Ray runtime starts a cluster of its own from a process that has
already imported Ray (the CLI imports it before the run is wired). Ray reads its
authentication mode at import, so a driver that changes it afterwards cannot talk to its own
cluster: the README's main command once failed this way while the tests, which share one
session cluster, passed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

SCRIPT = """
import ray  # imported first, as the CLI does
from laminar_core import load_config
from laminar_core.runtime.ray_run import init_ray

resolved = load_config(None, ["runtime.kind=ray"])
assert init_ray(resolved, 1.0) is True  # started a cluster of its own
print("cpus", ray.cluster_resources().get("CPU"))
import os, psutil

@ray.remote
def worker():
    return os.environ.get("TOKENIZERS_PARALLELISM"), dict(ray.get_runtime_context().runtime_env)

print("worker env %s, runtime env %s" % ray.get(worker.remote()))
for p in psutil.Process().children(recursive=True):
    print("process", " ".join(p.cmdline()))
ray.shutdown()
"""


def test_a_driver_that_imported_ray_first_starts_and_joins_its_own_cluster():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.pop("TOKENIZERS_PARALLELISM", None)  # what the workers get from WORKER_ENV
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cpus" in out.stdout
    assert "InvalidAuthToken" not in out.stderr
    # only what a run uses (runtime.ray_head): no autoscaler monitor, no API server, and
    # no log monitor (engine output goes to RUN_DIR/logs/, not the terminal)
    started = [line for line in out.stdout.splitlines() if line.startswith("process ")]
    assert any("raylet" in line for line in started), started
    for daemon in ("autoscaler/_private/monitor.py", "dashboard/dashboard.py", "log_monitor.py"):
        assert not any(daemon in line for line in started), (daemon, started)
    # the workers' environment (WORKER_ENV) comes from the raylet, not a runtime env (with
    # one, every worker starts as setup_worker.py first)
    assert "worker env false, runtime env {}" in out.stdout, out.stdout[-2000:]

"""A local Ray cluster with only the processes a run uses (``runtime.kind: ray``, no address).

``ray.init()`` on a fresh machine starts, besides the GCS and the raylet (and the raylet's
dashboard and runtime-env agents, which it needs), three Python daemons a Laminar run never
talks to:

* the autoscaler monitor (``monitor.py``): scales a cluster launched by ``ray up``; a local
  cluster has no node provider, and nodes that join (``runtime.elastic``) join through the
  GCS, not through it;
* the API server (``dashboard.py``): with ``include_dashboard=False`` it still starts, and
  serves only usage statistics, which ``ray.init`` turns off for a local cluster;
  ``ray.init`` waits until it has written its address, so it is on the critical path;
* the log monitor (``log_monitor.py``): forwards the workers' output to the driver, which a
  run wants only with ``log_to_driver`` (``telemetry.engine_logs: terminal``); otherwise the
  actors write to ``RUN_DIR/logs/`` themselves.

And the workers' environment (``ray_run.WORKER_ENV``: one thread per engine, offline hub) is
set on the raylet, whose worker processes inherit it, rather than passed as a job
``runtime_env``: with a runtime env every worker starts as ``setup_worker.py`` (a Python that
imports Ray and execs the real worker once the runtime-env agent has made the env), ~0.5 s
of CPU more per actor.

Ray 2.60's ``ray.init`` has no switch for these: ``RayParams`` has ``no_monitor``,
``include_log_monitor`` and ``env_vars`` (the raylet's environment), but ``ray.init`` builds
its ``RayParams`` itself. So ``lean_head`` sets them while ``ray.init`` runs, and skips the
API server. Each daemon took ~0.3-1 s of CPU while a run started on the 2-core machine
(``benchmarks/startup.py``). If a Ray release renames what this touches, the cluster starts
as Ray's default and the workers get their environment as a runtime env: nothing breaks,
it only costs the CPU again.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def lean_head(log_monitor: bool, worker_env: dict[str, str]) -> Iterator[bool]:
    """While in the block, a local cluster that ``ray.init`` starts runs no autoscaler
    monitor and no API server, a log monitor only if ``log_monitor``, and its workers with
    ``worker_env`` in their environment. Yields whether it could (False: this Ray lacks
    what it sets; the cluster starts as Ray's default, and the caller passes ``worker_env``
    as a ``runtime_env``). Not thread-safe (it patches Ray's classes): one ``ray.init`` at
    a time."""
    try:
        from ray._private import node, parameter
    except ImportError:  # a Ray without these modules: start it as it is
        yield False
        return
    params, head = parameter.RayParams, node.Node
    known = inspect.signature(params.__init__).parameters
    wanted = {"no_monitor", "include_log_monitor", "env_vars"}
    if not (wanted <= known.keys() and hasattr(head, "start_api_server")):
        yield False
        return
    original_init, original_api = params.__init__, head.start_api_server

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.no_monitor = True
        self.include_log_monitor = log_monitor
        self.env_vars = {**worker_env, **(self.env_vars or {})}

    def no_api_server(self: Any, **kwargs: Any) -> None:
        return None

    params.__init__ = init  # type: ignore[method-assign]
    head.start_api_server = no_api_server  # type: ignore[method-assign]
    try:
        yield True
    finally:
        params.__init__ = original_init  # type: ignore[method-assign]
        head.start_api_server = original_api  # type: ignore[method-assign]

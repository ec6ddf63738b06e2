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

Ray 2.60's ``ray.init`` has no switch for these (``ray start`` has ``--no-monitor`` and
``RayParams`` has ``no_monitor`` / ``include_log_monitor``, but ``ray.init`` builds its
``RayParams`` itself), so ``lean_head`` sets those two while ``ray.init`` runs and skips the
API server. Each of the three took ~0.3-1 s of CPU while a run started on the 2-core machine
(``benchmarks/startup.py``). If a Ray release renames what this touches, the cluster starts
with them, as before: nothing breaks, it only costs the CPU again.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def lean_head(log_monitor: bool) -> Iterator[None]:
    """While in the block, a local cluster that ``ray.init`` starts runs no autoscaler
    monitor and no API server, and a log monitor only if ``log_monitor``. Not thread-safe
    (it patches Ray's classes): call ``ray.init`` from one thread."""
    try:
        from ray._private import node, parameter
    except ImportError:  # a Ray without these modules: start it as it is
        yield
        return
    params, head = parameter.RayParams, node.Node
    known = inspect.signature(params.__init__).parameters
    if not (
        {"no_monitor", "include_log_monitor"} <= known.keys() and hasattr(head, "start_api_server")
    ):
        yield
        return
    original_init, original_api = params.__init__, head.start_api_server

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.no_monitor = True
        self.include_log_monitor = log_monitor

    def no_api_server(self: Any, **kwargs: Any) -> None:
        return None

    params.__init__ = init  # type: ignore[method-assign]
    head.start_api_server = no_api_server  # type: ignore[method-assign]
    try:
        yield
    finally:
        params.__init__ = original_init  # type: ignore[method-assign]
        head.start_api_server = original_api  # type: ignore[method-assign]

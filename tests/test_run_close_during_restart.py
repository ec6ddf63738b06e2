"""A run closed while one of its replicas restarts, for real: Ray, an FSDP trainer rank and
one SGLang replica (``runtime.ray_run``). The close cancels the restart and stops the new
replica's engine before its actor goes: nothing of it is left, in the process table or in
/dev/shm (SGLang's load snapshot, made while it starts, outlives the processes that made it
when they are killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from laminar_core import load_config
from laminar_core.testing import require_modules

require_modules("laminar_fsdp", "laminar_sglang", "sglang", what="the SGLang run-close test")

psutil = pytest.importorskip("psutil")
ray = pytest.importorskip("ray")

from laminar_core import shm_files_of
from laminar_core.models import build_tiny_model
from laminar_core.runtime.train import close_run, make_run_dir, start_run

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(files: list[str]) -> bool:
    return any(os.path.basename(f).startswith("sglang_loads_") for f in files)


def test_a_run_closed_while_a_replica_restarts_leaves_nothing(ray_cluster, tmp_path) -> None:
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    resolved = load_config(
        ROOT / "examples" / "quickstart.yaml",
        [
            f"model.path={model}",
            f"run.out_dir={tmp_path / 'runs'}",
            "cluster.gpus=2",
            "cluster.trainer_gpus=1",
            "rollout.engine=sglang",
            "rollout.sglang.dtype=float32",
            "rollout.sglang.max_total_tokens=4096",
            "rollout.sglang.context_length=256",
            "runtime.start_timeout_s=1200",
            "telemetry.progress=false",
        ],
    )
    seen: list[str] = []
    procs: list = []

    async def main() -> bool:
        run = await start_run(resolved, make_run_dir(resolved))
        runtime = run.runtime
        old = runtime.replica_handles[0]
        restart = asyncio.ensure_future(runtime.restart_replica(run, 0))
        try:
            # the new actor's SGLang has made its load snapshot and is not ready yet
            while runtime.replica_handles[0] is old:
                await asyncio.sleep(0.1)
            pid = await runtime.replica_handles[0].pid.remote()
            while not _snapshot(shm_files_of(pid)):
                assert not restart.done(), restart
                await asyncio.sleep(0.2)
            assert not restart.done()
            seen.extend(shm_files_of(pid))
            actor = psutil.Process(pid)
            procs.extend([actor, *actor.children(recursive=True)])
        finally:
            await close_run(run)
            with contextlib.suppress(BaseException):  # cancelled by the close
                await restart
        return restart.cancelled()

    cancelled = asyncio.run(main())
    assert _snapshot(seen)
    assert [f for f in seen if os.path.exists(f)] == []
    # bounded: Ray ends a killed actor's process in its own time
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert alive == []
    assert cancelled  # the close cancelled the restart (it did not fail on its own)

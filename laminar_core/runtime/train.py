"""``laminar train``: one run of the configured engines on the real clock, with a run dir.

Run directory layout: ``config.yaml`` (resolved), ``metrics.jsonl`` (one object per trainer
step), ``events.jsonl`` and ``trace.json`` (Chrome trace / Perfetto timeline).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from laminar_core.config.loader import ResolvedConfig
from laminar_core.runtime.local import build_local_run


def make_run_dir(resolved: ResolvedConfig) -> Path:
    cfg = resolved.cfg
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(resolved.to_yaml())
    return run_dir


def train(resolved: ResolvedConfig) -> Path:
    run_dir = make_run_dir(resolved)

    async def main() -> None:
        run = build_local_run(resolved, run_dir=run_dir)
        progress = resolved.cfg.telemetry.progress
        if progress:
            run.controller.metrics.on_row = _print_progress
        try:
            await run.controller.run(resolved.cfg.run.steps)
        finally:
            run.events.write_jsonl(run_dir / "events.jsonl")
            run.events.write_chrome_trace(run_dir / "trace.json")

    asyncio.run(main())
    return run_dir


def _print_progress(row: dict) -> None:
    reward = row.get("reward_mean")
    versions = sorted(set(row.get("replica_versions", {}).values()))
    print(
        f"step {row['step']:>4}  version {row['weight_version']:>4}  "
        f"reward {'-' if reward is None else f'{reward:.3f}'}  "
        f"{row['samples_per_second']:.1f} samples/s  staleness max {row['staleness_max']}  "
        f"replica versions {versions}",
        flush=True,
    )

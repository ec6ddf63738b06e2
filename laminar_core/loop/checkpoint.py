"""Checkpoint layout and the loop's own state.

``RUN_DIR/checkpoints/step_000012/`` holds ``trainer/`` (the trainer engine's checkpoint:
weights, optimiser, its step) and ``loop_state.json`` (the step, the prompt pool's position
and the prompts to hand out again). ``RUN_DIR/checkpoints/latest`` names the newest complete
one; it is written last, so a run killed while saving resumes from the one before.

Trajectories in flight or buffered at the checkpoint are not saved: their prompts are
re-issued on resume (same group ids), so the trainer still consumes every sampled prompt
exactly once across the restart; only their generation work is repeated.
"""

from __future__ import annotations

import json
from pathlib import Path

LOOP_STATE = "loop_state.json"
LATEST = "latest"
TRAINER_DIR = "trainer"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def write_loop_state(directory: Path, state: dict) -> None:
    (directory / LOOP_STATE).write_text(json.dumps(state))


def mark_latest(directory: Path) -> None:
    tmp = directory.parent / f".{LATEST}.tmp"
    tmp.write_text(directory.name)
    tmp.replace(directory.parent / LATEST)


def find_checkpoint(path: str | Path) -> Path:
    """``path`` is a checkpoint directory, or a run directory (its latest checkpoint)."""
    p = Path(path).expanduser()
    if (p / LOOP_STATE).is_file():
        return p
    latest = p / "checkpoints" / LATEST
    if latest.is_file():
        found = p / "checkpoints" / latest.read_text().strip()
        if (found / LOOP_STATE).is_file():
            return found
    raise FileNotFoundError(
        f"run.resume={str(path)!r}: no checkpoint there (expected a run directory with "
        f"checkpoints/{LATEST}, or a checkpoints/step_N directory with {LOOP_STATE}). "
        "Set run.checkpoint_every so a run writes checkpoints."
    )


def read_loop_state(directory: Path) -> dict:
    return json.loads((directory / LOOP_STATE).read_text())

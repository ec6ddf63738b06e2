"""Checkpoint layout and the loop's own state.

``RUN_DIR/checkpoints/step_000012/`` holds ``trainer/`` (the trainer engine's checkpoint:
weights, optimiser, its step) and ``loop_state.json`` (the step, the weight version, the
prompt pool's position and the prompts to hand out again). ``RUN_DIR/checkpoints/latest``
names the newest complete one.

Writes are atomic: a checkpoint is written into ``.step_000012.tmp/`` and renamed once every
rank's trainer state and the loop state are in it; ``latest`` is replaced last. A run killed
while saving leaves the previous checkpoint (and ``latest`` pointing at it) intact.

Trajectories in flight or buffered at the checkpoint are not saved: their prompts are
re-issued on resume (same group ids), so the trainer still consumes every sampled prompt
exactly once across the restart; only their generation work is repeated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LOOP_STATE = "loop_state.json"
LATEST = "latest"
TRAINER_DIR = "trainer"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names what is wrong and the fix."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def staging_dir(final: Path) -> Path:
    """Where a checkpoint is written before it is renamed to ``final``."""
    return final.parent / f".{final.name}.tmp"


def begin(final: Path) -> Path:
    """A fresh staging directory for the checkpoint that will become ``final``."""
    tmp = staging_dir(final)
    shutil.rmtree(tmp, ignore_errors=True)  # a save that was killed half-way
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, final: Path, state: dict) -> None:
    """Write the loop state into ``tmp``, rename it to ``final`` and point ``latest`` at it."""
    (tmp / LOOP_STATE).write_text(json.dumps(state))
    if final.exists():  # the same step saved again (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    tmp.rename(final)
    marker = final.parent / f".{LATEST}.tmp"
    marker.write_text(final.name)
    marker.replace(final.parent / LATEST)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (``None``: none yet)."""
    marker = run_dir / "checkpoints" / LATEST
    if not marker.is_file():
        return None
    found = marker.parent / marker.read_text().strip()
    return found if (found / LOOP_STATE).is_file() else None


def find_checkpoint(path: str | Path) -> Path:
    """``path`` is a checkpoint directory, or a run directory (its latest checkpoint)."""
    p = Path(path).expanduser()
    if (p / LOOP_STATE).is_file():
        return p
    found = latest(p)
    if found is not None:
        return found
    if p.name.startswith(".") and p.name.endswith(".tmp"):
        raise CheckpointError(
            f"run.resume={str(path)!r} is a checkpoint that was still being written when its "
            "run stopped; resume from the run directory (its latest complete checkpoint)"
        )
    raise FileNotFoundError(
        f"run.resume={str(path)!r}: no checkpoint there (expected a run directory with "
        f"checkpoints/{LATEST}, or a checkpoints/step_N directory with {LOOP_STATE}). "
        "Set run.checkpoint_every so a run writes checkpoints."
    )


def read_loop_state(directory: Path) -> dict:
    """The loop state of a checkpoint, checked; ``CheckpointError`` names what is damaged."""
    path = directory / LOOP_STATE
    try:
        state = json.loads(path.read_text())
        int(state["step"])
        int(state["prompts"]["position"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {directory} is damaged: {path.name} is unreadable "
            f"({type(e).__name__}: {e}); resume from an earlier checkpoint "
            f"(run.resume={directory.parent}/step_N)"
        ) from None
    if not (directory / TRAINER_DIR).is_dir():
        raise CheckpointError(
            f"checkpoint {directory} is damaged: it has no {TRAINER_DIR}/ (the trainer's "
            "state); resume from an earlier checkpoint"
        )
    return state

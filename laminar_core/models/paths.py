"""The one check every engine that loads ``model.path`` makes, with the one message."""

from __future__ import annotations

from pathlib import Path


def model_dir(path: str, who: str = "model.path") -> Path:
    """``path`` as a Hugging Face model directory, or ``FileNotFoundError`` naming the fix."""
    p = Path(path).expanduser()
    if path and (p / "config.json").is_file():
        return p
    if not path:
        why = "is not set"
    elif not p.exists():
        why = f"{path!r} does not exist"
    else:
        why = f"{path!r} has no config.json"
    raise FileNotFoundError(
        f"{who}: model.path {why}. Point model.path at a local Hugging Face model directory, "
        f"or build the tiny one with `laminar tiny-model {path or 'runs/tiny-qwen2'}`."
    )

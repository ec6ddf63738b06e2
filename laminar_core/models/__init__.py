"""Small local models for the quickstart and the tests (no model hub needed)."""

from laminar_core.models.paths import model_dir
from laminar_core.models.tiny import build_tiny_model, char_vocab

__all__ = ["build_tiny_model", "char_vocab", "model_dir"]

"""Prompt pool, partial-response pool and experience buffer."""

from laminar_core.buffers.experience import (
    SAMPLERS,
    DuplicateTrajectoryError,
    ExperienceBuffer,
)
from laminar_core.buffers.partial import InFlight, PartialPool
from laminar_core.buffers.prompts import Prompt, PromptGroup, PromptPool, SyntheticPrompts

__all__ = [
    "SAMPLERS",
    "DuplicateTrajectoryError",
    "ExperienceBuffer",
    "InFlight",
    "PartialPool",
    "Prompt",
    "PromptGroup",
    "PromptPool",
    "SyntheticPrompts",
]

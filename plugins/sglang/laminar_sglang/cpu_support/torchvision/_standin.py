"""What the stand-in's modules return for any name: a callable that raises."""

from __future__ import annotations

import enum


class InterpolationMode(enum.Enum):
    """The enum's members (imported as constants by SGLang's multimodal processors)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def unavailable(qualname: str):
    """A class-like callable named ``qualname`` that raises when used."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{qualname}: laminar-sglang's import-only torchvision stand-in (CPU) has no "
            "image ops; install a torchvision built for this torch to use multimodal models"
        )

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": __init__, "__call__": __init__})

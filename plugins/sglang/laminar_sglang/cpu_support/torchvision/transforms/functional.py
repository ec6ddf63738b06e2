"""IMPORT-ONLY STAND-IN for ``torchvision.transforms.functional`` (laminar-sglang, cpu_support).

Every name resolves to a callable that raises ``NotImplementedError``.
"""

from torchvision._standin import InterpolationMode, unavailable

__all__ = ["InterpolationMode"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable(f"torchvision.transforms.functional.{name}")

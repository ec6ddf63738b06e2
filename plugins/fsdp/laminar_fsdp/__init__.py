"""Laminar trainer engine on torch FSDP2 (``trainer.engine: fsdp``)."""

from laminar_fsdp.engine import FSDPTrainerEngine
from laminar_fsdp.options import FSDPOptions

__all__ = ["FSDPOptions", "FSDPTrainerEngine"]

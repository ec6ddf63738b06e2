"""Laminar trainer engine on megatron-core (``trainer.engine: megatron``).

The engine class is imported lazily (``laminar_megatron.engine``): importing this package
does not import megatron-core.
"""

from laminar_megatron.options import MegatronOptions

__all__ = ["MegatronOptions", "MegatronTrainerEngine"]


def __getattr__(name: str):
    if name == "MegatronTrainerEngine":
        from laminar_megatron.engine import MegatronTrainerEngine

        return MegatronTrainerEngine
    raise AttributeError(name)

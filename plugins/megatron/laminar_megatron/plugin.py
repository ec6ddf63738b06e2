"""Registers ``megatron`` as a trainer engine (entry point group ``laminar``)."""

from laminar_core import hookimpl


@hookimpl
def laminar_trainer_engines() -> dict[str, object]:
    # Lazy: megatron-core is imported only when a run actually uses this engine.
    return {"megatron": "laminar_megatron.engine:MegatronTrainerEngine"}

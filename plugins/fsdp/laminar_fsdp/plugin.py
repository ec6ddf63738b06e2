"""Registers ``fsdp`` as a trainer engine (entry point group ``laminar``)."""

from laminar_core import hookimpl


@hookimpl
def laminar_trainer_engines() -> dict[str, object]:
    # Lazy: transformers is imported only when a run actually uses this engine.
    return {"fsdp": "laminar_fsdp.engine:FSDPTrainerEngine"}

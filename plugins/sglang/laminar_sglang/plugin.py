"""Registers ``sglang`` as a rollout engine (entry point group ``laminar``)."""

from laminar_core import hookimpl


@hookimpl
def laminar_rollout_engines() -> dict[str, object]:
    # Lazy: sglang is imported only when a run actually uses this engine (in its host process).
    return {"sglang": "laminar_sglang.engine:SGLangRolloutEngine"}

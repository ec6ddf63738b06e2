"""Registers ``vllm`` as a rollout engine (entry point group ``laminar``)."""

from laminar_core import hookimpl


@hookimpl
def laminar_rollout_engines() -> dict[str, object]:
    # Lazy: vllm is imported only when a run actually uses this engine.
    return {"vllm": "laminar_vllm.engine:VLLMRolloutEngine"}

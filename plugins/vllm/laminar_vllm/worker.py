"""vLLM worker extension: loads a new weight version in place.

vLLM mixes this class into each of its workers (``worker_extension_cls``); the engine calls
``laminar_load_weights`` on all of them with ``collective_rpc``. The tensors arrive as a
safetensors file in host shared memory rather than as RPC arguments: every worker on the node
maps the same file (no copy per worker, nothing serialised through vLLM's RPC). vLLM's
``reload_weights`` runs the model's own loader, so fused and re-laid-out parameters (e.g.
the CPU backend's packed linear weights) are rebuilt exactly as at start-up.
"""

from __future__ import annotations


class WeightLoader:
    def laminar_load_weights(self, path: str) -> int:
        """Load every tensor in the safetensors file ``path``; returns how many."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

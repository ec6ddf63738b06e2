"""vLLM worker extension: loads a new weight version in place.

vLLM mixes this class into each of its workers (``worker_extension_cls``); the engine calls
``laminar_load_weights`` / ``laminar_load_shared`` on all of them with ``collective_rpc``. The
tensors arrive as a file in host shared memory rather than as RPC arguments: the node relay's
own version file (``laminar_load_shared``), or a safetensors file the engine wrote (tensors
handed over in memory); every worker on the node maps the same file (no copy per worker,
nothing serialised through vLLM's RPC). vLLM's
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
        self._laminar_retie(tensors)
        return len(tensors)

    def laminar_load_shared(self, root: str, relay_id: int, version: int) -> int:
        """Load ``version`` straight from the node relay's shared-memory file (tensors are
        views of the mapped file; the loader copies them into the parameters)."""
        from laminar_core import SharedWeights

        tensors = dict(SharedWeights(root, relay_id, version))
        self.reload_weights(weights_iterator=iter(tensors.items()))
        self._laminar_retie(tensors)
        return len(tensors)

    def _laminar_retie(self, tensors: dict) -> None:
        """Tied input/output embeddings: the LM head shares the embedding's weight, so
        vLLM's layer-wise reload sees no weights of its own for it and puts back the kernel
        tensors it derived at start-up (on CPU, a re-packed copy of the *old* embedding).
        Re-derive them from the new weight; without this, log-probs drift from the trainer's.
        """
        hf = self.model_runner.model_config.hf_config
        text = getattr(hf, "get_text_config", lambda: hf)()
        if not getattr(text, "tie_word_embeddings", False) or "lm_head.weight" in tensors:
            return
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)

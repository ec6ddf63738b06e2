"""IMPORT-ONLY STAND-IN for SGLang's ``sgl_kernel`` on CPU (laminar-sglang, cpu_support).

There is no CPU build of ``sgl_kernel`` on the package index. With
``SGLANG_USE_CPU_ENGINE=1``, SGLang 0.5.23 imports CPU kernels from it at module level
(``copy_all_layer_kv_cache_cpu`` for hierarchical KV caching; ``assign_req_to_token_pool_cpu``,
``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``,
``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu``, ``rotate_input_ids_cpu``,
``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu`` for speculative decoding)
and calls none of them on a plain rollout's path: laminar-sglang enables neither feature.
Every name resolves to a function that raises ``NotImplementedError``.
"""

from __future__ import annotations

from collections.abc import Callable


def _unavailable(name: str) -> Callable[..., None]:
    def fn(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name}: laminar-sglang's import-only CPU stand-in has no kernels; "
            "this SGLang feature (hierarchical cache, speculative decoding) needs the real "
            "kernel package"
        )

    fn.__name__ = fn.__qualname__ = name
    return fn


def __getattr__(name: str) -> Callable[..., None]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)

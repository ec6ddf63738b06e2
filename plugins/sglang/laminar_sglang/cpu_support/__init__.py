"""CPU-only import stand-ins for SGLang (activated only when SGLang runs on CPU).

SGLang 0.5.23 imports two packages that cannot be installed on a CPU-only machine and
whose code its CPU rollout path never calls:

* ``sgl_kernel``: SGLang's kernel package. Its wheels on the package index (``sgl-kernel``,
  ``sglang-kernel``) are CUDA-only and there is no CPU build or sdist. With
  ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports three names from it at import time
  (``copy_all_layer_kv_cache_cpu``, ``fill_accept_out_cache_loc_cpu``,
  ``fill_bonus_tokens_cpu``: hierarchical-cache and speculative-decoding helpers).
* ``torchvision``: imported by SGLang's multimodal configs when the engine is imported
  (``torchvision.transforms``); the index's torchvision is CUDA-linked and fails to import
  with the CPU build of torch (``operator torchvision::nms does not exist``).

The stand-ins here are IMPORT-ONLY: every function raises ``NotImplementedError`` naming
this module, so a code path that does need them fails loudly instead of computing
something wrong. They are put on the SGLang host process's import path only on CPU and
only for packages that are not installed (``activate``); a real package always wins.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: The directory holding the stand-in packages (``sgl_kernel/``, ``torchvision/``).
STANDINS = Path(__file__).resolve().parent
PACKAGES = ("sgl_kernel", "torchvision")


def missing() -> list[str]:
    """The stand-in packages this environment lacks (the ones ``activate`` would supply)."""
    return [p for p in PACKAGES if importlib.util.find_spec(p) is None]


def import_path() -> str | None:
    """The directory to append to ``PYTHONPATH`` of a process that runs SGLang on CPU, or
    None when every package is really installed. Appended, not prepended: an installed
    package is found first."""
    return str(STANDINS) if missing() else None

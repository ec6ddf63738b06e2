"""IMPORT-ONLY STAND-IN for ``torchvision`` under SGLang on CPU (laminar-sglang, cpu_support).

SGLang's multimodal configs import ``torchvision.transforms`` when the engine is imported;
the index's torchvision is CUDA-linked and does not import with the CPU build of torch.
Text models never call it. Every transform and function here raises.
"""

from torchvision import io, transforms

# Not a real release: too old for any "torchvision >= X" gate, so callers that check
# (transformers' image processors) take their torchvision-free paths.
__version__ = "0.0.0+laminar.standin"

__all__ = ["__version__", "io", "transforms"]

"""laminar-nccl: a ``WeightTransport`` over torch.distributed point-to-point.

NCCL between GPUs, gloo between CPUs (CI, laptops). See ``transport.py``.
"""

from laminar_nccl.transport import NcclOptions, TorchDistTransport

__all__ = ["NcclOptions", "TorchDistTransport"]

"""laminar-rdma: a ``WeightTransport`` over NIXL one-sided writes. See ``transport.py``."""

from laminar_rdma.transport import NixlOptions, NixlTransport

__all__ = ["NixlOptions", "NixlTransport"]

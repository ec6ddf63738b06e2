"""Registers the ``rdma`` transport with Laminar (entry-point group ``laminar``)."""

from __future__ import annotations

from laminar_core import hookimpl


@hookimpl
def laminar_transports() -> dict[str, object]:
    return {"rdma": "laminar_rdma.transport:NixlTransport"}

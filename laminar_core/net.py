"""Network helpers shared by the runtime, the conformance kits and plugins."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it): for a
    rendezvous such as torch.distributed's ``tcp://host:port``. ``""`` binds every
    interface (a port other nodes reach). Another process may take it before it is used,
    so use it at once."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

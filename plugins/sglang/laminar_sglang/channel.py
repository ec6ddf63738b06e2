"""The replica <-> SGLang host channel: length-prefixed pickled messages over a socket pair.

Both ends are processes of this package on one node (the replica and the host process it
started), so pickle is safe here; the socket is private to the pair (inherited, never bound).
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

_LEN = struct.Struct("!I")


def send(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    """Queue one message (one ``write``: messages from concurrent tasks never interleave)."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LEN.pack(len(data)) + data)


async def recv(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next message; ``asyncio.IncompleteReadError`` when the other end is gone."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return pickle.loads(await reader.readexactly(n))

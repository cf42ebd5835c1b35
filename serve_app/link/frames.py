"""The link's wire: a raw token first, then length-prefixed frames, each a call id and a pickled body.

Both ends are this application's own processes on one node (a router and a model replica),
the same trust Ray's own transport between them rests on, and which it pickles alike. The
socket lives in a directory only this user can open, and the replica unpickles nothing from a
connection before its first bytes match the replica's token.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

HEADER = struct.Struct("!QQ")  # body length, call id
MAX_BODY = 1 << 32  # a frame past this is a broken peer, not a batch
TOKEN_BYTES = 16
HELLO_TIMEOUT_S = 5.0  # a connection that has not sent its token by then is closed


class LinkBroken(ConnectionError):
    """The link closed or failed under a call: the replica may be gone, the batch may run elsewhere."""


def encode(call_id: int, body: Any) -> bytes:
    data = pickle.dumps(body, protocol=5)
    return HEADER.pack(len(data), call_id) + data


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, Any]:
    """One frame's call id and body; IncompleteReadError at a clean end of stream."""
    length, call_id = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > MAX_BODY:
        raise LinkBroken(f"a frame of {length} bytes")
    return call_id, pickle.loads(await reader.readexactly(length))

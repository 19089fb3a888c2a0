"""Length-prefixed msgpack frames between the front end and its workers (a private socketpair)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import msgpack

if TYPE_CHECKING:  # workers import this module; asyncio itself would make each of their forks dearer
    import asyncio

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30
_UNICODE_ERRORS = "surrogatepass"  # JSON may carry lone surrogates ("\ud800"); they must survive the hop


def pack(message) -> bytes:
    """msgpack, keeping lone surrogates (also a fork server's payload to a call, ``worker._enter_call``)."""
    return msgpack.packb(message, use_bin_type=True, unicode_errors=_UNICODE_ERRORS)


def unpack(body: bytes):
    return msgpack.unpackb(body, raw=False, unicode_errors=_UNICODE_ERRORS)


def encode_frame(message: dict) -> bytes:
    body = pack(message)
    return _HEADER.pack(len(body)) + body


def split_frames(buffer: bytearray) -> list[dict]:
    """Pop every complete frame from ``buffer`` (in place) and return the decoded messages."""
    messages = []
    offset = 0
    while len(buffer) - offset >= _HEADER.size:
        (length,) = _HEADER.unpack_from(buffer, offset)
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        end = offset + _HEADER.size + length
        if len(buffer) < end:
            break
        body = bytes(buffer[offset + _HEADER.size : end])
        messages.append(unpack(body))
        offset = end
    del buffer[:offset]
    return messages


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """Read one frame; raises ``asyncio.IncompleteReadError`` at end of stream."""
    (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return unpack(await reader.readexactly(length))

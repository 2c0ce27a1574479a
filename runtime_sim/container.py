"""The container every encoded program travels in (a chip's, :mod:`.program`; a system's, :mod:`.system_sim`).

Layout (little endian)::

    magic (8 bytes) | u16 version | u16 reserved (0) | u64 body length | 16-byte blake2b of the body | body
"""

from __future__ import annotations

import hashlib
import struct

from .rules import ProgramFormatError

HEADER = struct.Struct("<8sHHQ16s")


def seal(view: memoryview, magic: bytes, version: int) -> None:
    """Write the header over the first :data:`HEADER` bytes of ``view``, whose body follows them."""
    body = view[HEADER.size:]
    HEADER.pack_into(view, 0, magic, version, 0, len(body), hashlib.blake2b(body, digest_size=16).digest())


def opened(blob, magic: bytes, versions: tuple, what: str, verified: bool = False) -> tuple:
    """``(version, body, digest)`` of a sealed container, every header field checked; the checksum too, unless
    ``verified`` (the container lies inside another whose checksum, checked already, covers its bytes).

    Raises
    ------
    ProgramFormatError
        Naming ``what`` (``"program"``, ``"system program"``) and the field that is wrong.
    """
    buf = memoryview(blob).cast("B")
    if len(buf) < HEADER.size:
        raise ProgramFormatError(f"{what} truncated: {len(buf)} bytes is shorter than the header")
    found, version, reserved, body_len, digest = HEADER.unpack(buf[:HEADER.size])
    if found != magic:
        raise ProgramFormatError(f"not an LPX {what} (bad magic)")
    if version not in versions:
        raise ProgramFormatError(f"{what} format version {version}; this runtime reads version {versions[-1]}")
    if reserved:
        raise ProgramFormatError(f"{what} header reserved field is {reserved}, must be 0")
    body = buf[HEADER.size:]
    if len(body) != body_len:
        raise ProgramFormatError(f"{what} truncated or padded: body is {len(body)} bytes, header says {body_len}")
    if not verified and hashlib.blake2b(body, digest_size=16).digest() != digest:
        raise ProgramFormatError(f"{what} checksum mismatch: the bytes were corrupted")
    return version, body, digest

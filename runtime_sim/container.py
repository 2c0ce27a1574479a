"""The container every encoded program travels in (a chip's, :mod:`.program`; a system's, :mod:`.system_sim`).

Layout (little endian)::

    magic (8 bytes) | u16 version | u16 reserved (0) | u64 body length | 16-byte blake2b of the body | body
"""

from __future__ import annotations

import hashlib
import struct
from concurrent.futures import ThreadPoolExecutor

from .rules import ProgramFormatError

HEADER = struct.Struct("<8sHHQ16s")


def body_digest(body, version: int, keyed_from: int | None = None) -> bytes:
    """The 16-byte blake2b of ``body``; from version ``keyed_from`` on, keyed by the version too, so that a
    changed version field (the body of one format read as another's) fails the checksum."""
    keyed = keyed_from is not None and version >= keyed_from
    return hashlib.blake2b(body, digest_size=16, person=struct.pack("<H", version) if keyed else b"").digest()


def seal(view: memoryview, magic: bytes, version: int, keyed_from: int | None = None) -> None:
    """Write the header over the first :data:`HEADER` bytes of ``view``, whose body follows them."""
    body = view[HEADER.size:]
    HEADER.pack_into(view, 0, magic, version, 0, len(body), body_digest(body, version, keyed_from))


def opened(blob, magic: bytes, versions: tuple, what: str, verified: bool = False,
           keyed_from: int | None = None) -> tuple:
    """``(version, body, digest)`` of a sealed container, every header field checked; the checksum too, unless
    ``verified`` (the container lies inside another whose checksum, checked already, covers its bytes);
    ``keyed_from``: see :func:`body_digest`.

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
    if not verified and body_digest(body, version, keyed_from) != digest:
        raise ProgramFormatError(f"{what} checksum mismatch: the bytes were corrupted")
    return version, body, digest


TREE_PIECE = 64 << 20  # bytes of a body each leaf of :func:`tree_digest` hashes
_TREE_WORKERS = 2  # leaves hashed at once (hashlib lets go of the GIL)


def tree_digest(body) -> bytes:
    """The 16-byte blake2b of the 16-byte blake2b of each :data:`TREE_PIECE` bytes of ``body`` in turn (of the
    one empty piece where ``body`` is empty): every byte hashed once, the pieces on two cores at once."""
    body = memoryview(body).cast("B")
    pieces = [body[at:at + TREE_PIECE] for at in range(0, len(body), TREE_PIECE)] or [body]

    def leaf(piece) -> bytes:
        return hashlib.blake2b(piece, digest_size=16).digest()
    if len(pieces) == 1:
        leaves = [leaf(pieces[0])]
    else:
        with ThreadPoolExecutor(_TREE_WORKERS, thread_name_prefix="lpx-digest") as pool:
            leaves = list(pool.map(leaf, pieces))
    return hashlib.blake2b(b"".join(leaves), digest_size=16).digest()

"""The checksummed envelope every backend stores around a page payload.

Layout (little endian, 24-byte header)::

    magic    4s   b"HCL3"
    version  u16  2 (1 is still read)
    flags    u16  0 (reserved)
    length   u64  payload length in bytes
    crc      u32  checksum over (object key, header fields, payload)
    pad      u32  0
    payload  length bytes

The checksum covers the object key too, so a page stored (or renamed, or copied) under another
key fails the check instead of being served as someone else's KV. The length field catches
truncation and trailing garbage. Version 2 checksums with CRC-32C (Castagnoli; the CPU's crc32
instruction via ``google_crc32c``, about 3x zlib's CRC-32 here, which was most of a page write's
cost on a fast store); version 1 objects (zlib CRC-32) written by earlier releases are still
read and verified with their own checksum. A CRC is chosen over a cryptographic hash because
it runs near memory speed and we guard against accidents (torn files, bit flips, wrong
objects), not against an adversary: anyone who can write the store can seal a
page with a valid checksum, so the store's access control is the trust boundary (the default
file store is a private per-user directory, see ``file.default_dir``). What the envelope does
promise against hostile contents is bounded cost: sizes are checked before payloads are read
(:func:`check_size`), so a huge object is a miss, not an allocation.

Pure functions; thread-safe.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import google_crc32c

from hicache_runtime.contracts.errors import CorruptPage

MAGIC = b"HCL3"
VERSION = 2
"""The version this module writes."""
_HEADER = struct.Struct("<4sHHQII")
HEADER_SIZE = _HEADER.size

DEFAULT_MAX_PAYLOAD_BYTES = 64 << 20
"""Largest payload a backend reads when its caller has not said how big a page is. Store
contents are untrusted: a page file or value larger than this is rejected from its size alone,
before any of it is read (a planted sparse 1 GiB file must not cost 1 GiB). The runtime passes
its exact page size (``make_backend(..., max_payload_bytes=)``), which is far smaller."""


def _zlib_crc32(data: bytes, crc: int) -> int:
    return zlib.crc32(data, crc)


def _crc32c(data: bytes, crc: int) -> int:
    return int(google_crc32c.extend(crc, data))


_CHECKSUMS: dict[int, Callable[[bytes, int], int]] = {1: _zlib_crc32, 2: _crc32c}
"""The checksum of each envelope version this module reads."""


def _crc(object_key: str, length: int, payload: bytes, version: int = VERSION) -> int:
    extend = _CHECKSUMS[version]
    crc = extend(object_key.encode(), 0)
    crc = extend(struct.pack("<HHQ", version, 0, length), crc)
    return extend(payload, crc)


def seal_parts(object_key: str, payload: bytes) -> tuple[bytes, bytes]:
    """``(header, payload)`` for ``object_key``: the sealed object in two parts, so a backend
    can write them without first copying the payload into one buffer (``payload`` is
    returned as is, not copied)."""
    crc = _crc(object_key, len(payload), payload)
    return _HEADER.pack(MAGIC, VERSION, 0, len(payload), crc, 0), payload


def seal(object_key: str, payload: bytes) -> bytes:
    """Header + payload in one buffer, checksummed for ``object_key``."""
    header, _ = seal_parts(object_key, payload)
    return header + payload


def parse_header(object_key: str, header: bytes) -> tuple[int, int, int]:
    """Validate a header on its own; returns ``(payload length, crc, version)``.

    Raises :class:`CorruptPage` on a short header, a wrong magic, an unknown version or
    non-zero reserved fields.
    """
    if len(header) < HEADER_SIZE:
        raise CorruptPage(f"{object_key}: truncated header ({len(header)} bytes)")
    magic, version, flags, length, crc, pad = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptPage(f"{object_key}: bad magic {magic!r}")
    if version not in _CHECKSUMS:
        raise CorruptPage(f"{object_key}: unknown envelope version {version}")
    if flags or pad:
        # Reserved words are zero in version 1; anything else is damage.
        raise CorruptPage(f"{object_key}: reserved header fields are not zero")
    return length, crc, version


def check_size(object_key: str, stored: int, limit: int) -> None:
    """Reject an object from its stored size alone (header included), before reading it.

    Raises :class:`CorruptPage` when ``stored`` exceeds one header plus ``limit`` payload
    bytes: no page this reader could use is that big, so none of it is worth reading.
    """
    if stored > HEADER_SIZE + limit:
        raise CorruptPage(f"{object_key}: object is {stored} bytes, more than any page "
                          f"({HEADER_SIZE + limit} bytes with its header)")


def check_payload(object_key: str, length: int, crc: int, payload: bytes,
                  version: int = VERSION) -> bytes:
    """Verify a payload against its parsed header (``version`` picks the checksum); returns
    it unchanged or raises."""
    if len(payload) != length:
        raise CorruptPage(f"{object_key}: payload is {len(payload)} bytes, header says {length}"
                          " (truncated or overlong)")
    if _crc(object_key, length, payload, version) != crc:
        raise CorruptPage(f"{object_key}: checksum mismatch")
    return payload


def open_parts(object_key: str, header: bytes, payload: bytes) -> bytes:
    """The verified payload of a blob read as two parts (header, everything after it).

    Backends that can read the header separately (files) use this to avoid copying the
    payload out of one big buffer. Raises :class:`CorruptPage` on any mismatch.
    """
    length, crc, version = parse_header(object_key, header)
    if len(header) != HEADER_SIZE:
        raise CorruptPage(f"{object_key}: header part is {len(header)} bytes")
    return check_payload(object_key, length, crc, payload, version)


def split(blob: bytes) -> tuple[bytes, bytes]:
    """A sealed blob as (header, payload) parts; no validation."""
    return blob[:HEADER_SIZE], blob[HEADER_SIZE:]


def unseal(object_key: str, blob: bytes) -> bytes:
    """The payload of a sealed blob, verified; raises :class:`CorruptPage` otherwise."""
    return open_parts(object_key, *split(blob))

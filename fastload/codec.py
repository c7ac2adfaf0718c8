"""Cache payload format: LZ4 *block* chunks (or raw bytes), a header, a checksum.

Layout (little-endian)::

    magic "FLP1" | version u8 | codec u8 | reserved u16 | raw_size u64
    | chunk_bytes u32 | n_chunks u32 | xxh3_64(raw) u64 | meta_len u32
    | meta (UTF-8 JSON, dtype/shape/etc., <= 64 KiB; spaces after it place the body: line_pad)
    | codec LZ4 only: n_chunks x u32 compressed chunk sizes
    | body

The body of an LZ4 payload is a concatenation of independent LZ4 *blocks*
(not ``lz4.frame``), each the compression of ``chunk_bytes`` raw bytes (the last
may be shorter). That is the layout DALI's ``fn.decoders.inflate`` (nvCOMP)
takes, with the chunk sizes as its offsets/sizes input, so a payload can cross
the GPU link compressed and be inflated there.

Decoding never trusts the header: every size is checked against the payload
length and the LZ4 worst-case bound before anything is allocated, so a corrupt
or hostile header raises :class:`CodecError` instead of over-reading or
allocating without bound (tests/unit/test_codec.py pins this with hypothesis).
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import lz4.block
import xxhash

from fastload.errors import CodecError

MAGIC = b"FLP1"
VERSION = 1
RAW = 0
LZ4 = 1
CODEC_NAMES = {RAW: "raw", LZ4: "lz4"}

_HEADER = struct.Struct("<4sBBHQIIQI")
HEADER_BYTES = _HEADER.size
MAX_META_BYTES = 64 * 1024
# LZ4 cannot expand data by more than ~255x, so a raw size above this multiple
# of the body is a lie; it bounds the allocation a hostile header can trigger.
_MAX_RATIO = 255
# What a block's first LZ4 chunk must save for its other chunks to be tried (encode_parts).
PROBE_SAVING = 0.01


def checksum(data: bytes | memoryview) -> int:
    """The payload checksum: xxh3 64-bit of the raw bytes."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_parts(*parts: bytes | memoryview) -> int:
    """:func:`checksum` of the parts joined, without joining them."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def raw_head_agrees(head: bytes, raw_size: int, digest: int) -> bool:
    """Whether ``head`` is a whole RAW payload's header (and metadata) for ``raw_size``
    bytes of checksum ``digest``: all that sits before a RAW body."""
    if len(head) < HEADER_BYTES:
        return False
    magic, version, codec, _, size, _, n_chunks, got, meta_len = _HEADER.unpack_from(head)
    return (magic == MAGIC and version == VERSION and codec == RAW and n_chunks == 0 and size == raw_size
            and got == digest and HEADER_BYTES + meta_len == len(head))


def lz4_bound(n: int) -> int:
    """Worst-case LZ4 block size for ``n`` input bytes (LZ4_COMPRESSBOUND)."""
    return n + n // 255 + 16


@dataclass(frozen=True)
class PayloadInfo:
    """A parsed, validated header.

    Attributes:
        codec: ``RAW`` or ``LZ4``.
        raw_size: Bytes after decoding.
        chunk_bytes: Raw bytes per LZ4 chunk (the last chunk may be shorter).
        checksum: xxh3_64 of the raw bytes.
        meta: Free-form metadata (dtype, shape, source URL...).
        body_offset: Where the body starts in the payload.
        chunk_sizes: Compressed size of each LZ4 chunk (empty for RAW).
    """

    codec: int
    raw_size: int
    chunk_bytes: int
    checksum: int
    meta: dict[str, Any] = field(default_factory=dict)
    body_offset: int = HEADER_BYTES
    chunk_sizes: tuple[int, ...] = ()

    @property
    def codec_name(self) -> str:
        return CODEC_NAMES[self.codec]

    def chunk_offsets(self) -> list[int]:
        """Offsets of each compressed chunk, relative to the payload start."""
        offsets, pos = [], self.body_offset
        for size in self.chunk_sizes:
            offsets.append(pos)
            pos += size
        return offsets

    def chunk_raw_sizes(self) -> list[int]:
        """Decoded size of each chunk."""
        full, rest = divmod(self.raw_size, self.chunk_bytes)
        return [self.chunk_bytes] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Encoded:
    """A payload kept as its head (header, metadata, chunk table) and its body, so that
    writing it copies neither (``os.pwritev``): joining a fresh 110 KB object into one
    ``bytes`` cost ~21 us of a cold object's CPU (benchmarks/peers/results/profile.md).

    Attributes:
        head: Header, metadata and (LZ4) the chunk sizes.
        body: The raw bytes (RAW; the caller's ``bytes`` object itself) or the LZ4 chunks.
        codec: ``RAW`` or ``LZ4``.
        checksum: xxh3_64 of the raw bytes (the header's).
    """

    head: bytes
    body: bytes | memoryview
    codec: int
    checksum: int

    def __len__(self) -> int:
        return len(self.head) + len(self.body)

    @property
    def parts(self) -> tuple[bytes, bytes | memoryview]:
        return (self.head, self.body)

    def stored_checksum(self) -> int:
        """xxh3_64 of the whole payload, as :func:`checksum` of ``bytes(self)`` gives."""
        h = xxhash.xxh3_64(self.head)
        h.update(self.body)
        return int(h.intdigest())

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def encode_parts(
    raw: bytes | bytearray | memoryview,
    *,
    chunk_bytes: int = 1024**2,
    level: int = 0,
    min_saving: float = 0.05,
    meta: dict[str, Any] | None = None,
    placed: bool = False,
) -> Encoded:
    """:func:`encode`, as head and body (:class:`Encoded`); a RAW body is ``raw`` itself
    when that is ``bytes`` (immutable), else a copy. ``placed``: the metadata padded so that
    the body lies at the same place in a line in the file as in memory (:func:`line_pad`;
    the cache's writes: the bytes then depend on where the body lies in memory)."""
    view = memoryview(raw).cast("B")
    meta_bytes = json.dumps(meta or {}, separators=(",", ":"), sort_keys=True).encode()
    if len(meta_bytes) > MAX_META_BYTES:
        raise CodecError(f"payload metadata is {len(meta_bytes)} B; the limit is {MAX_META_BYTES} B")
    digest = checksum(view)
    raw_size = len(view)

    def stored_raw() -> Encoded:
        body = raw if isinstance(raw, bytes) else bytes(view)
        meta_padded = meta_bytes + line_pad(HEADER_BYTES + len(meta_bytes), body, len(meta_bytes)) if placed else meta_bytes
        header = _HEADER.pack(MAGIC, VERSION, RAW, 0, raw_size, chunk_bytes, 0, digest, len(meta_padded))
        return Encoded(header + meta_padded, body, RAW, digest)

    if precompressed(view):  # LZ4 would be tried on every chunk, then thrown away
        return stored_raw()
    mode = "high_compression" if level > 0 else "default"
    chunks = []
    for i in range(0, raw_size, chunk_bytes):
        chunks.append(lz4.block.compress(view[i : i + chunk_bytes], mode=mode, compression=level, store_size=False))
        if i == 0 and min_saving > 0 and raw_size > chunk_bytes and len(chunks[0]) > chunk_bytes * (1.0 - PROBE_SAVING):
            # The first chunk does not compress: a large block of media or noise, whose other chunks LZ4
            # would try and throw away too (7.2 ms of an 8 MiB block's store, benchmarks/large). A block
            # that compresses only past its first chunk is stored raw: readable, just not smaller.
            return stored_raw()
    packed = sum(len(c) for c in chunks) + 4 * len(chunks)
    if raw_size and packed <= raw_size * (1.0 - min_saving):
        sizes = struct.pack(f"<{len(chunks)}I", *(len(c) for c in chunks))
        body = b"".join(chunks)
        if placed:
            meta_bytes += line_pad(HEADER_BYTES + len(meta_bytes) + len(sizes), body, len(meta_bytes))
        header = _HEADER.pack(MAGIC, VERSION, LZ4, 0, raw_size, chunk_bytes, len(chunks), digest, len(meta_bytes))
        return Encoded(b"".join([header, meta_bytes, sizes]), body, LZ4, digest)
    return stored_raw()


# Where a bytes object's data starts after its address (id) in CPython: its header and the NUL
# that sizeof counts. Another interpreter gets no padding (line_pad).
BYTES_DATA = sys.getsizeof(b"") - 1 if sys.implementation.name == "cpython" else None
LINE = 64
LINE_PAD_MIN = 2048  # bodies whose copy is done with `rep movsb` (native/lines.h)


def line_pad(head_len: int, body: bytes, meta_len: int) -> bytes:
    """Spaces after the metadata (JSON allows them) that put ``body`` at the same place in a
    64-byte line in the file as in memory (a payload starts on a line: a pack's slot, or a file).

    Why: the kernel copies a write into the page cache with `rep movsb`, which on the benchmark
    machine runs at a fifth of its speed where the destination's place in its line is 1-31 bytes
    past the source's (native/lines.h, benchmarks/open/align.py): about half of all bodies. The
    write of 256 MB objects spent 20% of `fastload cache`'s CPU in that copy. At most 63 bytes.
    """
    if BYTES_DATA is None or len(body) < LINE_PAD_MIN or type(body) is not bytes or meta_len > MAX_META_BYTES - LINE:
        return b""
    return b" " * ((id(body) + BYTES_DATA - head_len) % LINE)


INT_MAX = 2**31 - 1  # lz4.block takes sizes as C ints


def decode_chunk(payload: memoryview, offset: int, size: int, raw_size: int) -> bytes:
    """One LZ4 chunk of ``payload`` (``size`` bytes at ``offset``), decoded and checked to be ``raw_size``
    bytes: the one chunk decoder (:func:`decode`, and fastload.cache.gather's ranged reads)."""
    if size > INT_MAX or raw_size > INT_MAX:
        raise CodecError(f"LZ4 chunk at offset {offset} is corrupt: a chunk of {raw_size} B is too large")
    try:
        part = lz4.block.decompress(payload[offset : offset + size], uncompressed_size=raw_size)
    except lz4.block.LZ4BlockError as err:
        raise CodecError(f"LZ4 chunk at offset {offset} is corrupt: {err}") from err
    if len(part) != raw_size:
        raise CodecError(f"LZ4 chunk at offset {offset} decoded to {len(part)} B, expected {raw_size} B")
    return part


def encode(
    raw: bytes | bytearray | memoryview,
    *,
    chunk_bytes: int = 1024**2,
    level: int = 0,
    min_saving: float = 0.05,
    meta: dict[str, Any] | None = None,
) -> bytes:
    """Encode ``raw`` as a payload, choosing LZ4 only when it saves ``min_saving``.

    Args:
        raw: The bytes to store.
        chunk_bytes: Raw bytes per independent LZ4 block.
        level: 0 for fast LZ4, 1..12 for LZ4-HC.
        min_saving: Fraction LZ4 must save, else the payload is stored raw
            (JPEG and noise do not compress, and raw is then cheaper to read).
        meta: JSON-serialisable metadata recorded in the header.

    >>> decode(encode(b"abc" * 1000)) == b"abc" * 1000
    True
    """
    return bytes(encode_parts(raw, chunk_bytes=chunk_bytes, level=level, min_saving=min_saving, meta=meta))


# Magic numbers of formats that are compressed already: JPEG, PNG, GIF, WebP (RIFF),
# gzip, zip, zstd, xz, bzip2, 7z. LZ4 saves ~0% on them; trying it was ~5% of a cold
# epoch's CPU over JPEGs (py-spy, benchmarks/peers/cpu_per_object.py).
_PRECOMPRESSED = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"RIFF", b"\x1f\x8b", b"PK\x03\x04",
                  b"\x28\xb5\x2f\xfd", b"\xfd7zXZ", b"BZh", b"7z\xbc\xaf")


def precompressed(view: memoryview | bytes) -> bool:
    r"""Whether ``view`` starts like a format that is compressed already (stored raw, untried).

    >>> precompressed(b"\xff\xd8\xff\xe0 JFIF"), precompressed(b"plain text")
    (True, False)
    """
    head = bytes(view[:4])
    return head.startswith(_PRECOMPRESSED) and not (head == b"RIFF" and bytes(view[8:12]) not in (b"WEBP", b"AVI "))


def parse_header(payload: bytes | memoryview) -> PayloadInfo:
    """Parse and bounds-check a payload header without decoding the body."""
    view = memoryview(payload)
    if len(view) < HEADER_BYTES:
        raise CodecError(f"payload is {len(view)} B, shorter than the {HEADER_BYTES} B header")
    magic, version, codec, _, raw_size, chunk_bytes, n_chunks, digest, meta_len = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"payload magic is {bytes(magic)!r}, expected {MAGIC!r}: not a fastload payload")
    if version != VERSION:
        raise CodecError(f"payload version {version} is not supported (expected {VERSION})")
    if codec not in CODEC_NAMES:
        raise CodecError(f"payload codec id {codec} is unknown")
    if meta_len > MAX_META_BYTES or HEADER_BYTES + meta_len > len(view):
        raise CodecError(f"payload metadata length {meta_len} B exceeds the payload or the limit")
    if chunk_bytes == 0:
        raise CodecError("payload chunk size is 0")
    pos = HEADER_BYTES + meta_len
    try:
        raw_meta = bytes(view[HEADER_BYTES:pos])
        # "{}" (what nearly every payload holds) without a JSON parse: a few us per warm read.
        meta = json.loads(raw_meta.decode()) if meta_len and raw_meta.rstrip(b" ") != b"{}" else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CodecError(f"payload metadata is not valid JSON: {err}") from err
    if not isinstance(meta, dict):
        raise CodecError("payload metadata is not a JSON object")
    sizes: tuple[int, ...] = ()
    if codec == RAW:
        if n_chunks != 0 or len(view) - pos != raw_size:
            raise CodecError(f"raw payload body is {len(view) - pos} B but the header says {raw_size} B")
    else:
        expected_chunks = -(-raw_size // chunk_bytes)
        if n_chunks != expected_chunks:
            raise CodecError(f"payload has {n_chunks} chunks; {raw_size} B in {chunk_bytes} B chunks needs {expected_chunks}")
        if pos + 4 * n_chunks > len(view):
            raise CodecError("payload chunk table runs past the end of the payload")
        sizes = struct.unpack_from(f"<{n_chunks}I", view, pos)
        pos += 4 * n_chunks
        if sum(sizes) != len(view) - pos:
            raise CodecError(f"payload chunks total {sum(sizes)} B but the body is {len(view) - pos} B")
        if raw_size > _MAX_RATIO * max(1, sum(sizes)):
            raise CodecError(f"payload claims {raw_size} B from a {sum(sizes)} B body; impossible for LZ4")
        for size, raw_chunk in zip(sizes, PayloadInfo(codec, raw_size, chunk_bytes, 0).chunk_raw_sizes()):
            if size == 0 or size > lz4_bound(raw_chunk):
                raise CodecError(f"payload chunk of {size} B cannot hold {raw_chunk} B of LZ4 data")
    return PayloadInfo(codec, raw_size, chunk_bytes, digest, meta, pos, sizes)


def decode(payload: bytes | memoryview, *, verify: bool = True, info: PayloadInfo | None = None) -> bytes:
    """Decode a payload back to its raw bytes, checking sizes and (by default) the checksum.

    Args:
        payload: The stored payload.
        verify: Check the xxh3 checksum of the decoded bytes.
        info: The header, if the caller already parsed it from this payload.

    Raises:
        CodecError: The header is malformed, a chunk does not decode to its size,
            or the checksum does not match.
    """
    info = info or parse_header(payload)
    view = memoryview(payload)
    if info.codec == RAW:
        raw = bytes(view[info.body_offset :])
    else:
        parts = [decode_chunk(view, offset, size, raw_chunk)
                 for offset, size, raw_chunk in zip(info.chunk_offsets(), info.chunk_sizes, info.chunk_raw_sizes())]
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
    if verify and checksum(raw) != info.checksum:
        raise CodecError("payload checksum mismatch: the raw bytes differ from what was written")
    return raw

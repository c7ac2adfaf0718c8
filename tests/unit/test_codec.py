"""Payload codec: round trips per codec (one contract class), and hostile input."""

from __future__ import annotations

import os
import struct

import lz4.block
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload import codec
from fastload.errors import CodecError

COMPRESSIBLE = (b"fastload " * 50_000) + bytes(range(256)) * 100
NOISE = os.urandom(300_000)


class CodecContract:
    """Every way of encoding must round-trip bit-exact and record what it did."""

    level = 0
    expected_codec = codec.LZ4

    def encode(self, data: bytes, **kw: object) -> bytes:
        return codec.encode(data, level=self.level, chunk_bytes=64 * 1024, **kw)  # type: ignore[arg-type]

    def test_round_trip(self) -> None:
        payload = self.encode(COMPRESSIBLE)
        assert codec.decode(payload) == COMPRESSIBLE
        info = codec.parse_header(payload)
        assert info.codec == self.expected_codec
        assert info.raw_size == len(COMPRESSIBLE)
        assert info.checksum == codec.checksum(COMPRESSIBLE)

    def test_chunks_are_independent_lz4_blocks(self) -> None:
        payload = self.encode(COMPRESSIBLE)
        info = codec.parse_header(payload)
        if info.codec != codec.LZ4:
            pytest.skip("raw payloads have no chunks")
        # Each chunk must decode on its own, as nvCOMP inflate on the GPU will do it.
        out = b"".join(
            lz4.block.decompress(payload[o : o + s], uncompressed_size=r)
            for o, s, r in zip(info.chunk_offsets(), info.chunk_sizes, info.chunk_raw_sizes())
        )
        assert out == COMPRESSIBLE
        assert len(info.chunk_sizes) == -(-len(COMPRESSIBLE) // (64 * 1024))

    def test_empty_and_tiny(self) -> None:
        for data in (b"", b"x", b"ab" * 3):
            assert codec.decode(self.encode(data)) == data

    def test_meta_is_recorded(self) -> None:
        payload = self.encode(COMPRESSIBLE, meta={"dtype": "uint8", "shape": [3, 4]})
        assert codec.parse_header(payload).meta == {"dtype": "uint8", "shape": [3, 4]}


class TestFastLZ4(CodecContract):
    level = 0


class TestLZ4HC(CodecContract):
    level = 9

    def test_hc_is_not_larger_than_fast(self) -> None:
        arr = np.random.default_rng(0).zipf(1.3, 200_000).clip(0, 32000).astype(np.int32).tobytes()
        assert len(self.encode(arr)) <= len(codec.encode(arr, level=0, chunk_bytes=64 * 1024))


class TestRaw(CodecContract):
    """min_saving=1.0 forces the raw codec: the contract must hold for it too."""

    expected_codec = codec.RAW

    def encode(self, data: bytes, **kw: object) -> bytes:
        return codec.encode(data, chunk_bytes=64 * 1024, min_saving=1.0, **kw)  # type: ignore[arg-type]

    def test_chunks_are_independent_lz4_blocks(self) -> None:
        info = codec.parse_header(self.encode(COMPRESSIBLE))
        assert info.chunk_sizes == () and info.body_offset + info.raw_size == len(self.encode(COMPRESSIBLE))


def test_incompressible_data_is_stored_raw() -> None:
    payload = codec.encode(NOISE)
    info = codec.parse_header(payload)
    assert info.codec == codec.RAW and codec.decode(payload) == NOISE
    assert len(payload) == len(NOISE) + info.body_offset


def test_checksum_detects_a_flipped_body_byte() -> None:
    payload = bytearray(codec.encode(NOISE))
    payload[-10] ^= 0xFF
    with pytest.raises(CodecError, match="checksum"):
        codec.decode(bytes(payload))


def test_header_lie_about_raw_size_is_rejected_before_allocating() -> None:
    payload = bytearray(codec.encode(COMPRESSIBLE, chunk_bytes=64 * 1024))
    struct.pack_into("<Q", payload, 8, 2**60)  # raw_size field
    with pytest.raises(CodecError):
        codec.decode(bytes(payload))


def test_truncated_payload_is_rejected() -> None:
    payload = codec.encode(COMPRESSIBLE)
    for cut in (0, 10, codec.HEADER_BYTES, len(payload) // 2, len(payload) - 1):
        with pytest.raises(CodecError):
            codec.decode(payload[:cut])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=4096), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=8))
def test_fuzzed_payloads_raise_codec_error_or_decode_exactly(data: bytes, flips: list[tuple[int, int]]) -> None:
    payload = bytearray(codec.encode(data * 3, chunk_bytes=4096))
    for pos, mask in flips:
        payload[pos % len(payload)] ^= mask
    try:
        out = codec.decode(bytes(payload))
    except CodecError:
        return
    # If a corrupted payload still decodes, the checksum guarantees it is the original.
    assert out == data * 3


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(blob: bytes) -> None:
    try:
        codec.decode(codec.MAGIC + blob)
    except CodecError:
        pass
    else:
        info = codec.parse_header(codec.MAGIC + blob)
        assert info.raw_size <= 255 * len(blob)


def test_already_compressed_formats_are_stored_raw_without_trying_lz4(monkeypatch) -> None:
    import lz4.block

    jpeg = b"\xff\xd8\xff\xe0" + b"\x00" * 50_000  # compressible bytes, but a JPEG by its magic
    calls = []
    real = lz4.block.compress
    monkeypatch.setattr(lz4.block, "compress", lambda *a, **k: calls.append(1) or real(*a, **k))
    payload = codec.encode(jpeg)
    assert codec.parse_header(payload).codec == codec.RAW and codec.decode(payload) == jpeg and calls == []
    wav = b"RIFF\x00\x00\x00\x00WAVE" + b"\x00" * 50_000  # RIFF, but not a compressed kind
    assert codec.parse_header(codec.encode(wav)).codec == codec.LZ4 and calls


@pytest.mark.parametrize("raw", [os.urandom(5000), b"\xff\xd8\xff" + os.urandom(5000), b"abc" * 4000, b""])
def test_encoded_parts_are_the_payload_and_a_raw_body_is_not_copied(raw: bytes) -> None:
    parts = codec.encode_parts(raw, chunk_bytes=4096, meta={"url": "u"})
    whole = codec.encode(raw, chunk_bytes=4096, meta={"url": "u"})
    assert bytes(parts) == whole and len(parts) == len(whole)
    assert parts.stored_checksum() == codec.checksum(whole)
    info = codec.parse_header(whole)
    assert (parts.codec, parts.checksum) == (info.codec, info.checksum)
    if parts.codec == codec.RAW:
        assert parts.body is raw  # written as it is (os.pwritev), never joined into a copy


def test_a_chunk_larger_than_lz4_takes_is_a_codec_error_not_an_overflow() -> None:
    # lz4.block takes C ints: without the guard this is an OverflowError, which nothing maps to "corrupt".
    with pytest.raises(CodecError, match="too large"):
        codec.decode_chunk(memoryview(b"\x00" * 16), 0, 16, 2**31)


def test_a_block_whose_first_chunk_does_not_compress_tries_lz4_on_no_other_chunk(monkeypatch) -> None:
    # Issue 36 item 2: a large incompressible block (an 8 MiB slice of a video or a tar of JPEGs)
    # spent 7.2 ms in LZ4 attempts thrown away; the first chunk now decides.
    calls = []
    real = lz4.block.compress
    monkeypatch.setattr(lz4.block, "compress", lambda *a, **k: calls.append(1) or real(*a, **k))
    noise = os.urandom(8 * 4096)
    payload = codec.encode(noise, chunk_bytes=4096)
    assert codec.parse_header(payload).codec == codec.RAW and codec.decode(payload) == noise
    assert len(calls) == 1
    # The choice it makes: compressible only past its first chunk is stored raw, and reads back exactly.
    mixed = os.urandom(4096) + b"\x00" * (7 * 4096)
    assert codec.parse_header(codec.encode(mixed, chunk_bytes=4096)).codec == codec.RAW
    # A block that compresses from its start is compressed whole; min_saving=0 tries every chunk.
    calls.clear()
    text = b"abc" * (8 * 4096 // 3)
    assert codec.parse_header(codec.encode(text, chunk_bytes=4096)).codec == codec.LZ4
    assert codec.decode(codec.encode(mixed, chunk_bytes=4096, min_saving=0.0)) == mixed


@pytest.mark.parametrize("kind", ["raw", "lz4"])
@pytest.mark.parametrize("meta", [None, {"dtype": "uint8", "shape": [3]}])
def test_a_placed_body_lies_at_its_memorys_place_in_a_line_and_decodes_the_same(kind: str, meta: dict | None) -> None:
    # codec.line_pad: spaces after the metadata put the body, in the file (a payload starts on a
    # line), at the place in a 64-byte line its bytes have in memory, so the kernel's copy of the
    # write is never one of `rep movsb`'s slow ones (native/lines.h).
    rng = np.random.default_rng(0)
    words = [b"tok%d " % w for w in range(300)]
    raws = [os.urandom(50_000 + i) if kind == "raw" else b"".join(words[w] for w in rng.integers(0, 300, 15_000))
            for i in range(16)]
    places = set()
    for raw in raws:
        enc = codec.encode_parts(raw, min_saving=0.05, meta=meta, placed=True)
        assert enc.codec == (codec.RAW if kind == "raw" else codec.LZ4)
        body_at = np.frombuffer(enc.body, dtype=np.uint8).ctypes.data
        assert len(enc.head) % 64 == body_at % 64
        places.add(len(enc.head) % 64)
        payload = bytes(enc)
        assert codec.decode(payload) == raw
        assert codec.parse_header(payload).meta == (meta or {})
        unplaced = codec.encode_parts(raw, min_saving=0.05, meta=meta)
        assert bytes(unplaced)[len(unplaced.head):] == payload[len(enc.head):]  # the same body
        assert len(enc.head) - len(unplaced.head) < 64
    assert len(places) > 1  # bodies at other places: the padding follows them


def test_small_bodies_and_full_metadata_get_no_padding() -> None:
    assert len(codec.encode_parts(os.urandom(1000), placed=True).head) == codec.HEADER_BYTES + 2
    big_meta = {"k": "x" * (codec.MAX_META_BYTES - 40)}
    enc = codec.encode_parts(os.urandom(100_000), meta=big_meta, placed=True, min_saving=1.0)
    assert len(enc.head) == len(codec.encode_parts(os.urandom(100_000), meta=big_meta, min_saving=1.0).head)

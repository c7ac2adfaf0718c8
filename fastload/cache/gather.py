"""Batch assembly: byte ranges of many cache payloads, checked and decoded into one buffer.

A dataset's ``read_batch`` turns its samples into *jobs*, one per cache payload
(block) the batch touches, each with the ranges of that payload's raw bytes it
needs and where they go in one writable output buffer. :func:`gather` then does,
for every job, what :meth:`fastload.cache.Cache.get` does for one key (read the
file, or its range of a pack file, check its size, its stored checksum, its header against the index, decode
LZ4, verify) and copies the ranges into place. A block that serves several
samples is read and decoded once.

Two implementations produce identical bytes and identical results:

* **native** - ``fastload._native`` (native/_native.c): ``pread`` and LZ4 decode
  straight into the output buffer, with the GIL released and the jobs split
  across a small thread pool. LZ4 and xxh3 are not linked into it; this module
  finds ``LZ4_decompress_safe`` and ``XXH3_64bits`` at run time in libraries that
  are already installed (:func:`_resolve`), binds them, and self-tests the result.
* **python** - the fallback below, used when the extension is not built, when
  binding or the self-test fails, or when ``FASTLOAD_PURE_PYTHON=1``
  (:func:`fastload.config.pure_python`, asked once, at import: :func:`_load`).

The output buffer may be any writable C-contiguous buffer: a numpy array, a
``bytearray``, or the numpy view of a pinned torch tensor (so a batch can be
assembled directly in a pinned slot of the device prefetcher).

Results, one per job, are the same from both: ``None`` when the ranges were
copied, ``("missing", message)`` when the payload file is gone,
``("corrupt", message)`` when a check failed (the caller drops the entry and
refetches it, as ``Cache.get`` does), or ``("oserror", errno)`` for any other
I/O error (the caller raises it). tests/unit/test_gather.py runs both on good
and corrupt payloads; native/fuzz.py fuzzes them against each other.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from fastload import codec
from fastload.config import pure_python
from fastload.errors import CodecError

__all__ = ["Job", "backend", "gather", "gather_native", "gather_rows", "gather_python", "info", "read_payload_file", "use_backend"]

Result = tuple[str, Any] | None


class Job(NamedTuple):
    """One payload of a batch and the ranges of its raw bytes to copy out.

    Attributes:
        path: The payload file.
        stored: Its size on disk, from the index.
        raw: Its decoded size, from the index.
        codec: ``codec.RAW`` or ``codec.LZ4``, from the index.
        checksum: xxh3_64 of the raw bytes, from the index.
        stored_checksum: xxh3_64 of the whole payload file, or None for entries
            written before it was recorded.
        copies: ``(src, length, dst)``: ``raw[src:src+length]`` goes to
            ``out[dst:dst+length]`` (byte offsets).
        offset: Where the payload starts in ``path`` when it is one of many in a
            pack file (exactly ``stored`` bytes are read there); None when the
            payload is the whole file.
    """

    path: str
    stored: int
    raw: int
    codec: int
    checksum: int
    stored_checksum: int | None
    copies: Sequence[tuple[int, int, int]]
    offset: int | None = None


# -- the pure-Python fallback ---------------------------------------------------------


def gather_python(jobs: Sequence[Job], out: Any, threads: int | None = None) -> list[Result]:
    """The fallback: :func:`gather` in Python, in the calling thread (``threads`` is ignored)."""
    view = _output(out).cast("B")
    _check_copies(jobs, len(view))
    results: list[Result] = []
    for job in jobs:
        try:
            payload = read_payload_file(job.path, job.stored, job.offset)
        except FileNotFoundError:
            results.append(("missing", "payload file is missing"))
            continue
        except OSError as err:
            results.append(("oserror", err.errno))
            continue
        try:
            _copy_out(payload, job, view)
        except CodecError as err:
            results.append(("corrupt", str(err)))
            continue
        results.append(None)
    return results


def read_payload_file(path: str, stored: int, offset: int | None) -> bytes:
    """A payload's bytes: the whole file, or ``stored`` bytes at ``offset`` of a pack
    (fewer at its end: a size mismatch, caught by the checks)."""
    if offset is None:
        with open(path, "rb") as f:
            return f.read()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts, got = [], 0
        while got < stored:
            part = os.pread(fd, stored - got, offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def _output(out: Any) -> memoryview:
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise BufferError("the output of gather must be a writable, C-contiguous buffer")
    return view


def _check_copies(jobs: Sequence[Job], out_len: int) -> None:
    # The same argument checks as the native parser, before any I/O.
    for job in jobs:
        for src, n, dst in job.copies:
            if min(src, n, dst) < 0 or src + n > job.raw:
                raise ValueError(f"copy of {n} B at {src} is outside the {job.raw} B payload")
            if dst + n > out_len:
                raise ValueError(f"copy of {n} B to {dst} is outside the {out_len} B output buffer")


def _copy_out(payload: bytes, job: Job, out: memoryview) -> None:
    """What Cache.get checks, in its order; then the ranges into ``out``."""
    if len(payload) != job.stored:
        raise CodecError(f"payload is {len(payload)} B, index says {job.stored} B")
    intact = job.stored_checksum is not None
    if intact and codec.checksum(payload) != job.stored_checksum:
        raise CodecError("stored checksum mismatch: the payload file changed on disk")
    info = codec.parse_header(payload)
    if info.checksum != job.checksum or info.raw_size != job.raw or info.codec != job.codec:
        raise CodecError("payload header disagrees with the index")
    copies = [c for c in job.copies if c[1]]
    pv = memoryview(payload)
    if info.codec == codec.RAW and intact:
        body = info.body_offset
        for src, n, dst in copies:
            out[dst : dst + n] = pv[body + src : body + src + n]
        return
    if not intact or (len(copies) == 1 and copies[0][:2] == (0, info.raw_size)):
        raw = codec.decode(payload, verify=not intact, info=info)
        for src, n, dst in copies:
            out[dst : dst + n] = raw[src : src + n]
        return
    # An intact LZ4 payload decodes to what was encoded (Cache.get skips the raw
    # checksum for it too), so only the chunks that hold a wanted range are decoded.
    offsets, raw_sizes, cb = info.chunk_offsets(), info.chunk_raw_sizes(), info.chunk_bytes
    chunks: dict[int, bytes] = {}
    for src, n, dst in copies:
        for i in range(src // cb, (src + n - 1) // cb + 1):
            part = chunks.get(i)
            if part is None:
                part = chunks[i] = codec.decode_chunk(pv, offsets[i], info.chunk_sizes[i], raw_sizes[i])
            lo, hi = max(src, i * cb), min(src + n, i * cb + raw_sizes[i])
            out[dst + lo - src : dst + hi - src] = part[lo - i * cb : hi - i * cb]


# -- the native path ------------------------------------------------------------------


def gather_native(jobs: Sequence[Job], out: Any, threads: int | None = None, *, _in_memory: bool = False) -> list[Result]:
    """:func:`gather` in C (raises RuntimeError when the extension is unavailable)."""
    native = _STATE["native"]
    if native is None:
        raise RuntimeError(f"fastload._native is unavailable: {_STATE['reason']}")
    _output(out).release()  # the same BufferError as the fallback (numpy's own is a ValueError)
    fn = native.gather_buffers if _in_memory else native.gather
    results: list[Result] = fn(jobs, out, _threads(jobs, threads))
    for i, res in enumerate(results):
        if res is None:
            continue
        if res[0] == "meta":  # checked, decoded and copied; the metadata is not "{}"
            results[i] = _check_meta(res[1])
        elif res[0] == "nomem":
            raise MemoryError(res[1])
    return results


def _check_meta(meta: bytes) -> Result:
    # codec.parse_header's JSON checks, for the metadata the C code does not parse.
    try:
        value = json.loads(meta.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return ("corrupt", f"payload metadata is not valid JSON: {err}")
    if not isinstance(value, dict):
        return ("corrupt", "payload metadata is not a JSON object")
    return None


# Asked once: os.cpu_count() cost ~25 us per call, a fifth of an 8 MiB block's read (cProfile).
_CPUS = os.cpu_count() or 1


def _threads(jobs: Sequence[Job], threads: int | None) -> int:
    if threads is not None:
        return max(1, threads)
    return _thread_count(len(jobs), sum(job.stored for job in jobs))


def _thread_count(njobs: int, stored: int) -> int:
    # A thread per 256 KiB of payload at most: waking one costs some microseconds,
    # as much as reading a few small payloads (benchmarks/native/bench.py).
    return max(1, min(_CPUS, 8, njobs, stored >> 18))


# -- choosing, resolving and self-testing -----------------------------------------------

_STATE: dict[str, Any] = {"native": None, "reason": "", "lz4": "", "lz4_partial": "", "xxh3": "", "xxh3_stream": "",
                          "backend": "python"}
# bind()'s order; XXH3_64bits_update_dispatch picks AVX2/AVX-512 as XXH3_64bits_dispatch does.
_XXH3_STREAM = (("XXH3_createState",), ("XXH3_freeState",), ("XXH3_64bits_reset",),
                ("XXH3_64bits_update_dispatch", "XXH3_64bits_update"), ("XXH3_64bits_digest",))
_LIBS: list[ctypes.CDLL] = []  # keep the resolved libraries loaded


def _module_file(name: str) -> list[str]:
    try:
        path = importlib.import_module(name).__file__
    except ImportError:
        return []
    return [path] if path else []


def _system_library(name: str, soname: str) -> list[str]:
    found = ctypes.util.find_library(name)
    return [found] if found else [soname]


def _resolve(symbols: Sequence[str], libraries: Sequence[str]) -> tuple[int, str]:
    """The address of the first of ``symbols`` exported by the first loadable of ``libraries``."""
    tried = []
    for path in libraries:
        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            tried.append(f"{path}: {err}")
            continue
        for symbol in symbols:
            try:
                fn = getattr(lib, symbol)
            except AttributeError:
                continue
            address = ctypes.cast(fn, ctypes.c_void_p).value
            if address:
                _LIBS.append(lib)
                return address, f"{symbol} from {path}"
        tried.append(f"{path}: exports none of {', '.join(symbols)}")
    raise OSError("; ".join(tried) or "no library to look in")


def _selftest(native: Any) -> None:
    """Gather a few payloads with both implementations; any difference disables native."""
    data = bytes(range(256)) * 40 + b"fastload" * 700  # 15,840 B: 4 LZ4 chunks
    jobs = []
    for payload in (codec.encode(data, chunk_bytes=4096, min_saving=0.0), codec.encode(data, min_saving=1.0)):
        info = codec.parse_header(payload)
        for stored_checksum in (codec.checksum(payload), None):
            for copies in ([(0, len(data), 0)], [(5000, 3000, 100), (0, 10, 4000)]):
                jobs.append(Job(payload, len(payload), len(data), info.codec, info.checksum, stored_checksum, copies))  # type: ignore[arg-type]
    for job in jobs:
        want, got = bytearray(len(data)), bytearray(len(data))
        _copy_out(job.path, job, memoryview(want))  # type: ignore[arg-type]
        result = native.gather_buffers([job], got, 1)
        if result != [None] or got != want:
            raise RuntimeError(f"self-test failed: result {result}, bytes equal: {got == want}")


def _load() -> None:
    """Pick the implementation once, at import (FASTLOAD_PURE_PYTHON: config.pure_python)."""
    if pure_python():
        _STATE["reason"] = "FASTLOAD_PURE_PYTHON is set"
        return
    try:
        _native: Any = importlib.import_module("fastload._native")
    except ImportError as err:
        _STATE["reason"] = f"the extension is not built ({err}); reinstall with a C compiler to build it"
        return
    try:
        lz4_addr, _STATE["lz4"] = _resolve(
            ["LZ4_decompress_safe"], _module_file("lz4.block._block") + _system_library("lz4", "liblz4.so.1")
        )
        # The dispatching variant picks AVX2/AVX-512 at run time, as xxhash's own does.
        xxh_addr, _STATE["xxh3"] = _resolve(
            ["XXH3_64bits_dispatch", "XXH3_64bits"],
            _module_file("xxhash._xxhash") + _system_library("xxhash", "libxxhash.so.0"),
        )
        # Optional: decodes a chunk only up to the last wanted byte (intact payloads).
        try:
            partial, _STATE["lz4_partial"] = _resolve(["LZ4_decompress_safe_partial"], [_STATE["lz4"].split(" from ", 1)[1]])
        except OSError:
            partial, _STATE["lz4_partial"] = 0, "not exported: wanted chunks are decoded in full"
        # Optional: xxh3's streaming form lets a large raw payload be read straight into the
        # output, hashed piece by piece (native/_native.c, direct_raw).
        where = _STATE["xxh3"].split(" from ", 1)[1]
        try:
            stream = [_resolve(names, [where])[0] for names in _XXH3_STREAM]
            _STATE["xxh3_stream"] = f"from {where}"
        except OSError:
            stream, _STATE["xxh3_stream"] = [], "not exported: large raw payloads are read into scratch and copied"
        _native.bind(lz4_addr, xxh_addr, partial, *stream)
        _selftest(_native)
    except TypeError as err:  # an extension built before jobs carried a pack offset
        _STATE["reason"] = f"the built extension is older than this fastload ({err}); rebuild it: pip install -e ."
        return
    except (OSError, RuntimeError, ValueError, CodecError) as err:
        _STATE["reason"] = f"LZ4/xxh3 could not be bound: {err}"
        return
    _STATE.update(native=_native, backend="native", reason="")


def backend() -> str:
    """``"native"`` or ``"python"``: what :func:`gather` uses."""
    return str(_STATE["backend"])


def info() -> dict[str, str]:
    """The backend, why native is not used (if it is not), and where LZ4/xxh3 came from."""
    return {k: str(_STATE[k]) for k in ("backend", "reason", "lz4", "lz4_partial", "xxh3", "xxh3_stream")}


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Use ``"native"`` or ``"python"`` inside the block (tests and benchmarks; not thread-safe)."""
    if name not in ("native", "python"):
        raise ValueError(f"backend {name!r} is not 'native' or 'python'")
    if name == "native" and _STATE["native"] is None:
        raise RuntimeError(f"fastload._native is unavailable: {_STATE['reason']}")
    before = _STATE["backend"]
    _STATE["backend"] = name
    try:
        yield
    finally:
        _STATE["backend"] = before


#: Samples of at least this many bytes are read straight into their own bytes object (filled).
FILL_MIN = 4 * 1024**2


def filled(size: int) -> tuple[bytes, Any] | None:
    """A new ``bytes`` of ``size`` bytes and a writable uint8 array over its data (CPython; None elsewhere).

    The caller fills the array before the bytes object is handed to anyone (nothing has
    hashed or seen it), then drops the array. Why: a large sample read into a batch buffer
    and then split into its bytes took two fresh allocations and one extra copy; a
    256 MB sample's fresh pages were zeroed twice (perf of a cold DataLoader epoch over
    4 x 256 MB: 32% of its CPU zeroing pages, 19% in user-space copies).
    """
    if codec.BYTES_DATA is None:
        return None
    data = bytes(size)  # calloc: the kernel's zero pages, faulted in as the read fills them
    into = (ctypes.c_char * size).from_address(id(data) + codec.BYTES_DATA)
    return data, np.frombuffer(memoryview(into), dtype=np.uint8)


def split(buffer: Any, spans: Sequence[tuple[int, int]]) -> list[bytes]:
    """``[bytes(view[start : start + size]) for start, size in spans]`` of ``buffer``'s bytes.

    Natively (the backend is native) the copies avoid `rep movsb`'s slow places (native/lines.h;
    a bytes object's memory lies in one for about a quarter of large samples) and, from 64 KiB in
    all, run without the GIL, so read threads copy at once.

    Raises:
        ValueError: A span lies outside the buffer.
    """
    if _STATE["backend"] == "native":
        return _STATE["native"].split(buffer, spans)  # type: ignore[no-any-return]
    view = memoryview(buffer).cast("B")
    for start, size in spans:
        if start < 0 or size < 0 or start + size > len(view):
            raise ValueError(f"split(): span ({start}, {size}) lies outside the buffer of {len(view)} bytes")
    return [bytes(view[start : start + size]) for start, size in spans]


def gather(jobs: Sequence[Job], out: Any, threads: int | None = None) -> list[Result]:
    """Check, decode and copy ranges of many payloads into ``out``; one result per job.

    Args:
        jobs: The payloads and their ranges (see :class:`Job`).
        out: A writable, C-contiguous buffer that every copy fits in.
        threads: Native threads for this call (default: one per 256 KiB of
            payload, up to the CPU count and 8). The fallback runs in the calling
            thread.

    Raises:
        ValueError: A copy lies outside its payload's raw size or the buffer
            (checked before any I/O).
        BufferError: ``out`` is read-only or not C-contiguous.
        MemoryError: Scratch space for decoding could not be allocated.

    >>> import numpy as np
    >>> out = np.zeros(4, dtype=np.uint8)
    >>> gather([], out)
    []
    """
    if _STATE["backend"] == "native":
        return gather_native(jobs, out, threads)
    return gather_python(jobs, out, threads)



#: A row's columns (fastload.read.located; native/_native.c's ROW_*): what a whole payload's job needs.
ROW_PATH, ROW_OFFSET, ROW_STORED, ROW_RAW, ROW_CODEC, ROW_CHECKSUM, ROW_STORED_CHECKSUM, ROW_HAS_STORED = range(8)
ROW_WIDTH = 8
ROW_WHOLE_FILE = 2**64 - 1  # ROW_OFFSET of a payload that is a whole file


def gather_rows(paths: list[bytes], rows: np.ndarray, picks: np.ndarray, dsts: np.ndarray, out: Any,
                threads: int | None = None) -> list[tuple[int, Result]]:
    """:func:`gather` of whole payloads given as rows of numbers: row ``picks[i]`` of ``rows``
    (uint64, :data:`ROW_WIDTH` columns, ``ROW_PATH`` an id + 1 into ``paths``) copied whole to
    byte ``dsts[i]`` of ``out``. Returns ``(i, result)`` for the picks that did not succeed.

    Why: a warm batch of small samples described by a Job each made several Python objects per
    sample, and at a million samples the entries they were made from sit in DRAM, not the CPU's
    caches (issue 31). Rows make none; the fallback builds the Jobs and runs :func:`gather_python`.
    """
    picks = np.ascontiguousarray(picks, dtype=np.int64)
    dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
    if _STATE["backend"] == "native":
        if threads is None:
            threads = _thread_count(len(picks), int(rows[picks, ROW_STORED].sum()))
        _output(out).release()
        failed: list[tuple[int, Result]] = _STATE["native"].gather_rows(paths, rows, picks, dsts, out, threads)
        for k, (i, res) in enumerate(failed):
            if res is not None and res[0] == "meta":
                failed[k] = (i, _check_meta(res[1]))
            elif res is not None and res[0] == "nomem":
                raise MemoryError(res[1])
        return [(i, res) for i, res in failed if res is not None]
    jobs = []
    for pick, dst in zip(picks.tolist(), dsts.tolist()):
        c = rows[pick].tolist()
        if not 0 < c[ROW_PATH] <= len(paths):
            raise ValueError(f"row {pick} names no path")
        jobs.append(Job(os.fsdecode(paths[c[ROW_PATH] - 1]), c[ROW_STORED], c[ROW_RAW], c[ROW_CODEC], c[ROW_CHECKSUM],
                        c[ROW_STORED_CHECKSUM] if c[ROW_HAS_STORED] else None, ((0, c[ROW_RAW], dst),),
                        None if c[ROW_OFFSET] == ROW_WHOLE_FILE else c[ROW_OFFSET]))
    return [(i, res) for i, res in enumerate(gather_python(jobs, out)) if res is not None]


_load()

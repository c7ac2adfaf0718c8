"""A remote .npy file's header, read without unpickling (ArrayDataset's items)."""

from __future__ import annotations

import io
import math

import numpy as np

from fastload.errors import DecodeError

#: The most of a file's head read to find its header.
HEADER_MAX = 64 * 1024


def parse_header(head: bytes, url: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """dtype, shape, fortran order and data offset of a .npy file; never unpickles."""
    buf = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(buf)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
    except (ValueError, EOFError) as err:
        raise DecodeError(f"{url}: not a valid .npy header ({err}); fix: write it with numpy.save") from err
    if dtype.hasobject:
        raise DecodeError(
            f"{url}: .npy holds Python objects (dtype {dtype}); fastload never unpickles remote bytes; "
            "fix: save a numeric or fixed-size string dtype"
        )
    return dtype, tuple(shape), bool(fortran), buf.tell()


def array_at(buf: memoryview, start: int, size: int, url: str) -> np.ndarray:
    """The array in the ``size``-byte .npy file at ``buf[start:]`` (a view of ``buf``, no copy)."""
    head = bytes(buf[start : start + min(size, HEADER_MAX)])
    dtype, shape, fortran, offset = parse_header(head, url)
    count = math.prod(shape)  # Python ints: no int64 wrap-around on a hostile shape
    if offset + count * dtype.itemsize != size:
        raise DecodeError(
            f"{url}: header says {shape} {dtype} but the payload is {size - offset} B; "
            "fix: rewrite it with numpy.save (the header disagrees with the data)"
        )
    arr = np.frombuffer(buf, dtype=dtype, offset=start + offset, count=count)
    return arr.reshape(shape, order="F" if fortran else "C")

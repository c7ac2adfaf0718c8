"""MosaicML Streaming's MDS shards (``index.json`` + ``shard.NNNNN.mds[.zstd]``), read in place.

The layout, as ``streaming.MDSWriter`` writes it (mosaicml-streaming 0.13,
``streaming/base/format/mds``): ``index.json`` holds ``{"version": 2, "shards": [...]}``,
each shard entry its ``column_names``, ``column_encodings``, ``column_sizes`` (a fixed
size, or null for a variable one), ``samples``, ``raw_data`` and, when compressed,
``zip_data`` (``{"basename", "bytes"}``) and ``compression`` (``"zstd:7"``). A sample is
``uint32 size`` per variable-size column, then each column's bytes in order; each
encoding decodes as streaming's own ``mds_decode`` does, so a sample is the dict
``streaming.StreamingDataset`` yields. The library itself is never imported.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import numpy as np

from fastload.config import Settings
from fastload.dataset import Transform
from fastload.errors import DecodeError
from fastload.formats._shards import Shard, ShardDataset, check_name, read_index

Decoder = Callable[[memoryview], Any]

_SCALARS = {name: np.dtype(name) for name in (
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32", "float64")}
# NDArray's codes (streaming's NDArray._int2value_dtype / _int2shape_dtype).
_ND_VALUE = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
             34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_ND_SHAPE = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}
_UNSAFE = {"pkl"}


def _pil(data: memoryview) -> Any:
    from PIL import Image

    width, height, mode_size = np.frombuffer(data[:12], "<u4").tolist()
    mode = bytes(data[12 : 12 + mode_size]).decode("utf-8")
    return Image.frombytes(mode, (width, height), bytes(data[12 + mode_size :]))


def _image_file(data: memoryview) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(bytes(data)))  # lazily decoded, as streaming returns it


def _scalar(dtype: np.dtype) -> Decoder:
    return lambda data: np.frombuffer(data, dtype)[0]


def _ndarray(config: str) -> Decoder:
    args = config.split(":") if config else []
    fixed_dtype = args[0] if args else None
    fixed_shape = tuple(int(d) for d in args[1].split(",")) if len(args) > 1 else None
    if fixed_dtype is not None and fixed_dtype not in _ND_VALUE.values():
        raise ValueError(f"dtype {fixed_dtype!r}")

    def decode(data: memoryview) -> np.ndarray:
        i = 0
        dtype = fixed_dtype
        if dtype is None:
            dtype, i = _ND_VALUE[data[0]], 1
        shape: Any = fixed_shape
        if shape is None:
            ndim, code = data[i] >> 2, data[i] & 3
            width = 1 << code
            shape = np.frombuffer(data[i + 1 : i + 1 + ndim * width], _ND_SHAPE[code])
            i += 1 + ndim * width
        return np.frombuffer(bytes(data[i:]), dtype).reshape(shape)

    return decode


def _parts(data: memoryview, at: int) -> list[memoryview]:
    """The parts of a list MDS writes: a uint32 count at ``at``, that many uint32 sizes, then the parts."""
    n = int(np.frombuffer(data[at : at + 4], "<u4")[0])
    sizes = np.frombuffer(data[at + 4 : at + 4 + 4 * n], "<u4").tolist()
    i, out = at + 4 + 4 * n, []
    for size in sizes:
        out.append(data[i : i + size])
        i += size
    return out


def _listed(element: Decoder) -> Decoder:
    def decode(data: memoryview) -> list[Any]:
        return [element(part) for part in _parts(data, 4)]  # the first 4 bytes are a placeholder

    return decode


def _jpeg_array(data: memoryview) -> list[Any]:
    return [_image_file(part) for part in _parts(data, 0)]


_DECODERS: dict[str, Decoder] = {
    "bytes": bytes,
    "str": lambda data: bytes(data).decode("utf-8"),
    "int": lambda data: int(np.frombuffer(data, "<i8")[0]),
    "str_int": lambda data: int(bytes(data).decode("utf-8")),
    "str_float": lambda data: float(bytes(data).decode("utf-8")),
    "str_decimal": lambda data: Decimal(bytes(data).decode("utf-8")),
    "pil": _pil,
    "jpeg": _image_file,
    "png": _image_file,
    "list[pil]": _listed(_pil),
    "list[jpeg]": _listed(_image_file),
    "list[png]": _listed(_image_file),
    "jpeg_array": _jpeg_array,
    "jpegarray": _jpeg_array,
    "json": lambda data: json.loads(bytes(data).decode("utf-8")),
    **{name: _scalar(dtype) for name, dtype in _SCALARS.items()},
}


def decoder(encoding: str) -> Decoder | None:
    """The decoder of MDS ``encoding`` (``"ndarray:float32:3,4"`` included), or None if fastload has none."""
    name, _, config = encoding.partition(":")
    if name == "ndarray":
        try:
            return _ndarray(config)
        except ValueError:
            return None
    return None if config else _DECODERS.get(name)


class MDSDataset(ShardDataset):
    """MosaicML Streaming (MDS) shards, read in place through the cache: point it at the folder
    ``streaming.MDSWriter`` wrote (its ``out``), local or remote.

    Args:
        url: The folder holding ``index.json`` (any fsspec URL), or ``index.json`` itself.
        transform: Applied on CPU to each sample dict.
        storage_options: fsspec options for the remote.
        settings: Cache settings.
        kept_bytes: Bytes of decoded cache blocks kept in memory per process (each DataLoader
            worker its own), so the next samples of a kept block are copies from memory; ``0``
            keeps none. Default :data:`fastload.read.blocks.DEFAULT_KEPT_BYTES` (256 MiB).
        refresh: Re-read ``index.json`` and re-check the shards' sizes and versions.

    A sample is the dict ``streaming.StreamingDataset`` yields: column name to value, each
    decoded as streaming decodes its encoding (``jpeg``/``png``/``pil`` give PIL images,
    ``ndarray`` numpy arrays, the scalar encodings numpy scalars, ``int`` a Python int).

    Raises:
        DecodeError: A column's encoding fastload cannot decode, a ``pkl`` column (remote bytes are
            never unpickled), or a shard whose size differs from ``index.json``'s
            (at construction); a sample's bytes that do not decode (when read).
        ConfigError: Compressed shards whose decompressor is not installed.
    """

    _format = "MDS"

    def __init__(self, url: str, *, transform: Transform | None = None,
                 storage_options: dict[str, Any] | None = None, settings: Settings | None = None,
                 refresh: bool = False, kept_bytes: int | str | None = None) -> None:
        root, index = read_index(url, settings, storage_options)
        index_url = root + "/index.json"
        entries = index.get("shards")
        if index.get("version") != 2 or not isinstance(entries, list):
            raise DecodeError(f"{index_url}: not an MDS index (version 2 with a 'shards' list); "
                              "fix: point at the folder streaming.MDSWriter wrote")
        shards: list[Shard] = []
        # Per shard: its column names, (fixed size or None) and encoding per column.
        self._columns: list[tuple[list[str], list[int | None], list[str]]] = []
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("format") != "mds":
                raise DecodeError(f"{index_url}: shard format {entry.get('format')!r} is not read by fastload.MDSDataset "
                                  "(only 'mds'); fix: write the dataset with streaming.MDSWriter")
            try:
                names, encodings, sizes = entry["column_names"], entry["column_encodings"], entry["column_sizes"]
                info = entry.get("zip_data") or entry["raw_data"]
                shard = Shard(check_name(info["basename"], index_url), int(entry["samples"]), int(info["bytes"]),
                              entry.get("compression") if entry.get("zip_data") else None)
            except (KeyError, TypeError, ValueError) as err:
                raise DecodeError(f"{index_url}: a shard entry lacks or garbles {err}; fix: point at the folder "
                                  "streaming.MDSWriter wrote, or rewrite the dataset") from err
            for name, encoding in zip(names, encodings):
                if encoding in _UNSAFE:
                    raise DecodeError(
                        f"{index_url}: column {name!r} has encoding {encoding!r}: reading it would unpickle remote "
                        "bytes, which fastload never does (a pickle can run any code); fix: rewrite the column as json "
                        "or bytes, or read it with streaming"
                    )
                if decoder(encoding) is None:
                    raise DecodeError(
                        f"{index_url}: column {name!r} has MDS encoding {encoding!r}, which fastload.MDSDataset does not "
                        "decode; fix: rewrite that column with a supported encoding "
                        f"({', '.join(sorted(_DECODERS))}, ndarray[:dtype[:shape]]), or read it with streaming"
                    )
            self._columns.append((list(names), list(sizes), list(encodings)))
            shards.append(shard)
        self._decoders = self._make_decoders()
        self._open_shards(root, shards, transform=transform, storage_options=storage_options, settings=settings,
                          refresh=refresh, kept_bytes=kept_bytes)

    def _make_decoders(self) -> list[list[Decoder]]:
        """Each shard's column decoders (shards written by one writer share one list)."""
        made: dict[tuple[str, ...], list[Decoder]] = {}
        out = []
        for _, _, encodings in self._columns:
            key = tuple(encodings)
            if key not in made:
                made[key] = [decoder(e) for e in encodings]  # type: ignore[misc]  # checked in __init__
            out.append(made[key])
        return out

    def _decode(self, data: memoryview, shard: int) -> dict[str, Any]:
        names, fixed, _ = self._columns[shard]
        decoders = self._decoders[shard]
        sizes, i = [], 0
        for size in fixed:
            if size is None:
                size = int(np.frombuffer(data[i : i + 4], "<u4")[0])
                i += 4
            sizes.append(size)
        if i + sum(sizes) != len(data):
            raise DecodeError(f"{self.items[shard].url}: MDS sample of {len(data)} B holds columns of {i + sum(sizes)} B; "
                              "fix: re-upload that shard")
        sample = {}
        for name, size, decode in zip(names, sizes, decoders):
            sample[name] = decode(data[i : i + size])
            i += size
        return sample

    def column_names(self) -> Sequence[str]:
        """The columns of the first shard, in the writer's order."""
        return list(self._columns[0][0])

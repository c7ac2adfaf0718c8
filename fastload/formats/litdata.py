"""LitData's optimized chunks (``index.json`` + ``chunk-*.bin``), read in place.

The layout, as ``litdata.optimize`` writes it with its default ``PyTreeLoader`` (litdata
0.2.76, ``litdata/streaming/item_loader.py`` and ``serializers.py``): ``index.json`` holds
``chunks`` (``filename``, ``chunk_size`` samples, ``chunk_bytes``) and ``config``:
``data_format`` (one serializer name per leaf of the sample, e.g. ``"int"``,
``"no_header_numpy:9"``) and ``data_spec`` (the sample's tree, torch's pytree
``treespec_dumps`` JSON). A sample is ``uint32 size`` per leaf, then each leaf's bytes;
leaves are decoded as litdata's serializers do and put back into the tree, so a sample
is what ``litdata.StreamingDataset`` yields. The library itself is never imported.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastload.config import Settings
from fastload.dataset import Transform
from fastload.errors import DecodeError
from fastload.formats._shards import Shard, ShardDataset, check_name, read_index

Decoder = Callable[[memoryview], Any]

# litdata.constants._NUMPY_DTYPES_MAPPING / _TORCH_DTYPES_MAPPING, by index; None: not plain data.
_NUMPY = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float16,
          np.float32, np.float64, np.complex64, np.complex128, np.bool_, None, None, None, None]
_TORCH = [torch.float32, torch.float32, torch.float64, torch.float64, torch.complex64, torch.complex64,
          torch.complex128, torch.complex128, torch.float16, torch.float16, torch.bfloat16, torch.uint8,
          torch.int8, torch.int16, torch.int16, torch.int32, torch.int32, torch.int64, torch.int64,
          torch.bool, torch.uint16]
_UNSAFE = {"pickle"}


def _numpy_dtype(code: str) -> np.dtype:
    dtype = _NUMPY[int(code)]
    if dtype is None:
        raise ValueError(code)
    return np.dtype(dtype)


def _tensor_of(raw: memoryview, dtype: torch.dtype) -> torch.Tensor:
    # A writable copy (one): torch.frombuffer over immutable bytes warns and shares them.
    return torch.frombuffer(bytearray(raw), dtype=dtype) if len(raw) else torch.empty((0,), dtype=dtype)


def _tensor(data: memoryview) -> torch.Tensor:
    code, rank = struct.unpack_from(">II", data, 0)
    shape = struct.unpack_from(f">{rank}I", data, 8)
    body = data[8 + 4 * rank :]
    if not len(body):
        return torch.empty(shape, dtype=_TORCH[code])
    return _tensor_of(body, _TORCH[code]).reshape(shape)


def _numpy(data: memoryview) -> np.ndarray:
    code, rank = np.frombuffer(data[:8], "<u4").tolist()
    dtype = _NUMPY[code]
    if dtype is None:
        raise DecodeError(f"numpy leaf of dtype code {code} holds Python objects; fastload never unpickles remote bytes")
    shape = np.frombuffer(data[8 : 8 + 4 * rank], "<u4").tolist()
    return np.frombuffer(data[8 + 4 * rank :], dtype).copy().reshape(shape)  # one copy: litdata's arrays are writable


def _pil(data: memoryview) -> Any:
    from PIL import Image

    width, height, mode_size = np.frombuffer(data[:12], "<u4").tolist()
    mode = bytes(data[12 : 12 + mode_size]).decode("utf-8")
    return Image.frombytes(mode, (width, height), bytes(data[12 + mode_size :]))


def _jpeg(data: memoryview) -> torch.Tensor:
    # litdata decodes JPEG to an RGB CHW uint8 tensor with torchvision (EXIF-rotated with Pillow);
    # fastload uses Pillow, the same libjpeg-turbo underneath, with the EXIF rotation applied too.
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(Image.open(io.BytesIO(bytes(data))))
    return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).contiguous()


_DECODERS: dict[str, Decoder] = {
    "int": lambda data: struct.unpack("<q", data)[0],
    "float": lambda data: struct.unpack("<d", data)[0],
    "bool": lambda data: data[0] != 0,
    "str": lambda data: bytes(data).decode("utf-8"),
    "bytes": bytes,
    "numpy": _numpy,
    "tensor": _tensor,
    "pil": _pil,
    "jpeg": _jpeg,
}


def decoder(data_format: str) -> Decoder | None:
    """The decoder of LitData serializer ``data_format`` (``"no_header_numpy:9"`` included), or None if fastload has none."""
    name, _, arg = data_format.partition(":")
    try:
        if name == "no_header_numpy":
            dtype = _numpy_dtype(arg)
            return lambda data: np.frombuffer(data, dtype).copy()
        if name == "no_header_tensor":
            tdtype = _TORCH[int(arg)]
            return lambda data: _tensor_of(data, tdtype)
    except (ValueError, IndexError):
        return None
    return None if arg else _DECODERS.get(name)


def _unflatten(spec: Any, leaves: list[Any], at: int, where: str) -> tuple[Any, int]:
    """The tree ``spec`` (a node of torch's pytree JSON) filled from ``leaves[at:]``, and the next leaf's index."""
    kind, children = spec.get("type"), spec.get("children_spec", [])
    if kind is None:
        return leaves[at], at + 1
    values = []
    for child in children:
        value, at = _unflatten(child, leaves, at, where)
        values.append(value)
    if kind == "builtins.dict":
        return dict(zip(json.loads(spec["context"]), values)), at
    if kind == "builtins.list":
        return values, at
    if kind == "builtins.tuple":
        return tuple(values), at
    raise DecodeError(f"{where}: sample tree holds a {kind!r}, which fastload.LitDataset does not rebuild; "
                      "fix: return dicts, lists and tuples from optimize's fn")


def _check_tree(spec: Any, where: str) -> int:
    """The number of leaves of ``spec``, every node kind checked now rather than at the first read."""
    kind = spec.get("type")
    if kind is None:
        return 1
    if kind not in ("builtins.dict", "builtins.list", "builtins.tuple"):
        raise DecodeError(f"{where}: sample tree holds a {kind!r}, which fastload.LitDataset does not rebuild; "
                          "fix: return dicts, lists and tuples from optimize's fn")
    return sum(_check_tree(child, where) for child in spec.get("children_spec", []))


class LitDataset(ShardDataset):
    """LitData chunks, read in place through the cache: point it at the folder ``litdata.optimize``
    wrote (its ``output_dir``), local or remote (``http://`` included, which litdata refuses).

    Args:
        url: The folder holding ``index.json`` (any fsspec URL), or ``index.json`` itself.
        transform: Applied on CPU to each sample.
        storage_options: fsspec options for the remote.
        settings: Cache settings.
        kept_bytes: Bytes of decoded cache blocks kept in memory per process (each DataLoader
            worker its own), so the next samples of a kept block are copies from memory; ``0``
            keeps none. Default :data:`fastload.read.blocks.DEFAULT_KEPT_BYTES` (256 MiB).
        refresh: Re-read ``index.json`` and re-check the chunks' sizes and versions.

    A sample is what ``litdata.StreamingDataset`` yields for it: the tree ``fn`` returned
    (dict, list, tuple or one leaf), ints and floats as Python numbers, strings, bytes,
    numpy arrays, torch tensors, PIL images (``pil``), JPEGs as RGB CHW uint8 tensors.

    Raises:
        DecodeError: A serializer fastload cannot decode (named with its leaf), ``pickle``
            leaves (remote bytes are never unpickled), compressed or encrypted chunks, or a chunk
            whose size differs from ``index.json``'s (at construction); bytes that do not
            decode (when read).
    """

    _format = "LitData"

    def __init__(self, url: str, *, transform: Transform | None = None,
                 storage_options: dict[str, Any] | None = None, settings: Settings | None = None,
                 refresh: bool = False, kept_bytes: int | str | None = None) -> None:
        root, index = read_index(url, settings, storage_options)
        where = root + "/index.json"
        config, chunks = index.get("config"), index.get("chunks")
        if not isinstance(config, dict) or not isinstance(chunks, list):
            raise DecodeError(f"{where}: not a LitData index ('config' and 'chunks'); fix: point at the folder "
                              "litdata.optimize wrote")
        loader = config.get("item_loader", "PyTreeLoader")
        if loader != "PyTreeLoader":
            raise DecodeError(f"{where}: chunks written for litdata's {loader}, which fastload.LitDataset does not read "
                              "(only PyTreeLoader, optimize's default); fix: optimize with the default item_loader")
        for key, fix in (("compression", "compression=None"), ("encryption", "no encryption"),
                         ("ipc_compression", "no ipc_compression")):
            if config.get(key):
                raise DecodeError(f"{where}: chunks use {key}={config[key]!r}, which fastload.LitDataset does not read; "
                                  f"fix: optimize with {fix} (fastload's cache compresses with LZ4 itself)")
        formats = config.get("data_format") or []
        spec_json = config.get("data_spec")
        try:
            tree = json.loads(spec_json)[1] if spec_json else {"type": None}
        except (ValueError, IndexError, TypeError, KeyError) as err:
            raise DecodeError(f"{where}: data_spec is not torch's pytree JSON ({err}); fix: rewrite the dataset "
                              "with litdata.optimize") from err
        if _check_tree(tree, where) != len(formats):
            raise DecodeError(f"{where}: data_spec has a different leaf count from data_format ({len(formats)}); "
                              "fix: rewrite the dataset with litdata.optimize")
        leaf_names = _leaf_names(tree, "")
        for leaf, data_format in zip(leaf_names, formats):
            if data_format in _UNSAFE:
                raise DecodeError(f"{where}: leaf {leaf!r} has serializer {data_format!r}: reading it would unpickle "
                                  "remote bytes, which fastload never does (a pickle can run any code); fix: return "
                                  "a supported type for it, or read it with litdata")
            if decoder(data_format) is None:
                raise DecodeError(
                    f"{where}: leaf {leaf!r} has LitData serializer {data_format!r}, which fastload.LitDataset does not "
                    f"decode; fix: return a supported type for it ({', '.join(sorted(_DECODERS))}, "
                    "no_header_numpy, no_header_tensor), or read it with litdata"
                )
        self._tree, self._formats, self._where = tree, list(formats), where
        self._decoders = self._make_decoders()
        try:
            shards = [Shard(check_name(c["filename"], where), int(c["chunk_size"]), int(c["chunk_bytes"])) for c in chunks]
        except (KeyError, TypeError, ValueError) as err:
            raise DecodeError(f"{where}: a chunk entry lacks or garbles {err}; fix: point at the folder "
                              "litdata.optimize wrote, or rewrite the dataset") from err
        self._open_shards(root, shards, transform=transform, storage_options=storage_options, settings=settings,
                          refresh=refresh, kept_bytes=kept_bytes)
        self._table(0)  # one chunk's head now: an Arrow-footer dataset is named here, not at the first batch

    def _check_table(self, shard: int, table: np.ndarray) -> None:
        # litdata (0.2.7x, pyarrow installed) stores dict samples of plain values (str, int, bytes...) as an
        # Arrow IPC footer only: every item is empty in the pytree body. Read as pytree they would all fail.
        if len(table) > 1 and self._decoders and table[-1] == table[0]:
            raise DecodeError(
                f"{self.items[shard].url}: LitData chunk holds its samples only as an Arrow IPC footer (litdata writes "
                "that for dict samples of plain str/int/bytes values when pyarrow is installed), which "
                "fastload.LitDataset does not read; fix: add an array or tensor leaf to the samples, or optimize "
                "without pyarrow installed, so the chunks are written as pytree items"
            )

    def _make_decoders(self) -> list[Decoder]:
        """One decoder per leaf, in ``data_format``'s order."""
        return [decoder(f) for f in self._formats]  # type: ignore[misc]  # checked in __init__

    def _decode(self, data: memoryview, shard: int) -> Any:
        n = len(self._decoders)
        sizes = struct.unpack_from(f"<{n}I", data, 0)
        i = 4 * n
        if i + sum(sizes) != len(data):
            raise DecodeError(f"{self.items[shard].url}: LitData sample of {len(data)} B holds leaves of "
                              f"{i + sum(sizes)} B; fix: re-upload that chunk")
        leaves = []
        for size, decode in zip(sizes, self._decoders):
            leaves.append(decode(data[i : i + size]))
            i += size
        return _unflatten(self._tree, leaves, 0, self._where)[0]


def _leaf_names(spec: Any, path: str) -> list[str]:
    """Each leaf's path in the sample tree (``"image"``, ``"0"``, ``"meta.label"``), for messages."""
    kind = spec.get("type")
    if kind is None:
        return [path or "<sample>"]
    children = spec.get("children_spec", [])
    keys = json.loads(spec["context"]) if kind == "builtins.dict" else list(range(len(children)))
    return [name for key, child in zip(keys, children) for name in _leaf_names(child, f"{path}.{key}" if path else str(key))]

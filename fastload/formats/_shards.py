"""Shards of samples stored back to back behind an offset table, read in place: the part MDS and LitData share.

Both MosaicML Streaming's MDS shards (``shard.00000.mds``) and LitData's chunks
(``chunk-0-0.bin``) are laid out alike::

    uint32 n | uint32 offsets[n + 1] (absolute, from the file's start) | ... | sample 0 | sample 1 | ...

and both folders carry an ``index.json`` naming each shard, its sample count and its
size. A :class:`ShardDataset` reads that index once (through the cache), lists the
shards as a URL list (so the folder need not be listable: plain HTTP works), and
reads a sample as one ranged read of its bytes through the cache; a batch is one
:func:`fastload.read.blocks.read_ranges` of every sample's range: blocks kept decoded in
memory are copied from, the rest read by one :meth:`Reader.read_into` and kept (a 20 KB
sample no longer costs a check and decode of its whole 8 MiB block, as TarDataset found).
A shard's offset table is read the first time one of its samples is read (a ranged read
of its head), or fetched ahead with the blocks of announced samples (fastload.read.ahead).

Words: a **shard** is one file of samples; its **table** is its offset table; a
**codec** is a whole-shard compression (MDS ``.mds.zstd`` and friends): such a shard
is read whole through the cache and decompressed in memory, the most recent few kept
per process (``_UNPACKED_KEEP``), since its samples cannot be reached by range.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.config import Settings, parse_size
from fastload.dataset import Transform, _CachedDataset
from fastload.errors import ConfigError, DecodeError
from fastload.read.ahead import Plan, RangesAhead
from fastload.read.blocks import DEFAULT_KEPT_BYTES, KeptBlocks, read_ranges
from fastload.read.reader import Reader

_UNPACKED_KEEP = 2  # decompressed shards kept per process: a sequential pass touches one at a time


@dataclass(frozen=True)
class Shard:
    """One shard as ``index.json`` describes it."""

    name: str  # file name beside index.json
    samples: int
    size: int  # bytes of the file as stored (compressed, for a codec)
    codec: str | None = None  # None: samples are read in place by range


def _decompressor(codec: str, url: str) -> Callable[[bytes], bytes]:
    """The function that inflates a whole shard compressed with ``codec`` (MDS names: zstd, gz, bz2, br, snappy)."""
    family = codec.split(":", 1)[0]
    try:
        if family == "gz":
            import gzip

            return gzip.decompress
        if family == "bz2":
            import bz2

            return bz2.decompress
        if family == "zstd":
            try:
                import zstd  # what mosaicml-streaming writes with

                return zstd.decompress  # type: ignore[no-any-return]
            except ImportError:
                import zstandard

                return zstandard.ZstdDecompressor().decompressobj().decompress  # type: ignore[no-any-return]
        if family == "br":
            import brotli

            return brotli.decompress  # type: ignore[no-any-return]
        if family == "snappy":
            import snappy

            return snappy.decompress  # type: ignore[no-any-return]
    except ImportError as err:
        module = {"zstd": "zstd", "br": "brotli", "snappy": "python-snappy"}[family]
        raise ConfigError(
            f"{url}: shards are compressed with {codec!r} and its decompressor is not installed ({err}); "
            f"fix: pip install {module}"
        ) from err
    raise ConfigError(
        f"{url}: shards are compressed with {codec!r}, which fastload cannot inflate; "
        "fix: rewrite the shards with compression=None, or with zstd, gz, bz2, br or snappy"
    )


def read_index(url: str, settings: Settings | None, storage_options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The folder URL (no trailing slash) and the parsed ``index.json`` at ``url`` (a folder, or the file itself)."""
    root = url.rstrip("/")
    if root.endswith("/index.json"):
        root = root[: -len("/index.json")]
    index_url = root + "/index.json"
    raw = Reader(settings, storage_options).read(index_url)
    try:
        obj = json.loads(raw)
    except ValueError as err:
        raise DecodeError(f"{index_url}: not valid JSON ({err}); fix: point at the folder the writer wrote") from err
    if not isinstance(obj, dict):
        raise DecodeError(f"{index_url}: expected a JSON object, got {type(obj).__name__}")
    return root, obj


def check_name(name: Any, index_url: str) -> str:
    """``name`` if it is a plain file name: a shard name from a remote index is never trusted as a path."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise DecodeError(f"{index_url}: shard name {name!r} is not a plain file name; fix: rewrite index.json")
    return name


class ShardDataset(RangesAhead, _CachedDataset):
    """Samples of offset-table shards, one per index; subclasses parse their ``index.json`` and decode samples.

    Subclasses call :meth:`_open_shards` from ``__init__`` and implement :meth:`_decode`.
    """

    _format = "shard"  # the format's name, for messages

    def _open_shards(self, root: str, shards: Sequence[Shard], *, transform: Transform | None,
                     storage_options: dict[str, Any] | None, settings: Settings | None, refresh: bool,
                     kept_bytes: int | str | None) -> None:
        self.root = root
        self.kept = KeptBlocks(DEFAULT_KEPT_BYTES if kept_bytes is None else parse_size(kept_bytes))
        self.shards = list(shards)
        if not self.shards:
            raise ConfigError(f"{root}/index.json names no shards; fix: point at the folder the writer wrote")
        # A missing decompressor is named before any shard is listed or fetched.
        self._inflate = {s.codec: _decompressor(s.codec, root) for s in self.shards if s.codec}
        super().__init__([f"{root}/{s.name}" for s in self.shards], None, transform=transform,
                         storage_options=storage_options, settings=settings, refresh=refresh)
        for shard, item in zip(self.shards, self.items):
            # A cut upload (or a shard rewritten since index.json) is named now, not met mid-epoch as
            # short reads: read_range would quietly return fewer bytes past the end.
            if item.size != shard.size:
                raise DecodeError(
                    f"{item.url}: {self._format} shard is {item.size} B but index.json says {shard.size} B "
                    "(truncated, or rewritten without its index); fix: re-upload that shard, or rewrite the dataset"
                )
        self._ends = np.cumsum([s.samples for s in self.shards]).tolist()
        self._len = int(self._ends[-1]) if self._ends else 0
        self._tables: dict[int, np.ndarray] = {}
        self._unpacked: OrderedDict[int, bytes] = OrderedDict()
        # fastload.DataLoader reads batches from several threads: one inflates a shard, the others wait for it.
        self._unpack_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Workers get settings, not decompressed shards or decoders (closures do not pickle under
        # spawn): each rebuilds them from the recorded encodings and re-reads what it needs.
        state = self.__dict__.copy()
        state["_tables"], state["_unpacked"], state["_inflate"], state["_decoders"] = {}, OrderedDict(), {}, None
        state["_unpack_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unpack_lock = threading.Lock()
        self._inflate = {s.codec: _decompressor(s.codec, self.root) for s in self.shards if s.codec}
        self._decoders = self._make_decoders()

    def _make_decoders(self) -> Any:
        """The decoders of this dataset's encodings, held in ``self._decoders`` (rebuilt in each worker)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self._len

    def _locate(self, index: int) -> tuple[int, int]:
        """(shard, sample within it) of sample ``index``."""
        if not -self._len <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples")
        index %= self._len
        shard = bisect.bisect_right(self._ends, index)
        return shard, index - (self._ends[shard - 1] if shard else 0)

    # -- shard heads and compressed shards ---------------------------------------------

    def _unpack(self, shard: int) -> bytes:
        """A compressed shard, whole and inflated (the last ``_UNPACKED_KEEP`` kept)."""
        with self._unpack_lock:
            data = self._unpacked.get(shard)
            if data is not None:
                self._unpacked.move_to_end(shard)
                return data
            spec, item = self.shards[shard], self.items[shard]
            inflate = self._inflate[spec.codec or ""]
            try:
                data = inflate(self.reader.read(item))
            except Exception as err:  # each decompressor has its own error type
                raise DecodeError(f"{item.url}: cannot inflate {spec.codec!r} shard ({err}); fix: re-upload that shard") from err
            self._unpacked[shard] = data
            while len(self._unpacked) > _UNPACKED_KEEP:
                self._unpacked.popitem(last=False)
            return data

    def _table(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s offset table (n + 1 absolute offsets), checked against its index entry."""
        table = self._tables.get(shard)
        if table is not None:
            return table
        spec, item = self.shards[shard], self.items[shard]
        n = spec.samples
        head_bytes = self._head_bytes(shard)
        if spec.codec:
            body = self._unpack(shard)
            head, size = body[:head_bytes], len(body)
        else:
            head, size = self._ranges([(item, 0, min(head_bytes, item.size))])[0], item.size
        if len(head) < head_bytes:
            raise DecodeError(f"{item.url}: {self._format} shard too short for its offset table ({len(head)} B); "
                              "fix: re-upload that shard")
        words = np.frombuffer(head, dtype="<u4")
        table = words[1:].astype(np.int64)
        if int(words[0]) != n or table[0] < head_bytes or np.any(np.diff(table) < 0) or table[-1] > size:
            raise DecodeError(
                f"{item.url}: {self._format} shard's offset table disagrees with index.json ({int(words[0])} samples "
                f"in the shard, {n} in the index; last offset {int(table[-1])} of {size} B); fix: re-upload that shard"
            )
        self._check_table(shard, table)
        self._tables[shard] = table
        return table

    def _head_bytes(self, shard: int) -> int:
        """Bytes of shard ``shard``'s head: its sample count and offset table."""
        return 4 * (self.shards[shard].samples + 2)

    def _check_table(self, shard: int, table: np.ndarray) -> None:
        """A format's own check of a shard's offset table (raise DecodeError); none by default."""

    # -- samples --------------------------------------------------------------------------

    def _decode(self, data: memoryview, shard: int) -> Any:
        """The sample in ``data`` (its bytes), as the format's own loader returns it."""
        raise NotImplementedError

    def _sample(self, data: memoryview, shard: int, offset: int) -> Any:
        try:
            sample = self._decode(data, shard)
        except DecodeError:
            raise
        except Exception as err:
            raise DecodeError(
                f"{self.items[shard].url}: sample at byte {offset} cannot be decoded ({type(err).__name__}: {err}); "
                "fix: re-upload or rewrite that shard"
            ) from err
        return self._apply(sample, self.items[shard].url)

    def _ranges(self, ranges: Sequence[tuple[Any, int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of each ``(item, start, end)``, as one batch through the kept blocks."""
        return read_ranges(self.reader, ranges, self.kept)

    def __getitem__(self, index: int) -> Any:
        return self._read([index])[0]

    def _ahead_plan(self, indices: Sequence[int], load: bool) -> Plan:
        """The ranges the samples at ``indices`` read (fastload.read.ahead): in place through the kept
        blocks, or a compressed shard whole (not inflated yet); with ``load``, tables not read yet are read."""
        ranged: list[tuple[Any, int, int]] = []
        whole: dict[int, tuple[Any, int, int]] = {}
        later: list[tuple[int, tuple[Any, int, int]]] = []
        for i in indices:
            shard, k = self._locate(i)
            item = self.items[shard]
            if self.shards[shard].codec:
                if shard not in self._unpacked:
                    whole[shard] = (item, 0, item.size)
                continue
            table = self._tables.get(shard)
            if table is None and not load:
                # Planned on a thread of fetch_ahead's once its head is in, never on the announcing one.
                later.append((i, (item, 0, min(self._head_bytes(shard), item.size))))
                continue
            table = self._table(shard) if table is None else table
            ranged.append((item, int(table[k]), int(table[k + 1])))
        return Plan(ranged, list(whole.values()), later)

    def read_batch(self, indices: Sequence[int]) -> list[Any]:
        """``[self[i] for i in indices]``, the in-place samples' bytes read as one batch (:meth:`_ranges`)."""
        if not self._own_getitem(ShardDataset):  # a subclass's own __getitem__ is honoured, one by one
            return super().read_batch(indices)
        return self._read(indices)

    def _read(self, indices: Sequence[int]) -> list[Any]:
        where = [self._locate(i) for i in indices]
        spans = []
        for shard, k in where:
            table = self._table(shard)
            spans.append((int(table[k]), int(table[k + 1])))
        ranged = [j for j, (shard, _) in enumerate(where) if not self.shards[shard].codec]
        got = self._ranges([(self.items[where[j][0]], spans[j][0], spans[j][1]) for j in ranged])
        datas = {j: memoryview(data) for j, data in zip(ranged, got)}
        out = []
        for j, (shard, _) in enumerate(where):
            start, end = spans[j]
            data = datas[j] if j in datas else memoryview(self._unpack(shard))[start:end]
            out.append(self._sample(data, shard, start))
        return out

"""Cached raw tensors (uint8 images, token ids, features): LZ4 payloads inflated on the device.

The cache stores an array file as LZ4 block chunks (``fastload.codec``) when
that saves space. :class:`CompressedArrayDataset` hands out those stored
payloads *as they are*, still compressed, and :class:`ArrayPipeline` turns a
batch of them into one tensor on the device:

* DALI on a GPU: the compressed chunks cross the link and ``fn.decoders.inflate``
  (nvCOMP) decompresses them on the GPU, all chunks of the batch in parallel;
  the array is then sliced out, viewed as its dtype, reshaped and cast there.
* Otherwise (no GPU, or the torch backend): LZ4 is decoded on host threads
  (python-lz4 releases the GIL), with the checksum verified, and the raw array
  bytes cross the link.

Integrity on the GPU path: nvCOMP does not report a corrupt chunk. DALI's
inflate hands nvCOMP per-chunk status buffers it never reads, and zero-fills any
output that comes out short, so a damaged chunk comes back as wrong bytes or
zeros, never as an error. So only checked payloads are fed: every cache read
verifies the xxh3 of the whole stored payload, and an entry written before that
checksum existed is decoded on the host once, raw checksum verified
(:meth:`fastload.cache.Cache.read_payload`); the header, the chunk table and every
size are checked on the host too (:meth:`ArrayPipeline._check`). A
:class:`Payload` built by hand is fed as it is.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastload import codec
from fastload.config import default_decode_threads, format_size
from fastload.dataset import ArrayDataset
from fastload.errors import CodecError, ConfigError
from fastload.pipelines import _common, _dali
from fastload.read.reader import Reader
from fastload.source import RemoteItem
from fastload.stats import current_collector

__all__ = ["ArrayPipeline", "CompressedArrayDataset", "Payload", "read_payload"]


@dataclass(frozen=True)
class Payload:
    """One stored cache payload (header + LZ4 chunks or raw body) and the array it holds.

    Attributes:
        url: The remote object it caches (for messages).
        data: The payload exactly as stored in the cache (``fastload.codec`` format).
        dtype: The array's dtype, as numpy spells it (``"uint8"``, ``"<f4"``...).
        shape: The array's shape.
        offset: Where the array starts in the raw bytes (the ``.npy`` header length).
    """

    url: str
    data: bytes
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the array itself."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def read_payload(reader: Reader, item: RemoteItem) -> bytes:
    """The stored payload of a one-block object, read from the cache without decoding it.

    A miss is fetched and stored through the reader first. The payload is checked
    as :meth:`fastload.cache.Cache.get` checks it (size, stored checksum, header);
    a bad one is dropped and fetched again once. When the cache cannot hold the
    object (streaming), a raw payload is built in memory.

    Raises:
        ConfigError: The object spans several cache blocks (raise FASTLOAD_BLOCK_SIZE).
    """
    cache = reader.cache
    if item.size > reader.settings.block_bytes:
        raise ConfigError(
            f"{item.url} is {format_size(item.size)}, more than one cache block "
            f"({format_size(reader.settings.block_bytes)}); compressed shipping needs one block per "
            "sample: raise FASTLOAD_BLOCK_SIZE, or use ArrayDataset (decoded on the host)"
        )
    key = reader.identity.key(item, 0)
    t0 = time.perf_counter()
    payload = cache.read_payload(key)  # checked as Cache.get checks it; a bad one is dropped
    if payload is not None:
        reader.record_hits(1, len(payload), t0)
        return payload
    data = reader.fetcher.fetch([(item, 0)])[0]  # a miss (counted there): fetched and stored
    # The payload as stored (its codec's choice), not counted again; none when streaming.
    payload = cache.read_payload(key)
    return payload if payload is not None else codec.encode(data, chunk_bytes=reader.settings.chunk_bytes, min_saving=1.0)


class CompressedArrayDataset(ArrayDataset):
    """One ``.npy`` file per sample, handed out still compressed, for :class:`ArrayPipeline`.

    A sample is ``{"payload": Payload, "url": str, "index": int}``. The dtype,
    shape and header length are learnt once from the first file (decoded on the
    host, once); every file must share them, which a batch needs anyway. A file
    that does not is reported by the pipeline (raise or skip), by its URL.

    Args:
        url, pattern, storage_options, settings, refresh: As :class:`fastload.ArrayDataset`.

    Raises:
        ConfigError: ``url`` is a single ``.npy`` file (rows of one array do not map
            onto cache payloads), a file spans several cache blocks, or the first
            array is Fortran-ordered.
    """

    def __init__(
        self,
        url: str,
        pattern: str | None = "**/*.npy",
        *,
        storage_options: dict[str, Any] | None = None,
        settings: Any = None,
        refresh: bool = False,
    ) -> None:
        super().__init__(url, pattern, storage_options=storage_options, settings=settings, refresh=refresh)
        if self.single:
            raise ConfigError(
                f"{url} is one .npy file; CompressedArrayDataset needs one .npy per sample "
                "(rows of one file are not separate cache payloads); use ArrayDataset"
            )
        block = self.reader.settings.block_bytes
        big = [i for i in self.items if i.size > block]
        if big:
            raise ConfigError(
                f"{len(big)} file(s), e.g. {big[0].url} ({format_size(big[0].size)}), exceed one cache "
                f"block ({format_size(block)}); raise FASTLOAD_BLOCK_SIZE or use ArrayDataset"
            )
        first = super().__getitem__(0)["data"]
        if first.ndim > 1 and not first.flags.c_contiguous:
            raise ConfigError(f"{self.items[0].url}: Fortran-ordered arrays are not supported here; save C-ordered")
        if not first.dtype.isnative:
            raise ConfigError(f"{self.items[0].url}: dtype {first.dtype.str} is not in native byte order; save it native")
        self.dtype = self.array_dtype = first.dtype
        self.shape = tuple(first.shape)
        self.offset = self.items[0].size - first.nbytes

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.items[index]
        payload = Payload(item.url, read_payload(self.reader, item), self.array_dtype.str, self.shape, self.offset)
        return {"payload": payload, "url": item.url, "index": index}


class ArrayPipeline:
    """Batch cached arrays into one tensor on the device; LZ4 payloads are inflated there.

    Called on a batch of samples (it is a ``collate_fn``), it returns
    ``{"data": tensor (B, *shape)}`` on ``device``, plus ``"label"``/``"index"``
    (int64 tensors) and ``"url"`` (a list) when the samples carry them.
    Samples are either ``{"payload": Payload, ...}`` (from
    :class:`CompressedArrayDataset`; shipped compressed) or ``{"data": ndarray,
    ...}`` (from ``ArrayDataset``/``TokenDataset``; already decoded on the host).

    Args:
        dtype: Cast the output to this torch dtype name (``"float16"``, ``"int64"``...);
            None keeps the stored dtype, bit for bit.
        device: Where outputs land; None picks ``cuda`` when available, else ``cpu``.
        backend: ``"dali"`` (GPU inflate with nvCOMP; on a CPU, host LZ4 then a DALI
            CPU pipeline), ``"torch"`` (host LZ4 decode), or ``"auto"``: DALI on a GPU
            when it imports, else torch.
        on_error: ``"raise"`` a DecodeError naming the sample's URL when a payload's
            header or sizes disagree (truncated, corrupt, another shape), or
            ``"skip"`` it and count ``decode_skipped``.
        threads: Host threads for LZ4 decoding (default: the usable cores).
        key, label_key: Fields of a decoded sample (``"data"``, ``"label"``).

    Example:
        >>> import numpy as np
        >>> from fastload.pipelines import ArrayPipeline
        >>> pipe = ArrayPipeline(dtype="float32", device="cpu", backend="torch")
        >>> out = pipe([{"data": np.arange(3, dtype=np.uint8)}, {"data": np.ones(3, np.uint8)}])
        >>> out["data"]
        tensor([[0., 1., 2.],
                [1., 1., 1.]])
    """

    def __init__(
        self,
        *,
        dtype: str | None = None,
        device: str | torch.device | None = None,
        backend: str = "auto",
        on_error: str = "raise",
        threads: int | None = None,
        key: str = "data",
        label_key: str = "label",
    ) -> None:
        self._config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.out_dtype: torch.dtype | None = None
        if dtype is not None:
            found = getattr(torch, str(dtype), None)
            if not isinstance(found, torch.dtype):
                raise ConfigError(f"dtype={dtype!r} is not a torch dtype name (e.g. 'float16', 'int64')")
            self.out_dtype = found
        self.device = _common.resolve_device(device)
        self.placement = "gpu" if self.device.type == "cuda" else "cpu"
        self.backend = _common.resolve_backend(backend, prefer_dali=self.placement == "gpu")
        self.threads = int(threads) if threads is not None else default_decode_threads()
        if self.threads < 1:
            raise ConfigError(f"threads={threads} must be >= 1")
        self.key, self.label_key = key, label_key
        self.on_error = on_error
        self.failures = _common.Failures(on_error, "ArrayPipeline")
        self._dali: _dali.DaliRunner | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._h2d = _common.HostToDevice(self.device)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._config)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"ArrayPipeline(dtype={self.out_dtype}, backend={self.backend}, device={self.device}, on_error={self.on_error!r})"

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        """Assemble one batch; see the class docstring."""
        _common.forbid_cuda_in_worker(self.device, "ArrayPipeline")
        t0 = time.perf_counter()
        payloads: list[tuple[int, Payload]] = []
        arrays: list[tuple[int, np.ndarray]] = []
        for i, sample in enumerate(samples):
            value = sample.get("payload") if isinstance(sample, Mapping) else None
            if isinstance(value, Payload):
                payloads.append((i, value))
            else:
                data = _common.field(sample, self.key, 0)
                if data is None:
                    raise ConfigError(f"sample {i} ({_common.sample_url(sample, i)}) has no {self.key!r} or 'payload' field")
                arrays.append((i, data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)))
        if payloads and arrays:
            raise ConfigError("a batch mixes compressed payloads and decoded arrays; use one dataset kind per loader")
        if payloads:
            data, kept, nbytes = self._payloads(payloads)
        else:
            data, kept, nbytes = self._arrays(arrays)
        if self.out_dtype is not None and data.dtype != self.out_dtype:
            data = data.to(self.out_dtype)
        out: dict[str, Any] = {"data": data}
        picked = [samples[i] for i in kept]
        if samples and all(isinstance(s, Mapping) for s in samples):
            for name, field_key in (("label", self.label_key), ("index", "index")):
                if all(field_key in s for s in samples):
                    out[name] = _common.labels_tensor([s[field_key] for s in picked], self.device)
            if all("url" in s for s in samples):
                out["url"] = [s["url"] for s in picked]
        elif samples and all(isinstance(s, (tuple, list)) and len(s) > 1 for s in samples):
            out["label"] = _common.labels_tensor([s[1] for s in picked], self.device)
        current_collector().add("decode", items=len(kept), bytes=nbytes, seconds=time.perf_counter() - t0)
        return out

    # -- decoded arrays -------------------------------------------------------------

    def _arrays(self, arrays: list[tuple[int, np.ndarray]]) -> tuple[torch.Tensor, list[int], int]:
        shapes = {(a.dtype.str, a.shape) for _, a in arrays}
        if len(shapes) > 1:
            raise ConfigError(f"arrays in one batch differ in dtype/shape: {sorted(shapes)[:3]}")
        batch = torch.from_numpy(np.stack([a for _, a in arrays]))
        return self._h2d(batch), [i for i, _ in arrays], batch.numel() * batch.element_size()

    # -- compressed payloads --------------------------------------------------------

    def _check(self, payloads: list[tuple[int, Payload]]) -> list[tuple[int, Payload, codec.PayloadInfo]]:
        """Parse every header on the host; a bad one is raised or skipped by its URL."""
        good = []
        for i, p in payloads:
            try:
                info = codec.parse_header(p.data)
            except CodecError as err:
                self.failures.bad(p.url, i, f"the payload is malformed or truncated: {err}", err)
                continue
            want = p.offset + p.nbytes
            if info.raw_size != want:
                self.failures.bad(
                    p.url,
                    i,
                    f"the payload header says {info.raw_size} B raw, but a {p.shape} {np.dtype(p.dtype).name} "
                    f"array after a {p.offset} B header needs {want} B",
                )
                continue
            good.append((i, p, info))
        layouts = {(p.dtype, p.shape, p.offset) for _, p, _ in good}
        if len(layouts) > 1:
            raise ConfigError(f"payloads in one batch hold different arrays (dtype, shape, header): {sorted(layouts)[:3]}")
        return good

    def _payloads(self, payloads: list[tuple[int, Payload]]) -> tuple[torch.Tensor, list[int], int]:
        good = self._check(payloads)
        compressed = sum(len(p.data) for _, p, _ in good)
        if not good:
            p0 = payloads[0][1]
            empty = torch.empty((0, *p0.shape), dtype=_torch_dtype(p0.dtype), device=self.device)
            return empty, [], 0
        p0 = good[0][1]
        if self.backend == "dali" and self.placement == "gpu":
            flat, kept = self._inflate_on_device(good)
        else:
            host, kept = self._decode_on_host(good)
            if self.backend == "dali":
                host = self._through_dali([host[j] for j in range(len(kept))])
            flat = self._h2d(host)
        data = flat.view(_torch_dtype(p0.dtype)).reshape(len(kept), *p0.shape)
        return data, kept, compressed

    def _decode_on_host(self, good: list[tuple[int, Payload, codec.PayloadInfo]]) -> tuple[torch.Tensor, list[int]]:
        """LZ4 (checksum verified) on threads, straight into one (B, array bytes) uint8 buffer."""
        p0 = good[0][1]
        out = torch.empty((len(good), p0.nbytes), dtype=torch.uint8)
        rows = out.numpy()

        def one(j: int) -> BaseException | None:
            _, p, info = good[j]
            try:
                raw = codec.decode(p.data, info=info)
            except CodecError as err:
                return err
            rows[j] = np.frombuffer(raw, dtype=np.uint8, count=p.nbytes, offset=p.offset)
            return None

        if self.threads > 1 and len(good) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastload-lz4")
            errors = list(self._pool.map(one, range(len(good))))
        else:
            errors = [one(j) for j in range(len(good))]
        kept = []
        for j, err in enumerate(errors):
            i, p, _ = good[j]
            if err is not None:
                self.failures.bad(p.url, i, f"the payload does not decode: {err}", err)
            else:
                kept.append(j)
        if len(kept) < len(good):
            out = out[kept]
        return out, [good[j][0] for j in kept]

    def _runner(self) -> _dali.DaliRunner:
        if self._dali is None:
            self._dali = _dali.DaliRunner(
                _dali.array_graph,
                {"placement": self.placement},
                device_index=self.device.index,
                threads=self.threads,
                seed=0,
            )
        return self._dali

    def _through_dali(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """The CPU placement of the DALI array graph (host-decoded bytes in, copied out by to_torch)."""
        (batch,) = self._runner().run({"payload": [r.numpy() for r in rows]})
        return _dali.to_torch(batch)

    def _inflate_on_device(self, good: list[tuple[int, Payload, codec.PayloadInfo]]) -> tuple[torch.Tensor, list[int]]:
        """LZ4 payloads inflated by nvCOMP on the GPU; raw ones (incompressible) copied as they are."""
        p0 = good[0][1]
        first = good[0][2]
        chunk = min(first.chunk_bytes, first.raw_size)
        on_gpu = [j for j, (_, _, info) in enumerate(good) if info.codec == codec.LZ4 and min(info.chunk_bytes, info.raw_size) == chunk]
        on_host = [j for j in range(len(good)) if j not in set(on_gpu)]
        parts: dict[int, torch.Tensor] = {}
        if on_gpu:
            # No per-sample error to catch here: nvCOMP reports no bad chunk (module
            # docstring), and the sizes DALI checks were checked by _check.
            feeds: dict[str, list[np.ndarray]] = {"payload": [], "offsets": [], "sizes": [], "shape": []}
            for j in on_gpu:
                _, p, info = good[j]
                feeds["payload"].append(np.frombuffer(p.data, dtype=np.uint8))
                feeds["offsets"].append(np.asarray(info.chunk_offsets(), dtype=np.int32))
                feeds["sizes"].append(np.asarray(info.chunk_sizes, dtype=np.int32))
                feeds["shape"].append(np.asarray([chunk], dtype=np.int32))
            (batch,) = self._runner().run(feeds)
            flat = _dali.to_torch(batch).reshape(len(on_gpu), -1)[:, p0.offset : p0.offset + p0.nbytes]
            parts.update(zip(on_gpu, flat))
        if on_host:
            host, kept_host = self._decode_on_host([good[j] for j in on_host])
            moved = self._h2d(host)
            pos_of = {good[j][0]: j for j in on_host}
            parts.update((pos_of[i], row) for i, row in zip(kept_host, moved))
        order = sorted(parts)
        return torch.stack([parts[j] for j in order]), [good[j][0] for j in order]

    def close(self) -> None:
        """Stop the decode threads and drop the DALI pipeline (both restart on the next call)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._dali = None


def _torch_dtype(numpy_dtype: str) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np.dtype(numpy_dtype).newbyteorder("="))).dtype

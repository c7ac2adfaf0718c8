"""One peer, two epochs: the process that bench.py starts inside the link's namespace.

``python peers.py run SPEC_JSON`` builds one loader (a peer's recommended setup
for 2 cores, batch 64), iterates it for ``epochs`` epochs (the first on an empty
cache: cold; the rest warm) and prints one JSON line: per epoch the seconds,
samples, delivered bytes and CPU seconds of the process tree (:func:`cpu_seconds`),
with epoch 1 also carrying the setup (listing, index download, local copy) that the
user pays before the first batch.

``python peers.py write SPEC_JSON`` writes a peer's own format with that peer's
own writer (WebDataset ``ShardWriter``, Streaming ``MDSWriter``, LitData
``optimize``).

It runs under two interpreters: the peers' venv (.venv-peers) for every peer but
fastload, and the project's venv for fastload. So only the standard library is
imported at the top; each peer imports its own packages.

Every Python peer decodes with the same function, :func:`decode_224` (Pillow:
decode, RGB, bilinear resize to 224x224, uint8 HWC). DALI cannot call Python in
its reader pipeline without giving up its own reader, so it uses its own CPU
decoder and resize; the results say so.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

BATCH = 64
SIDE = 224


def decode_224(jpeg: bytes) -> Any:
    """JPEG bytes -> 224x224x3 uint8 array (the shared decode of every Python peer)."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as im:
        return np.asarray(im.convert("RGB").resize((SIDE, SIDE), Image.BILINEAR))


def _measure(batch: Any, mode: str) -> tuple[int, int]:
    """(samples, delivered bytes) of one batch in the common dict-of-lists layout."""
    data = batch["data"]
    if mode == "decode":
        return int(data.shape[0]), int(data.numel())
    return len(data), sum(len(d) for d in data)


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Raw bytes stay a list; decoded arrays stack into one uint8 tensor; labels into a tensor."""
    import numpy as np
    import torch

    data = [s["data"] for s in samples]
    out = torch.from_numpy(np.stack(data)) if not isinstance(data[0], (bytes, bytearray, memoryview)) else data
    return {"data": out, "label": torch.tensor([int(s["label"]) for s in samples])}


def _http_listing(url: str) -> tuple[list[str], list[int]]:
    """Every JPEG under ``url`` (fsspec's HTTP listing) with ImageFolder labels."""
    import fsspec

    fs = fsspec.filesystem("http")
    urls = sorted(u for u in fs.find(url.rstrip("/") + "/") if u.endswith(".jpg"))
    classes = sorted({u.rsplit("/", 2)[-2] for u in urls})
    return urls, [classes.index(u.rsplit("/", 2)[-2]) for u in urls]


class _Files:
    """A map-style Dataset of URLs read with one fsspec call per sample (torch's pattern)."""

    def __init__(self, urls: list[str], labels: list[int], decode: bool, protocol: str, options: dict[str, Any]) -> None:
        self.urls, self.labels, self.decode = urls, labels, decode
        self.protocol, self.options = protocol, options

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import fsspec

        url = f"{self.protocol}::{self.urls[i]}" if self.protocol else self.urls[i]
        with fsspec.open(url, "rb", **self.options) as f:
            data = f.read()
        return {"data": decode_224(data) if self.decode else data, "label": self.labels[i]}


# -- peers: each returns (setup, epoch) where epoch(e) yields batches -------------------------


def peer_torch_fsspec(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
    """torch DataLoader over a Dataset that opens each file with fsspec (no cache)."""
    import torch

    urls, labels = _http_listing(spec["http_url"] + "/train")
    ds = _Files(urls, labels, spec["mode"] == "decode", "", {})
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=spec["workers"], collate_fn=_collate)
    return lambda epoch: loader


def _fsspec_cached(kind: str) -> Callable[[dict[str, Any]], Callable[[int], Iterable[Any]]]:
    def peer(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
        import torch

        urls, labels = _http_listing(spec["http_url"] + "/train")
        options = {kind: {"cache_storage": spec["cache_dir"]}}
        ds = _Files(urls, labels, spec["mode"] == "decode", kind, options)
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=spec["workers"], collate_fn=_collate)
        return lambda epoch: loader

    peer.__doc__ = f"torch DataLoader over fsspec '{kind}::' URLs (whole-file local cache)."
    return peer


def peer_webdataset(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
    """WebDataset over its own tar shards (HTTP), with cache_dir, through WebLoader."""
    import webdataset as wds

    shards = spec["wds_shards"]
    urls = f"{spec['http_url']}/wds/shard-{{000000..{shards - 1:06d}}}.tar"
    decode = spec["mode"] == "decode"

    def sample(s: dict[str, Any]) -> dict[str, Any]:
        return {"data": decode_224(s["jpg"]) if decode else s["jpg"], "label": int(s["cls"])}

    ds = (
        wds.WebDataset(urls, cache_dir=spec["cache_dir"], shardshuffle=False, empty_check=False)
        .map(sample)
        .batched(BATCH, collation_fn=_collate, partial=True)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=spec["workers"])
    return lambda epoch: loader


def _s3_env(spec: dict[str, Any]) -> None:
    os.environ.update({
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": spec["s3_endpoint"], "AWS_ENDPOINT_URL_S3": spec["s3_endpoint"],
        "S3_ENDPOINT_URL": spec["s3_endpoint"],  # Streaming's own variable
    })


def peer_streaming(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
    """MosaicML Streaming: StreamingDataset (MDS shards on S3, local cache) + StreamingDataLoader."""
    _s3_env(spec)
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    decode = spec["mode"] == "decode"

    class Images(StreamingDataset):  # Streaming's documented way to add a transform
        def __getitem__(self, idx: int) -> dict[str, Any]:
            s = super().__getitem__(idx)
            return {"data": decode_224(s["jpg"]) if decode else bytes(s["jpg"]), "label": s["cls"]}

    ds = Images(remote=f"s3://{spec['bucket']}/mds", local=spec["cache_dir"], batch_size=BATCH, shuffle=False)
    loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=spec["workers"], collate_fn=_collate)
    return lambda epoch: loader


def peer_litdata(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
    """LitData: StreamingDataset (optimize() chunks on S3, cache_dir) + StreamingDataLoader."""
    _s3_env(spec)
    import litdata

    decode = spec["mode"] == "decode"

    class Images(litdata.StreamingDataset):
        def __getitem__(self, index: Any) -> dict[str, Any]:
            s = super().__getitem__(index)
            return {"data": decode_224(s["jpg"]) if decode else bytes(s["jpg"]), "label": s["cls"]}

    options = {"endpoint_url": spec["s3_endpoint"], "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    # drop_last=False: LitData otherwise drops the last partial batch of each worker.
    ds = Images(f"s3://{spec['bucket']}/litdata", cache_dir=spec["cache_dir"], storage_options=options, drop_last=False)
    loader = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=spec["workers"], collate_fn=_collate)
    return lambda epoch: loader


def peer_dali(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
    """DALI fn.readers.file over a local copy (made with fsspec's parallel HTTP get), CPU only."""
    import fsspec
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    local = Path(spec["cache_dir"]) / "train"
    base = spec["http_url"] + "/train/"
    urls, _ = _http_listing(base)
    fsspec.filesystem("http").get(urls, [str(local / u[len(base):]) for u in urls])
    decode = spec["mode"] == "decode"

    @pipeline_def(batch_size=BATCH, num_threads=spec["workers"], device_id=None, prefetch_queue_depth=2)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=str(local), random_shuffle=False, pad_last_batch=True, name="Reader")
        if decode:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            return fn.resize(images, resize_x=SIDE, resize_y=SIDE), labels
        return jpegs, labels

    p = pipe()
    p.build()
    n = int(p.epoch_size("Reader"))

    def epoch(e: int) -> Iterator[dict[str, Any]]:
        left = n
        for _ in range(math.ceil(n / BATCH)):
            data, labels = p.run()
            k = min(BATCH, left)
            left -= k
            if decode:
                yield {"data": _Decoded(np.asarray(data.as_tensor())[:k])}
            else:
                yield {"data": [np.array(data[i]) for i in range(k)]}

    return epoch


class _Decoded:
    """Numpy batch with the two attributes _measure reads."""

    def __init__(self, arr: Any) -> None:
        self.arr = arr
        self.shape = arr.shape

    def numel(self) -> int:
        return int(self.arr.size)


def _fastload_settings(spec: dict[str, Any]) -> Any:
    from fastload.config import Settings

    return Settings(cache_dir=Path(spec["cache_dir"]))


def peer_fastload(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
    """fastload.DataLoader over fastload.FileDataset, cache read-through.

    ``workers`` 0 (the ``fastload`` peer) is the default: one process, the
    read_batch threads (one per CPU) read and run the transform. ``fastload_w2``
    passes ``num_workers=2``: torch worker processes call ``__getitem__``.
    """
    import fastload

    decode = spec["mode"] == "decode"
    settings = _fastload_settings(spec)
    url = spec["http_url"] + "/train/"
    if spec.get("stage"):
        fastload.stage(url, pattern="**/*.jpg", settings=settings, progress=False)
    ds = fastload.FileDataset(url, pattern="**/*.jpg", label="parent", settings=settings,
                              transform=decode_224 if decode else None)
    loader = fastload.DataLoader(ds, batch_size=BATCH, collate_fn=_collate, num_workers=spec["workers"])
    return lambda epoch: loader


def peer_fastload_uint8(spec: dict[str, Any]) -> Callable[[int], Iterable[Any]]:
    """fastload.ArrayDataset over one .npy (224x224x3 uint8) per sample; LZ4 in the cache."""
    import torch

    import fastload

    ds = fastload.ArrayDataset(spec["http_url"] + "/uint8/", settings=_fastload_settings(spec))

    def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        import numpy as np

        arr = torch.from_numpy(np.stack([s["data"] for s in samples]))
        return {"data": arr, "label": torch.zeros(len(samples), dtype=torch.int64)}

    loader = fastload.DataLoader(ds, batch_size=BATCH, collate_fn=collate)
    return lambda epoch: loader


PEERS: dict[str, Callable[[dict[str, Any]], Callable[[int], Iterable[Any]]]] = {
    "torch_fsspec": peer_torch_fsspec,
    "fsspec_simplecache": _fsspec_cached("simplecache"),
    "fsspec_filecache": _fsspec_cached("filecache"),
    "webdataset": peer_webdataset,
    "streaming": peer_streaming,
    "litdata": peer_litdata,
    "dali": peer_dali,
    "fastload": peer_fastload,
    "fastload_w2": peer_fastload,
    "fastload_stage": peer_fastload,
    "fastload_uint8": peer_fastload_uint8,
}


# Imported before the clock starts: interpreter and library start-up is not data loading.
# Each peer's library is imported before the clock starts. fastload's top level is lazy
# (`fastload.FileDataset` imports fastload.dataset on first use), so its modules are named
# here as the other peers' packages are; what a library imports on first contact with a
# store (aiohttp, on opening an HTTP filesystem) stays inside the timed setup, for every peer.
_FASTLOAD = ["fastload", "fastload.dataset", "fastload.loader.dataloader"]
_IMPORTS = {
    "webdataset": ["webdataset"], "streaming": ["streaming"], "litdata": ["litdata"], "dali": ["nvidia.dali"],
    "fastload": _FASTLOAD, "fastload_w2": _FASTLOAD, "fastload_stage": _FASTLOAD, "fastload_uint8": _FASTLOAD,
}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its descendants, live or exited.

    A live process counts its own time plus that of its children it has reaped
    (``children_user``/``children_system``, getrusage's RUSAGE_CHILDREN); a
    reaped worker's time is then in its parent's figures, never twice. So the
    workers of ``num_workers=2`` and any helper process a loader starts count.
    """
    try:
        import psutil
    except ImportError:  # the reaped children only
        import resource

        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    root = psutil.Process()
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import importlib

    for name in ["numpy", "PIL.Image", "torch", "fsspec", *_IMPORTS.get(spec["peer"], [])]:
        importlib.import_module(name)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    epoch_iter = PEERS[spec["peer"]](spec)
    setup_s, setup_cpu_s = time.perf_counter() - t0, cpu_seconds() - cpu0
    epochs: list[dict[str, Any]] = []
    budget = spec.get("epoch_budget_s") or math.inf
    limit: float = math.inf  # samples; a time-boxed cold epoch bounds the warm ones to what it cached
    for e in range(spec["epochs"]):
        t1 = time.perf_counter()
        samples = nbytes = batches = 0
        truncated = False
        for batch in epoch_iter(e):
            n, b = _measure(batch, "decode" if spec["mode"] == "decode" or spec["peer"] == "fastload_uint8" else "raw")
            samples += n
            nbytes += b
            batches += 1
            if samples >= limit or (e == 0 and time.perf_counter() - t1 > budget):
                truncated = True
                break
        if e == 0 and truncated:
            limit = samples
        cpu1 = cpu_seconds()
        epochs.append({"epoch": e + 1, "seconds": time.perf_counter() - t1, "samples": samples,
                       "delivered_bytes": nbytes, "batches": batches, "truncated": truncated,
                       "cpu_s": round(cpu1 - cpu0, 4)})  # epoch 1's includes the setup, as its seconds do
        cpu0 = cpu1
    epochs[0]["setup_s"], epochs[0]["setup_cpu_s"] = setup_s, round(setup_cpu_s, 4)
    out: dict[str, Any] = {"peer": spec["peer"], "mode": spec["mode"], "epochs": epochs}
    limits = sys.modules.get("fastload.transport.hostlimit")
    if limits is not None:  # the request limit fastload settled on (fastload peers only)
        out["concurrency"] = limits.settled()  # type: ignore[attr-defined]
    return out


# -- writers ------------------------------------------------------------------------------------


def _images(root: Path) -> list[tuple[Path, int]]:
    paths = sorted(root.rglob("*.jpg"))
    classes = sorted({p.parent.name for p in paths})
    return [(p, classes.index(p.parent.name)) for p in paths]


def _litdata_sample(item: tuple[str, int]) -> dict[str, Any]:
    return {"jpg": Path(item[0]).read_bytes(), "cls": int(item[1])}


def write(spec: dict[str, Any]) -> dict[str, Any]:
    """Writes the images under spec['images'] in spec['format'] to spec['out'] with the peer's own writer."""
    images, out = _images(Path(spec["images"])), Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if spec["format"] == "wds":
        import webdataset as wds

        with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=spec["per_shard"], verbose=0) as sink:
            for k, (path, label) in enumerate(images):
                sink.write({"__key__": f"{k:06d}", "jpg": path.read_bytes(), "cls": label})
    elif spec["format"] == "mds":
        from streaming import MDSWriter

        with MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}, progress_bar=False) as sink:
            for path, label in images:
                sink.write({"jpg": path.read_bytes(), "cls": label})
    elif spec["format"] == "litdata":
        import litdata

        litdata.optimize(fn=_litdata_sample, inputs=[(str(p), lab) for p, lab in images], output_dir=str(out),
                         chunk_bytes="64MB", num_workers=1, mode="overwrite", verbose=False)
    else:
        raise ValueError(f"unknown format {spec['format']!r}")
    files = [p for p in out.rglob("*") if p.is_file()]
    return {"format": spec["format"], "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("run", "write"):
        print("usage: peers.py run|write SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    out = run(spec) if argv[0] == "run" else write(spec)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

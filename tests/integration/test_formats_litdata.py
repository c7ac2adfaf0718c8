"""fastload.LitDataset against LitData's own writer and reader, over a local folder and nginx.

Chunks are written by ``litdata.optimize`` and every sample is compared with what
``litdata.StreamingDataset`` returns for it over the same local folder (litdata itself
refuses ``http://``). litdata is not in the test extra: it requires torchvision, and the
torchvision pip pulls beside the CPU torch cannot load its operators, which would change
what every other test sees. Those tests skip, saying so, where litdata is not installed;
the tests below them write chunks from the format's layout themselves and always run.
"""

from __future__ import annotations

import json
import multiprocessing
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastload
from fastload.config import Settings
from fastload.errors import DecodeError
from fastload.formats.litdata import LitDataset

pytestmark = pytest.mark.integration

N = 24
_JPEGS: list[str] = []  # the JPEG files the samples' "photo" leaves were read from (set by the fixture)


def _litdata() -> Any:
    try:
        import litdata
    except Exception as err:
        pytest.skip(f"litdata is not importable ({type(err).__name__}: {err}); it is not in the test extra "
                    "(it pulls a torchvision that cannot load beside the CPU torch); pip install litdata to run these")
    return litdata


def _image(i: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.RandomState(i).randint(0, 255, (5 + i % 4, 7, 3), np.uint8))


def make_sample(job: tuple[int, str]) -> dict[str, Any]:
    """One sample of every leaf type optimize serializes without a custom serializer (module level: optimize's
    spawned workers import it); ``job`` is the index and a JPEG file's path."""
    from PIL import Image

    i, jpeg = job
    return {
        "index": i, "name": f"item {i} é", "raw": bytes([i]) * (i + 1), "score": 0.125 * i, "flag": i % 2 == 0,
        "vec": np.arange(i + 1, dtype=np.float32), "grid": np.full((2, 3), i, np.int16),
        "t1": torch.arange(i + 2, dtype=torch.int64), "t2": torch.full((2, 2), float(i), dtype=torch.float16),
        "image": _image(i), "photo": Image.open(jpeg),
        "pair": (i, f"p{i}"), "nested": {"label": i * 3},
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """www/ds: N samples written by litdata.optimize in chunks of 5."""
    litdata = _litdata()
    base = tmp_path_factory.mktemp("litdata")
    for i in range(N):
        path = base / f"{i}.jpg"
        _image(i).save(path, format="JPEG", quality=90)
        _JPEGS.append(str(path))
    out = base / "www" / "ds"
    # optimize sets the process's start method to spawn for good; every later test (DataLoader workers) would inherit it.
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(fn=make_sample, inputs=list(enumerate(_JPEGS)), output_dir=str(out), chunk_size=5, num_workers=1)
    finally:
        multiprocessing.set_start_method(method, force=True)
    return base / "www"


def _settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", block_bytes=16 * 1024, retries=1, backoff_s=0.01, request_timeout_s=10)


def _same(x: Any, y: Any, where: str) -> None:
    """``x`` (fastload's) is ``y`` (litdata's): same type and value; litdata hands bytes leaves out as memoryviews."""
    if isinstance(y, memoryview):
        y = bytes(y)
    assert type(x) is type(y), (where, type(x), type(y))
    if isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), where
    elif isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), where
    elif isinstance(x, (dict, tuple, list)):
        assert len(x) == len(y), where
        pairs = [(x[k], y[k]) for k in x] if isinstance(x, dict) else list(zip(x, y))
        for k, (a, b) in enumerate(pairs):
            _same(a, b, f"{where}[{k}]")
    elif hasattr(x, "tobytes") and hasattr(x, "mode"):
        assert (x.mode, x.size, x.tobytes()) == (y.mode, y.size, y.tobytes()), where
    else:
        assert x == y, where


def _jpeg_decodes_in_litdata() -> bool:
    try:
        import torchvision.io  # noqa: F401  litdata decodes JPEG leaves with it
    except Exception:
        return False
    return True


def test_every_sample_matches_litdata_local_and_over_nginx(written: Path, tmp_path: Path, nginx_server: Callable) -> None:
    litdata = _litdata()
    from PIL import Image

    root = written / "ds"
    index = json.loads((root / "index.json").read_text())
    assert len(index["chunks"]) == 5 and "jpeg" in index["config"]["data_format"]
    ref = litdata.StreamingDataset(str(root))
    server = nginx_server(written)
    for url in (str(root), f"{server.url}/ds"):
        ds = LitDataset(url, settings=_settings(tmp_path))
        assert len(ds) == len(ref) == N
        order = list(np.random.RandomState(1).permutation(N))
        batch = dict(zip(order, ds.read_batch(order)))
        for i in range(N):
            want = ref[i] if _jpeg_decodes_in_litdata() else None
            for got in (ds[i], batch[i]):
                photo = got["photo"]  # RGB CHW uint8, as litdata decodes a JPEG leaf
                decoded = np.asarray(Image.open(_JPEGS[i]).convert("RGB"))
                assert photo.dtype == torch.uint8 and np.array_equal(photo.permute(1, 2, 0).numpy(), decoded)
                if want is None:  # litdata cannot decode its JPEG leaves here: compare the rest with a JPEG-free read
                    continue
                assert list(got) == list(want)
                _same(got, want, f"{url} sample {i}")
        if not _jpeg_decodes_in_litdata():
            _compare_without_jpeg(litdata, root, ds)


def _compare_without_jpeg(litdata: Any, root: Path, ds: LitDataset) -> None:
    """Every leaf but the JPEG one against litdata, through a copy of the index that reads the JPEG leaf as bytes."""
    copy = root.parent / "ds-bytes"
    if not copy.exists():
        copy.mkdir()
        for chunk in root.glob("chunk-*.bin"):
            (copy / chunk.name).symlink_to(chunk)
        index = json.loads((root / "index.json").read_text())
        index["config"]["data_format"] = ["bytes" if f == "jpeg" else f for f in index["config"]["data_format"]]
        (copy / "index.json").write_text(json.dumps(index))
    ref = litdata.StreamingDataset(str(copy))
    for i in range(N):
        want, got = ref[i], ds[i]
        assert list(got) == list(want)
        for name in want:
            if name != "photo":
                _same(got[name], want[name], f"sample {i} leaf {name}")


def test_through_fastload_dataloader_with_workers(written: Path, tmp_path: Path, nginx_server: Callable) -> None:
    server = nginx_server(written)
    ds = fastload.LitDataset(f"{server.url}/ds/", settings=_settings(tmp_path))
    # spawn: the dataset crosses into the workers pickled (its decoders rebuilt there), as under Python 3.14's default.
    loader = fastload.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list, multiprocessing_context="spawn")
    got = [sample for batch in loader for sample in batch]
    assert [s["index"] for s in got] == list(range(N))
    assert [s["nested"]["label"] for s in got] == [3 * i for i in range(N)]
    assert all(torch.equal(s["t1"], torch.arange(i + 2)) for i, s in enumerate(got))


def test_unsupported_serializer_is_named_at_construction(written: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    for chunk in (written / "ds").glob("chunk-*.bin"):
        (root / chunk.name).symlink_to(chunk)
    index = json.loads((written / "ds" / "index.json").read_text())
    formats = index["config"]["data_format"]
    formats[formats.index("pil")] = "video"
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(DecodeError, match=r"leaf 'image' has LitData serializer 'video'.*fix:"):
        LitDataset(str(root), settings=_settings(tmp_path))


# -- chunks written from the layout (no library needed) --------------------------------------


def _write_spec(out: Path, rows: list[tuple[int, str]], per_chunk: int = 4, config: dict[str, Any] | None = None) -> None:
    """A LitData folder as optimize lays it out for samples ``{"id": int, "text": str}``: index.json, and
    chunks of ``uint32 n | uint32 offsets[n+1] | samples``, each sample ``uint32 size per leaf | leaves``."""
    out.mkdir(parents=True)
    spec = [1, {"type": "builtins.dict", "context": json.dumps(["id", "text"]),
                "children_spec": [{"type": None, "context": None, "children_spec": []}] * 2}]
    chunks = []
    for c in range(0, len(rows), per_chunk):
        samples = []
        for ident, text in rows[c : c + per_chunk]:
            leaves = [struct.pack("<q", ident), text.encode()]
            samples.append(struct.pack("<2I", *map(len, leaves)) + b"".join(leaves))
        offsets = np.cumsum([4 + 4 * (len(samples) + 1)] + [len(s) for s in samples]).astype("<u4")
        data = struct.pack("<I", len(samples)) + offsets.tobytes() + b"".join(samples)
        name = f"chunk-0-{c // per_chunk}.bin"
        (out / name).write_bytes(data)
        chunks.append({"chunk_bytes": len(data), "chunk_size": len(samples), "dim": None, "filename": name})
    cfg = {"chunk_bytes": None, "chunk_size": per_chunk, "compression": None, "data_format": ["int", "str"],
           "data_spec": json.dumps(spec), "encryption": None, "item_loader": "PyTreeLoader", **(config or {})}
    (out / "index.json").write_text(json.dumps({"chunks": chunks, "config": cfg}))


def test_spec_written_chunks_decode_locally_and_over_nginx(tmp_path: Path, nginx_server: Callable) -> None:
    rows = [(i * 11, f"text {i}") for i in range(10)]
    _write_spec(tmp_path / "www" / "ds", rows)
    server = nginx_server(tmp_path / "www")
    for url in (str(tmp_path / "www" / "ds"), f"{server.url}/ds/index.json"):
        ds = LitDataset(url, settings=_settings(tmp_path))
        assert len(ds) == 10 and len(ds.shards) == 3
        assert [ds[i] for i in range(10)] == [{"id": a, "text": b} for a, b in rows]
        assert ds.read_batch([9, 0, 4]) == [{"id": 99, "text": "text 9"}, {"id": 0, "text": "text 0"},
                                            {"id": 44, "text": "text 4"}]


def test_compressed_chunks_are_refused_with_the_fix(tmp_path: Path) -> None:
    _write_spec(tmp_path / "ds", [(1, "a")], config={"compression": "zstd"})
    with pytest.raises(DecodeError, match=r"compression='zstd'.*fix: optimize with compression=None"):
        LitDataset(str(tmp_path / "ds"), settings=_settings(tmp_path))


def test_truncated_chunk_is_an_error_not_wrong_data(tmp_path: Path, nginx_server: Callable) -> None:
    root = tmp_path / "www" / "ds"
    _write_spec(root, [(i, "x" * i) for i in range(8)])
    chunk = root / "chunk-0-1.bin"
    chunk.write_bytes(chunk.read_bytes()[:-3])
    server = nginx_server(tmp_path / "www")
    for k, url in enumerate((str(root), f"{server.url}/ds")):
        with pytest.raises(DecodeError, match=r"chunk-0-1\.bin: LitData shard is \d+ B but index.json says \d+ B"):
            LitDataset(url, settings=_settings(tmp_path / str(k)))


def test_a_sample_whose_sizes_disagree_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _write_spec(root, [(i, "abc") for i in range(4)])
    chunk = root / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    first = struct.unpack_from("<I", data, 4)[0]
    data[first + 4 : first + 8] = struct.pack("<I", 2)  # sample 0 says its text is 2 B; it is 3
    chunk.write_bytes(bytes(data))
    ds = LitDataset(str(root), settings=_settings(tmp_path))
    assert ds[1] == {"id": 1, "text": "abc"}
    with pytest.raises(DecodeError, match=r"LitData sample of \d+ B holds leaves of \d+ B"):
        ds[0]

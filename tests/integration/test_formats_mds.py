"""fastload.MDSDataset against MosaicML Streaming's own writer and reader, over a local folder and nginx.

Shards are written by ``streaming.MDSWriter`` and every sample is compared with what
``streaming.StreamingDataset`` returns for it over the same local folder. mosaicml-streaming
is not in the test extra (it pins numpy<2.2, transformers<5 and xxhash<4, and pulls cloud
SDKs the resolver cannot fit beside the rest): those tests skip, saying so, where it is
not installed. The tests below them write shards from the format's layout themselves
(``_write_spec``) and always run.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastload
from fastload.config import Settings
from fastload.errors import ConfigError, DecodeError
from fastload.formats.mds import MDSDataset
from fastload.read.blocks import DEFAULT_KEPT_BYTES

pytestmark = pytest.mark.integration

COLUMNS = {
    "b": "bytes", "s": "str", "i": "int", "f32": "float32", "f64": "float64", "i32": "int32", "i64": "int64",
    "u8": "uint8", "a": "ndarray", "af": "ndarray:float32:2,3", "p": "pil", "j": "jpeg", "png": "png",
    "js": "json", "si": "str_int", "lj": "list[jpeg]",
}
N = 40


def _streaming() -> Any:
    """mosaicml-streaming, imported; its vision datasets (which need torchvision) are stubbed where torchvision is
    missing: MDS reading and writing use none of them."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        if "streaming" not in sys.modules:
            vision = types.ModuleType("streaming.vision")
            vision.__path__ = []  # type: ignore[attr-defined]
            sys.modules.setdefault("streaming.vision", vision)
    try:
        import streaming
    except Exception as err:  # ImportError, or a dependency that fails to load
        pytest.skip(f"mosaicml-streaming is not importable ({type(err).__name__}: {err}); it is not in the test extra "
                    "(it pins numpy<2.2); to run these: pip install --no-deps mosaicml-streaming, then "
                    "pip install zstd catalogue transformers")
    return streaming


def _image(i: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.RandomState(i).randint(0, 255, (6 + i % 3, 9, 3), np.uint8))


def _row(i: int) -> dict[str, Any]:
    img = _image(i)
    return {
        "b": bytes([i % 256]) * i, "s": f"sample {i} é", "i": i * 10**10, "f32": 0.5 * i, "f64": 0.25 * i,
        "i32": -i, "i64": i, "u8": i % 256, "a": np.arange(i + 1, dtype=np.int16).reshape(1, -1),
        "af": np.full((2, 3), i, np.float32), "p": img, "j": img, "png": img, "js": {"x": [i, None]},
        "si": 10**30 + i, "lj": [img, _image(i + 1)],
    }


def _same(x: Any, y: Any, where: str) -> None:
    """``x`` (fastload's) is ``y`` (streaming's): same type and value."""
    assert type(x) is type(y), (where, type(x), type(y))
    if isinstance(x, (np.ndarray, np.generic)):
        assert x.dtype == y.dtype and np.shape(x) == np.shape(y) and np.array_equal(x, y), where
    elif isinstance(x, list):
        assert len(x) == len(y), where
        for k, (a, b) in enumerate(zip(x, y)):
            _same(a, b, f"{where}[{k}]")
    elif hasattr(x, "tobytes") and hasattr(x, "mode"):  # a PIL image: pixels decoded, compared
        assert (x.mode, x.size, x.tobytes()) == (y.mode, y.size, y.tobytes()), where
    else:
        assert x == y, where


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """www/plain and www/zstd: the same rows, written by streaming.MDSWriter, uncompressed and zstd."""
    streaming = _streaming()
    www = tmp_path_factory.mktemp("mds") / "www"
    for compression in (None, "zstd"):
        out = www / (compression or "plain")
        with streaming.MDSWriter(out=str(out), columns=COLUMNS, compression=compression, size_limit=6000) as writer:
            for i in range(N):
                writer.write(_row(i))
    return www


def _settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", block_bytes=16 * 1024, retries=1, backoff_s=0.01, request_timeout_s=10)


@pytest.mark.parametrize("folder", ["plain", "zstd"])
def test_every_sample_matches_streaming_local_and_over_nginx(
    written: Path, folder: str, tmp_path: Path, nginx_server: Callable
) -> None:
    streaming = _streaming()
    root = written / folder
    assert len(json.loads((root / "index.json").read_text())["shards"]) > 3  # several shards, crossed below
    ref = streaming.StreamingDataset(local=str(root), shuffle=False, batch_size=1)
    server = nginx_server(written)
    for url in (str(root), f"{server.url}/{folder}"):
        ds = MDSDataset(url, settings=_settings(tmp_path))
        assert len(ds) == len(ref) == N
        order = list(np.random.RandomState(0).permutation(N))
        batch = dict(zip(order, ds.read_batch(order)))
        for i in range(N):
            want = ref[i]
            for got in (ds[i], batch[i]):
                assert list(got) == list(want)
                for name in want:
                    _same(got[name], want[name], f"{url} sample {i} column {name}")


def test_through_fastload_dataloader_with_workers(written: Path, tmp_path: Path, nginx_server: Callable) -> None:
    streaming = _streaming()
    ref = streaming.StreamingDataset(local=str(written / "plain"), shuffle=False, batch_size=1)
    server = nginx_server(written)
    ds = fastload.MDSDataset(f"{server.url}/plain/", settings=_settings(tmp_path))
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
    got = [sample for batch in loader for sample in batch]
    assert len(got) == N
    for i, sample in enumerate(got):
        for name in ("s", "i", "a", "p"):
            _same(sample[name], ref[i][name], f"sample {i} column {name}")


# -- shards written from the layout (no library needed) -------------------------------------


def _write_spec(out: Path, columns: dict[str, str], rows: list[dict[str, bytes]], per_shard: int = 3) -> None:
    """An MDS folder as MDSWriter lays it out: index.json, and shards of ``uint32 n | uint32 offsets[n+1] | samples``.
    ``rows`` hold each column's encoded bytes; every column is variable-size."""
    out.mkdir(parents=True)
    shards = []
    for s in range(0, len(rows), per_shard):
        samples = [struct.pack(f"<{len(columns)}I", *(len(r[c]) for c in columns)) + b"".join(r[c] for c in columns)
                   for r in rows[s : s + per_shard]]
        head = 4 + 4 * (len(samples) + 1)
        offsets = np.cumsum([head] + [len(x) for x in samples]).astype("<u4")
        data = struct.pack("<I", len(samples)) + offsets.tobytes() + b"".join(samples)
        name = f"shard.{s // per_shard:05d}.mds"
        (out / name).write_bytes(data)
        shards.append({"column_encodings": list(columns.values()), "column_names": list(columns),
                       "column_sizes": [None] * len(columns), "compression": None, "format": "mds", "hashes": [],
                       "raw_data": {"basename": name, "bytes": len(data), "hashes": {}}, "samples": len(samples),
                       "size_limit": None, "version": 2, "zip_data": None})
    (out / "index.json").write_text(json.dumps({"shards": shards, "version": 2}))


def _spec_rows(n: int) -> list[dict[str, bytes]]:
    return [{"text": f"row {i}".encode(), "n": np.int64(i * 7).tobytes(),
             # ndarray: dtype code 34 (float32), then ndim 2 << 2 | shape dtype 0 (uint8), the shape, the values
             "arr": bytes([34, 2 << 2, 2, 2]) + (np.arange(4, dtype=np.float32) + i).tobytes()} for i in range(n)]


SPEC_COLUMNS = {"text": "str", "n": "int", "arr": "ndarray"}


@pytest.mark.parametrize("kept_bytes", [None, 0])  # blocks kept decoded in memory, or every batch one read_into
def test_spec_written_shards_decode_locally_and_over_nginx(
    tmp_path: Path, nginx_server: Callable, kept_bytes: int | None
) -> None:
    _write_spec(tmp_path / "www" / "ds", SPEC_COLUMNS, _spec_rows(10))
    server = nginx_server(tmp_path / "www")
    for url in (str(tmp_path / "www" / "ds"), f"{server.url}/ds"):
        ds = MDSDataset(url, settings=_settings(tmp_path), kept_bytes=kept_bytes)
        assert ds.kept.limit_bytes == (0 if kept_bytes == 0 else DEFAULT_KEPT_BYTES)
        assert len(ds) == 10 and len(ds.shards) == 4
        for sample in (ds[7], ds.read_batch([2, 7, 0])[1]):
            assert sample["text"] == "row 7" and sample["n"] == 49 and type(sample["n"]) is int
            assert sample["arr"].dtype == np.float32 and np.array_equal(sample["arr"], np.arange(4).reshape(2, 2) + 7)
        with pytest.raises(IndexError):
            ds[10]


def test_unsupported_encoding_is_named_at_construction(tmp_path: Path) -> None:
    _write_spec(tmp_path / "ds", {"text": "str", "audio": "flac"}, [{"text": b"x", "audio": b"\0"}])
    with pytest.raises(DecodeError, match=r"column 'audio' has MDS encoding 'flac'.*fix: rewrite that column"):
        MDSDataset(str(tmp_path / "ds"), settings=_settings(tmp_path))


def test_truncated_shard_is_an_error_not_wrong_data(tmp_path: Path, nginx_server: Callable) -> None:
    root = tmp_path / "www" / "ds"
    _write_spec(root, SPEC_COLUMNS, _spec_rows(9))
    shard = root / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-5])  # a cut upload
    server = nginx_server(tmp_path / "www")
    for url in (str(root), f"{server.url}/ds"):
        with pytest.raises(DecodeError, match=r"shard\.00001\.mds: MDS shard is \d+ B but index.json says \d+ B"):
            MDSDataset(url, settings=_settings(tmp_path / url.replace("/", "_")))


def test_corrupt_offset_table_is_an_error_not_wrong_data(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _write_spec(root, SPEC_COLUMNS, _spec_rows(6))
    shard = root / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    data[8:12] = struct.pack("<I", struct.unpack("<I", data[8:12])[0] + 3)  # sample 0 ends 3 B late
    shard.write_bytes(bytes(data))
    ds = MDSDataset(str(root), settings=_settings(tmp_path))
    assert ds[4]["text"] == "row 4"  # the other shard is whole
    with pytest.raises(DecodeError, match=r"shard\.00000\.mds: MDS sample of \d+ B holds columns of \d+ B"):
        ds[0]
    with pytest.raises(DecodeError):
        ds.read_batch([4, 1])


def test_compressed_shards_without_their_decompressor_say_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ds"
    _write_spec(root, SPEC_COLUMNS, _spec_rows(3))
    index = json.loads((root / "index.json").read_text())
    index["shards"][0]["compression"] = "snappy"
    index["shards"][0]["zip_data"] = {"basename": "shard.00000.mds.snappy", "bytes": 10, "hashes": {}}
    (root / "index.json").write_text(json.dumps(index))
    monkeypatch.setitem(sys.modules, "snappy", None)  # import snappy now raises ImportError
    with pytest.raises(ConfigError, match=r"compressed with 'snappy'.*fix: pip install python-snappy"):
        MDSDataset(str(root), settings=_settings(tmp_path))


def test_gzip_shards_are_inflated(tmp_path: Path) -> None:
    import gzip

    root = tmp_path / "ds"
    _write_spec(root, SPEC_COLUMNS, _spec_rows(5), per_shard=5)
    index = json.loads((root / "index.json").read_text())
    packed = gzip.compress((root / "shard.00000.mds").read_bytes())
    (root / "shard.00000.mds").unlink()
    (root / "shard.00000.mds.gz").write_bytes(packed)
    index["shards"][0].update(compression="gz:9", zip_data={"basename": "shard.00000.mds.gz", "bytes": len(packed)})
    (root / "index.json").write_text(json.dumps(index))
    ds = MDSDataset(str(root), settings=_settings(tmp_path))
    assert [s["text"] for s in ds.read_batch([4, 0, 2])] == ["row 4", "row 0", "row 2"]
    assert ds[3]["n"] == 21
    shutil.rmtree(root)


class _Planted:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_a_pkl_column_is_refused_at_construction_and_never_unpickled(tmp_path: Path) -> None:
    # MDS stores pkl columns as pickles; reading them would run what they name (DESIGN.md: remote
    # bytes are never unpickled), so the dataset refuses the column by name before any sample is read.
    import pickle

    marker = tmp_path / "unpickled"
    out = tmp_path / "pkl"
    rows = [{"x": np.int64(i).tobytes(), "obj": pickle.dumps(_Planted(str(marker)))} for i in range(3)]
    _write_spec(out, {"x": "int", "obj": "pkl"}, rows)
    with pytest.raises(DecodeError, match=r"column 'obj' has encoding 'pkl'.*never does"):
        MDSDataset(str(out), settings=_settings(tmp_path))
    assert not marker.exists()

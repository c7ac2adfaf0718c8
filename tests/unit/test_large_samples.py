"""A large sample is read straight into its own bytes object (gather.filled), not via a batch buffer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fastload
from fastload import dataset as dataset_module
from fastload.cache import gather
from fastload.config import Settings


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    (tmp_path / "src").mkdir()
    sizes = {"a.bin": 3000, "big.bin": gather.FILL_MIN + 12_345, "c.bin": 70_000, "huge.bin": 2 * gather.FILL_MIN + 1}
    out = {}
    for name, size in sizes.items():
        out[name] = os.urandom(size)
        (tmp_path / "src" / name).write_bytes(out[name])
    return out


@pytest.mark.skipif(gather.filled(1) is None, reason="CPython's bytes layout")
def test_large_samples_skip_the_batch_buffer_and_read_exactly(tmp_path: Path, files: dict[str, bytes],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    buffered: list[list[int]] = []
    real = dataset_module._batch_buffer

    def recorded(sizes: list[int], **kw):  # type: ignore[no-untyped-def]
        buffered.append(list(sizes))
        return real(sizes, **kw)

    monkeypatch.setattr(dataset_module, "_batch_buffer", recorded)
    ds = fastload.FileDataset(str(tmp_path / "src"), settings=Settings(cache_dir=tmp_path / "cache"))
    for epoch in ("cold", "warm"):
        got = {Path(u).name: d for b in fastload.DataLoader(ds, batch_size=4) for u, d in zip(b["url"], b["data"])}
        assert got == files, epoch
        assert all(type(d) is bytes for d in got.values())
        assert hash(got["big.bin"]) == hash(bytes(files["big.bin"]))  # an ordinary bytes, hashed from its filled data
    large = {len(files["big.bin"]), len(files["huge.bin"])}
    assert buffered and not large & {s for sizes in buffered for s in sizes}
    assert {3000, 70_000} <= {s for sizes in buffered for s in sizes}  # small ones still share a buffer


def test_filled_gives_a_fresh_bytes_and_a_writable_view_of_it() -> None:
    made = gather.filled(gather.FILL_MIN)
    if made is None:
        pytest.skip("CPython's bytes layout")
    data, into = made
    into[:3] = [7, 8, 9]
    into[-1] = 1
    assert data[:4] == b"\x07\x08\x09\x00" and data[-1] == 1 and len(data) == gather.FILL_MIN

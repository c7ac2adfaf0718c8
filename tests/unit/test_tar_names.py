"""Tar shards named as WebDataset names them: member keys and suffixes, brace patterns.

The expected values are what webdataset 1.0.2 and braceexpand 0.1.7 give (checked
against them directly where they are installed: benchmarks/tar/requirements.txt).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest

from fastload.config import Settings
from fastload.dataset import TarDataset
from fastload.errors import ConfigError, DecodeError
from fastload.read.blocks import read_ranges
from fastload.read.shards import expand_braces, split_name

TRICKY = ["a.b/c.d/000.jpg", "a.b/c.d/000.cls", "x/001.seg.PNG", "x/001.json", "README", "dir/noext",
          "dir/.hidden.jpg", "a.b/.hidden.jpg", "__meta__", "__x__/y.jpg", "k1.jpg", "k2.jpg", "k1.cls",
          "k3.tar.gz", "k3.JPG", "weird..jpg", "./rel.jpg", "s p a c e.jpg"]
# webdataset 1.0.2 over a shard of TRICKY (member i holds b"data<i>"), __url__ left out.
WEBDATASET_SAMPLES = [
    {"__key__": "a.b/c.d/000", "jpg": b"data0", "cls": b"data1"},
    {"__key__": "x/001", "seg.png": b"data2", "json": b"data3"},
    {"__key__": "dir/", "hidden.jpg": b"data6"},
    {"__key__": "k1", "jpg": b"data10"},
    {"__key__": "k2", "jpg": b"data11"},
    {"__key__": "k1", "cls": b"data12"},
    {"__key__": "k3", "tar.gz": b"data13", "jpg": b"data14"},
    {"__key__": "weird", ".jpg": b"data15"},
    {"__key__": "./rel", "jpg": b"data16"},
    {"__key__": "s p a c e", "jpg": b"data17"},
]


def write_tar(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for i, name in enumerate(names):
            data = f"data{i}".encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def fastload_samples(ds: TarDataset) -> list[dict[str, Any]]:
    # Through the index and read_ranges, not ds[i]: samples with differing suffixes are
    # refused by ds[i] (a named error, tests/unit/test_dataset.py), where webdataset yields them.
    out = []
    for shard, key, members in ds.samples:
        item = ds.items[shard]
        data = read_ranges(ds.reader, [(item, off, off + n) for _, off, n in members])
        out.append({"__key__": key} | {suffix: d for (suffix, _, _), d in zip(members, data)})
    return out


def test_samples_group_as_webdataset_groups_them(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    write_tar(tmp_path / "shards" / "n.tar", TRICKY)
    ds = TarDataset(str(tmp_path / "shards"), settings=Settings(cache_dir=tmp_path / "cache"))
    assert fastload_samples(ds) == WEBDATASET_SAMPLES


def test_samples_match_webdataset_itself(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    (tmp_path / "shards").mkdir()
    shard = tmp_path / "shards" / "n.tar"
    write_tar(shard, TRICKY)
    theirs = [{k: v for k, v in s.items() if k not in ("__url__", "__local_path__")}
              for s in wds.WebDataset(str(shard), shardshuffle=False, empty_check=False)]
    ds = TarDataset(str(tmp_path / "shards"), settings=Settings(cache_dir=tmp_path / "cache"))
    assert fastload_samples(ds) == theirs


def test_split_name_follows_webdataset() -> None:
    assert split_name("train/a.b/000017.seg.PNG") == ("train/a.b/000017", "seg.png")
    assert split_name("dir/.hidden.jpg") == ("dir/", "hidden.jpg")
    assert split_name("a.b/.hidden.jpg") is None and split_name("noext") is None and split_name("d.x/noext") is None
    assert split_name("__key__") is None and split_name("__meta__/x.json") is None and split_name("a/__k__.jpg") == ("a/__k__", "jpg")


def test_a_suffix_twice_in_one_sample_is_refused_as_webdataset_refuses_it(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    write_tar(tmp_path / "shards" / "d.tar", ["k.jpg", "k.JPG"])
    with pytest.raises(DecodeError, match=r"d\.tar: member 'k\.JPG' repeats suffix 'jpg' of sample 'k'"):
        TarDataset(str(tmp_path / "shards"), settings=Settings(cache_dir=tmp_path / "cache"))


BRACES = {
    "s3://b/shard-{000000..000002}.tar": ["s3://b/shard-000000.tar", "s3://b/shard-000001.tar", "s3://b/shard-000002.tar"],
    "{train,val}/{0..1}.tar": ["train/0.tar", "train/1.tar", "val/0.tar", "val/1.tar"],
    "x{8..10}": ["x8", "x9", "x10"],
    "x{07..10}": ["x07", "x08", "x09", "x10"],
    "{4..1}": ["4", "3", "2", "1"],
    "{0..6..3}": ["0", "3", "6"],
    "{a..e..2}": ["a", "c", "e"],
    "{a,{b,c}d}": ["a", "bd", "cd"],
    "{x}.tar": ["{x}.tar"],
    "{}": ["{}"],
    r"a\{b,c\}": ["a{b,c}"],
    r"{1\{2,3}": ["1{2", "3"],
    "plain.tar": ["plain.tar"],
}


@pytest.mark.parametrize("pattern", sorted(BRACES))
def test_brace_patterns_expand_as_webdataset_expands_them(pattern: str) -> None:
    assert expand_braces(pattern) == BRACES[pattern]


def test_brace_patterns_match_braceexpand_itself() -> None:
    braceexpand = pytest.importorskip("braceexpand")
    for pattern in BRACES:
        assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern)), pattern


def test_unbalanced_braces_are_a_config_error_naming_the_pattern() -> None:
    with pytest.raises(ConfigError, match=r"'shard-\{0\.\.3\.tar': unbalanced braces"):
        expand_braces("shard-{0..3.tar")
    with pytest.raises(ConfigError, match="unbalanced braces"):
        expand_braces(r"a\{b,c}")  # braceexpand refuses it too


def test_a_brace_pattern_url_is_its_shard_list_in_order(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    for s in range(4):
        write_tar(tmp_path / "shards" / f"shard-{s:06d}.tar", [f"s{s}.jpg", f"s{s}.cls"])
    settings = Settings(cache_dir=tmp_path / "cache")
    ds = TarDataset(str(tmp_path / "shards" / "shard-{000002..000000}.tar"), settings=settings)
    assert [ds[i]["__key__"] for i in range(len(ds))] == ["s2", "s1", "s0"]  # shard 3 is not named
    both = TarDataset(str(tmp_path / "shards" / "shard-{000001,000003}.tar"), settings=settings)
    assert [both[i]["__key__"] for i in range(len(both))] == ["s1", "s3"]


def _tarfile_members(data: bytes) -> tuple[list[tuple[str, int, int]], int]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        found = [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
    return found, tar.offset


def _tar(fmt: int, names: list[str], kinds: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for i, name in enumerate(names):
            info = tarfile.TarInfo(name)
            kind = (kinds or {}).get(name)
            if kind is None:
                data = f"member {i}".encode() * (i * 37 % 50)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = kind, "target"
                tar.addfile(info)
    return buf.getvalue()


NAMES = ["a.jpg", "dir.x/b.seg.png", "p" * 90 + "/" + "q" * 60 + ".txt", "ünï/cöde.cls", "empty.txt", "lnk", "d/", "dev"]
KINDS = {"lnk": tarfile.SYMTYPE, "d/": tarfile.DIRTYPE, "dev": tarfile.CHRTYPE}


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_plain_scan_reads_what_tarfile_reads_or_steps_aside(fmt: int) -> None:
    from fastload.read.shards import scan_plain

    plain = _tar(fmt, NAMES, KINDS)
    got = scan_plain(io.BytesIO(plain))
    if fmt == tarfile.USTAR_FORMAT:
        assert got is not None  # the fast path is taken for plain shards
    if got is not None:
        assert got == _tarfile_members(plain)
    if fmt != tarfile.USTAR_FORMAT:  # a GNU long name or a PAX header: tarfile's to read
        assert scan_plain(io.BytesIO(_tar(fmt, ["x" * 150 + ".jpg", "n.jpg"]))) is None
    for cut in (len(plain) // 2, 512 * 3 + 100):  # cut in data: the members before, for cut_at to name
        got = scan_plain(io.BytesIO(plain[:cut]))
        assert got is None or got[0] == [m for m in _tarfile_members(plain)[0] if m[1] < cut]
    bad = bytearray(plain)
    bad[150] ^= 1  # a flipped checksum digit
    assert scan_plain(io.BytesIO(bytes(bad))) is None

"""Node partitions at scale (issue 31, "A million objects"): assign() keeps a small peak, and
gives every input the parts the first implementation gave, which caches and running jobs hold."""

from __future__ import annotations

import hashlib
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from fastload.errors import ConfigError
from fastload.read import partition

Weights = Callable[[np.ndarray, int], np.ndarray]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def first_hashes(keys: Sequence[str]) -> np.ndarray:
    return np.array(
        [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") for k in keys],
        dtype=np.uint64,
    )


def first_weights(hashes: np.ndarray, nodes: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = hashes[:, None] ^ (np.arange(1, nodes + 1, dtype=np.uint64)[None, :] * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def first_assign(keys: Sequence[str], sizes: Sequence[int], nodes: int, weights: Weights = first_weights) -> np.ndarray:
    """assign() as first written (before issue 31), verbatim but for the weights it may be given."""
    n = len(keys)
    owner = np.zeros(n, dtype=np.int64)
    if nodes == 1 or n == 0:
        return owner
    hashes = first_hashes(keys)
    prefs = np.argsort(-weights(hashes, nodes).astype(np.float64), axis=1, kind="stable").tolist()
    weight = [max(int(s), 0) for s in sizes]
    room = sum(weight) / nodes
    load = [0] * nodes
    for i in np.argsort(hashes, kind="stable").tolist():
        s = weight[i]
        for j in prefs[i]:
            if load[j] + s <= room:
                break
        else:
            j = min(prefs[i], key=lambda k: load[k])
        owner[i] = j
        load[j] += s
    return owner


def urls(n: int) -> list[str]:
    return [f"https://h/d/{i // 10000:03d}/{i:07d}.jpg" for i in range(n)]


def lognormal(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).lognormal(11, 0.6, n).astype(int).tolist()


CASES: dict[str, tuple[list[str], list[Any]]] = {  # keys, sizes
    "lognormal": (urls(5000), lognormal(5000)),
    "equal sizes": (urls(4000), [4096] * 4000),
    "sizeless (1 each)": ([str(i) for i in range(3001)], [1] * 3001),
    "zero, negative and giant": (urls(500), [0, -5, 10**12] + lognormal(497, seed=3)),
    "few items": (["a", "b", "c"], [3, 1, 2]),
    "unicode keys, float sizes": ([f"s3://b/é/{i}.txt" for i in range(300)], [i * 10.7 for i in range(300)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("nodes", [1, 2, 3, 7, 32])
def test_parts_are_those_of_the_first_implementation(case: str, nodes: int) -> None:
    keys, sizes = CASES[case]
    expected = first_assign(keys, sizes, nodes)
    got = partition.assign(keys, sizes, nodes)
    assert got.dtype == expected.dtype == np.int64
    assert (got == expected).all(), np.flatnonzero(got != expected)[:10]


def test_blocks_of_any_size_give_the_same_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Items are placed a block at a time; a block's length must never show in the parts.
    keys, sizes = CASES["lognormal"]
    expected = first_assign(keys, sizes, 5)
    for cells in (1, 5, 64, 4096):
        monkeypatch.setattr(partition, "_BLOCK_CELLS", cells)
        assert (partition.assign(keys, sizes, 5) == expected).all(), cells


def test_equal_weights_go_to_the_lower_node_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    # Real weights almost never tie. These keep their top 3 bits and low 10: many are
    # equal, and many differ only below float64's precision, which the ranking ignores
    # (equal as float64: the lower node first).
    def coarse(hashes: np.ndarray, nodes: int) -> np.ndarray:
        w = first_weights(hashes, nodes)
        return (w >> np.uint64(61) << np.uint64(61)) | (w & np.uint64(0x3FF))

    monkeypatch.setattr(partition, "_weights", coarse)
    keys, sizes = CASES["lognormal"]
    for nodes in (2, 7):
        for cells in (1 << 18, 16):
            monkeypatch.setattr(partition, "_BLOCK_CELLS", cells)
            assert (partition.assign(keys, sizes, nodes) == first_assign(keys, sizes, nodes, coarse)).all()


def test_sizes_as_an_array_are_read_not_changed() -> None:
    keys, sizes = CASES["zero, negative and giant"]
    arr = np.array(sizes, dtype=np.int64)
    assert (partition.assign(keys, arr, 3) == first_assign(keys, sizes, 3)).all()  # type: ignore[arg-type]
    assert arr.tolist() == sizes  # the negative size is still the caller's


def test_fewer_sizes_than_keys_is_named() -> None:
    with pytest.raises(ConfigError, match="3 keys but 2 sizes"):
        partition.assign(["a", "b", "c"], [1, 2], 2)


def test_a_million_items_over_32_nodes_peak_under_80_mb() -> None:
    # The first implementation peaked at 565 MB here (5.6 GB at 10M items: an (item, node)
    # array of weights, their ranking, and a Python list of it). Now: ~40 bytes per item
    # (hashes, visiting order, sizes, the result) and a few MB of blocks, so this bound
    # scales to < 800 MB at 10M items. The key list is the caller's and is built first.
    keys, sizes = urls(1_000_000), [4096] * 1_000_000
    tracemalloc.start()
    try:
        owner = partition.assign(keys, sizes, 32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 80 * 2**20, f"{peak / 2**20:.0f} MB"
    assert np.bincount(owner, minlength=32).tolist() == [31250] * 32  # equal sizes: equal counts

"""Node partitions: each node of a cluster reads one fixed part of the dataset.

With ``partition="node"`` (:class:`~fastload.loader.sampler.ShardedSampler`,
``fastload.DataLoader``) the dataset is split once into one *part* per node. The
parts hold near-equal bytes and stay the same in every epoch, so each node's cache
fills with its own part in the first epoch and the slow link carries each byte once
per cluster (N x D of egress becomes D). Shuffling happens within a part.

Vocabulary:

* *node*: one machine of the job, numbered ``0 .. nodes - 1`` (torchrun's
  ``GROUP_RANK``, Slurm's ``SLURM_NODEID``); its ranks are ``local_world_size``
  consecutive global ranks.
* *part*: the items one node reads, fixed across epochs (:func:`assign`).
* *key*: what names an item across runs and machines (its canonical URL for a
  fastload dataset, else its index); *size*: its bytes (1 each when unknown).
* *move*: an item whose node differs between two node counts (:func:`moved`).
* *block*: items of the visiting order ranked and placed together; a node is
  *closed* to a block when not even its smallest item fits, else *open*.

How items are assigned: rendezvous (highest-random-weight) hashing with bounded
loads. Each (key, node) pair gets a pseudo-random weight; items are visited in an
order fixed by their keys' hashes, and each goes to the node of highest weight that
still has room below ``total / nodes`` bytes (an item no node has room for goes to
the least loaded one, so no part exceeds its share by more than one item). Adding
or removing a node changes only the items whose best node was the one added or
removed, plus those pushed by the room bound: about the least share any split must
move (``tests/unit/test_partition.py`` holds 2 -> 3 -> 2 nodes under 1.2 x it).

Memory (issue 31): weights exist for one block at a time (about 2**18 pairs), never
for the whole dataset. A block's leading items that go to their best open node with
room are placed at once; the first that cannot be is placed alone, by the rule above.
assign() thus holds about 40 bytes per item beyond its inputs: 10M items over 32
nodes peak at 309 MB traced, against 5.6 GB for the (item, node) arrays before, with
the same parts (``tests/unit/test_partition_memory.py``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sqlite3
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from fastload.cache import cannot_write
from fastload.cache import keys as cache_keys
from fastload.errors import ConfigError

__all__ = ["Topology", "assign", "dataset_weights", "log_move", "moved", "node_items", "topology"]

_log = logging.getLogger("fastload")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_HASH_CHUNK = 1 << 16  # keys hashed per join: ~3 MB of digests in flight
_BLOCK_CELLS = 1 << 18  # (item, node) weights ranked at once: 2 MB per array, whatever the item count


@dataclass(frozen=True)
class Topology:
    """Where this process sits: ``nodes`` nodes of ``local_world_size`` ranks each.

    Attributes:
        nodes: Nodes in the job.
        node_rank: This process's node, in ``[0, nodes)``.
        local_world_size: Ranks per node.
        local_rank: This process's rank on its node, in ``[0, local_world_size)``.
    """

    nodes: int
    node_rank: int
    local_world_size: int
    local_rank: int


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as err:
        raise ConfigError(f"{name}={value!r} is not an integer; fix: unset it or set it to this process's value") from err


def node_env() -> tuple[int | None, int | None]:
    """``(nodes, node_rank)`` from torchrun's or Slurm's environment, each None when absent.

    torchrun sets ``GROUP_RANK`` (the node), ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``
    (nodes = WORLD_SIZE / LOCAL_WORLD_SIZE); Slurm sets ``SLURM_NODEID`` and
    ``SLURM_NNODES``. torchrun's values win when both are set.
    """
    group, local_ws, world = _env_int("GROUP_RANK"), _env_int("LOCAL_WORLD_SIZE"), _env_int("WORLD_SIZE")
    if group is not None and local_ws and world:
        return world // local_ws, group
    return _env_int("SLURM_NNODES"), _env_int("SLURM_NODEID")


def topology(world_size: int, rank: int, nodes: int | None = None, node_rank: int | None = None) -> Topology:
    """This process's place in the cluster, from ``nodes=``/``node_rank=`` or the environment.

    Ranks are numbered node by node, as torchrun and Slurm number them: node ``k``
    holds global ranks ``k * local_world_size .. (k + 1) * local_world_size - 1``.

    Raises:
        ConfigError: The node count or this node's rank cannot be found, or they do
            not fit ``world_size`` and ``rank``.
    """
    env_nodes, env_node_rank = node_env()
    nodes = env_nodes if nodes is None else nodes
    node_rank = env_node_rank if node_rank is None else node_rank
    if nodes is None or node_rank is None:
        raise ConfigError(
            "partition='node' needs the node count and this node's rank, and neither torchrun (GROUP_RANK, "
            "LOCAL_WORLD_SIZE, WORLD_SIZE) nor Slurm (SLURM_NNODES, SLURM_NODEID) set them; fix: launch with "
            "torchrun or srun, or pass nodes= and node_rank="
        )
    if nodes < 1 or not 0 <= node_rank < nodes:
        raise ConfigError(f"node_rank={node_rank} is outside [0, {nodes - 1}] for nodes={nodes}; fix: pass this node's rank")
    if world_size % nodes:
        raise ConfigError(
            f"world_size={world_size} does not split into nodes={nodes} equal nodes; fix: run the same number "
            "of ranks on every node, or pass nodes= to match"
        )
    local_ws = world_size // nodes
    local_rank = rank - node_rank * local_ws
    if not 0 <= local_rank < local_ws:
        raise ConfigError(
            f"rank={rank} is not on node {node_rank} ({local_ws} ranks per node hold ranks "
            f"{node_rank * local_ws}..{(node_rank + 1) * local_ws - 1}); fix: number ranks node by node, as "
            "torchrun does, or pass the node_rank= of this rank"
        )
    return Topology(nodes, node_rank, local_ws, local_rank)


def _hashes(keys: Sequence[str]) -> np.ndarray:
    """Each key's 64-bit hash (blake2b, not hash(): the same on every machine and in every run)."""
    # Digests are packed a chunk at a time into one uint64 array: a Python int per key
    # costs ~12 x the array's 8 bytes (issue 31).
    out = np.empty(len(keys), dtype=np.uint64)
    it, start = iter(keys), 0
    while chunk := b"".join(hashlib.blake2b(k.encode(), digest_size=8).digest() for k in islice(it, _HASH_CHUNK)):
        digests = np.frombuffer(chunk, dtype="<u8")  # int.from_bytes(digest, "little"), as before
        out[start : start + len(digests)] = digests
        start += len(digests)
    return out


def _weights(hashes: np.ndarray, nodes: int) -> np.ndarray:
    """The (item, node) rendezvous weights: splitmix64 of each key hash mixed with the node."""
    with np.errstate(over="ignore"):
        z = hashes[:, None] ^ (np.arange(1, nodes + 1, dtype=np.uint64)[None, :] * _GOLDEN)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return z


def _ranks(hashes: np.ndarray, nodes: int) -> np.ndarray:
    """The weights as the ranking compares them: as float64, so weights that round alike tie.

    Ties go to the lower node. The order must never change (every rank, and every
    cache split over it, relies on it): ``tests/unit/test_partition_memory.py``
    pins it against the first implementation, ties included.
    """
    return _weights(hashes, nodes).astype(np.float64)


def _item_bytes(sizes: Sequence[int], n: int) -> tuple[np.ndarray, int]:
    """Each of the first ``n`` items' bytes (``int(size)``, negatives as 0) as int64, and the total of all sizes."""
    if len(sizes) < n:
        raise ConfigError(f"{n} keys but {len(sizes)} sizes; fix: pass one size per key")
    arr = np.asarray(sizes)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":  # floats, huge ints, strings: as int() reads each
        try:
            arr = np.fromiter((int(s) for s in sizes), dtype=np.int64, count=len(sizes))
        except OverflowError as err:
            raise ConfigError(f"a size does not fit 64 bits; fix: pass sizes in bytes below {2**63}") from err
    elif arr.dtype.kind == "u" and len(arr) and int(arr.max()) >= 2**63:
        raise ConfigError(f"size {int(arr.max())} does not fit 64 bits; fix: pass sizes in bytes below {2**63}")
    weight = np.maximum(arr, 0).astype(np.int64, copy=False)  # a new array: the caller's stays as it was
    if weight.sum(dtype=np.float64) >= 2.0**62:  # loads and running sums stay exact in int64
        raise ConfigError(f"sizes total {weight.sum(dtype=np.float64):.3g} B, beyond 2**62; fix: pass sizes in bytes")
    return weight[:n], int(weight.sum())


def assign(keys: Sequence[str], sizes: Sequence[int], nodes: int) -> np.ndarray:
    """The node of each item: its part (see the module docs). Pure: the same on every machine."""
    if nodes < 1:
        raise ConfigError(f"nodes={nodes} must be >= 1")
    n = len(keys)
    owner = np.zeros(n, dtype=np.int64)
    if nodes == 1 or n == 0:
        return owner
    weight, total = _item_bytes(sizes, n)
    # An int load fits below the float total / nodes exactly when it fits below its floor.
    room = math.floor(total / nodes)
    hashes = _hashes(keys)
    order = np.argsort(hashes, kind="stable")
    load = np.zeros(nodes, dtype=np.int64)
    most = max(_BLOCK_CELLS // nodes, 1)
    step, pos = most, 0
    while pos < n:
        idx = order[pos : pos + step]
        nodes_of, placed = _place_block(hashes[idx], weight[idx], load, room)
        owner[idx[:placed]] = nodes_of[:placed]
        pos += placed
        if placed < len(idx):  # its best open node has no room: the rules, one item at a time
            i = idx[placed]
            owner[i] = _place_one(hashes[i : i + 1], int(weight[i]), load, room)
            pos += 1
            step = max(step // 2, 1)  # near full nodes this happens often: smaller blocks waste less
        else:
            step = min(step * 2, most)
    return owner


def _place_block(hashes: np.ndarray, weight: np.ndarray, load: np.ndarray, room: int) -> tuple[np.ndarray, int]:
    """Place the leading items of a block (in visiting order) that go to their best open node.

    A node is *closed* when even the block's smallest item would overflow it; loads only
    grow, so it stays closed for the whole block. Each item's best open node is where
    the one-at-a-time rule puts it, as long as that node still has room for it after the
    block's earlier items. Returns each item's best open node and how many leading items
    were placed (their bytes added to ``load``).
    """
    closed = load + weight.min() > room
    if closed.all():  # no node has room: every item needs the least-loaded rule
        return np.zeros(0, dtype=np.int64), 0
    ranks = _ranks(hashes, len(load))
    if closed.any():
        ranks[:, closed] = -1.0  # below every weight (>= 0)
    best = ranks.argmax(axis=1)  # the first of equal maxima: the lower node, as in the ranking
    del ranks
    added = np.zeros_like(load)
    np.add.at(added, best, weight)
    if (load + added <= room).all():  # the usual case: every node has room for all it is given
        load += added
        return best, len(best)
    rows = np.arange(len(best))
    running = np.zeros((len(best), len(load)), dtype=np.int64)
    running[rows, best] = weight
    np.cumsum(running, axis=0, out=running)  # each node's bytes from the block so far
    fits = load[best] + running[rows, best] <= room
    placed = len(best) if fits.all() else int(fits.argmin())
    if placed:
        load += running[placed - 1]
    return best, placed


def _place_one(hashes: np.ndarray, size: int, load: np.ndarray, room: int) -> int:
    """Place one item: its best node with room, else the least loaded (first in its ranking)."""
    prefs = np.argsort(-_ranks(hashes, len(load))[0], kind="stable")
    loads = load[prefs]
    fits = loads + size <= room
    j = int(prefs[fits.argmax()] if fits.any() else prefs[loads.argmin()])
    load[j] += size
    return j


def node_items(owner: np.ndarray, node_rank: int) -> list[int]:
    """The indices of node ``node_rank``'s part, ascending."""
    return np.flatnonzero(owner == node_rank).tolist()


def dataset_weights(dataset: Sized) -> tuple[list[str], list[int]]:
    """Each item's key and size: a dataset's own (``item_sizes()``, ``item_keys()``) or index and 1.

    Bytes balance the parts where the dataset knows its items' sizes (a
    :class:`~fastload.dataset.FileDataset` from its manifest, one HEAD per item the
    listing left sizeless); otherwise each item counts as one.
    """
    sizes_of = getattr(dataset, "item_sizes", None)
    keys_of = getattr(dataset, "item_keys", None)
    if callable(sizes_of) and callable(keys_of):
        return list(keys_of()), [int(s) for s in sizes_of()]
    n = len(dataset)
    return [str(i) for i in range(n)], [1] * n


def moved(keys: Sequence[str], sizes: Sequence[int], before: int, after: int) -> tuple[int, int, int]:
    """``(items, bytes, least_bytes)`` that change node going from ``before`` to ``after`` nodes.

    ``least_bytes`` is the least any split must move: the share of the nodes added
    (``after > before``) or removed (``after < before``), ``total * |after - before| /
    max(before, after)``.
    """
    a, b = assign(keys, sizes, before), assign(keys, sizes, after)
    diff = a != b
    weight = np.asarray(sizes, dtype=np.int64)
    total = int(weight.sum())
    least = total * abs(after - before) // max(before, after)
    return int(diff.sum()), int(weight[diff].sum()), least


def log_move(dataset: Any, keys: Sequence[str], sizes: Sequence[int], nodes: int, *, announce: bool) -> None:
    """Log the bytes that change node when ``dataset`` was last split over another node count.

    The last node count is recorded in the dataset's cache index (fastload datasets
    only: another dataset has no cache to keep; a read-only or full cache keeps none).
    ``announce`` logs (one rank per node); every rank records.
    """
    reader = getattr(dataset, "reader", None)
    root = getattr(dataset, "_root", None)
    if reader is None or root is None:
        return
    key = cache_keys.partition(root)
    index = reader.cache.index
    before = index.get(key)
    if before is not None and int(before) != nodes and announce:
        items, nbytes, least = moved(keys, sizes, int(before), nodes)
        _log.info(
            "%s: split over %d nodes, was %d: %d items (%d B) change node, against %d B the least any split "
            "must move; they are read from the source once, by their new node",
            root, nodes, int(before), items, nbytes, least,
        )
    if (before is None or int(before) != nodes) and reader.cache.unwritable is None:
        try:
            index.set(key, nodes)
        except sqlite3.OperationalError as err:
            if not cannot_write(err):  # a full disk only costs the next run its move report
                raise

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

How items are assigned: rendezvous (highest-random-weight) hashing with bounded
loads. Each (key, node) pair gets a pseudo-random weight; items are visited in an
order fixed by their keys' hashes, and each goes to the node of highest weight that
still has room below ``total / nodes`` bytes (an item no node has room for goes to
the least loaded one, so no part exceeds its share by more than one item). Adding
or removing a node changes only the items whose best node was the one added or
removed, plus those pushed by the room bound: about the least share any split must
move (``tests/unit/test_partition.py`` holds 2 -> 3 -> 2 nodes under 1.2 x it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.cache import cannot_write
from fastload.cache import keys as cache_keys
from fastload.errors import ConfigError

__all__ = ["Topology", "assign", "dataset_weights", "log_move", "moved", "node_items", "topology"]

_log = logging.getLogger("fastload")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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
    # blake2b, not hash(): the same on every machine and in every run.
    return np.array(
        [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") for k in keys],
        dtype=np.uint64,
    )


def _weights(hashes: np.ndarray, nodes: int) -> np.ndarray:
    """The (item, node) rendezvous weights: splitmix64 of each key hash mixed with the node."""
    with np.errstate(over="ignore"):
        z = hashes[:, None] ^ (np.arange(1, nodes + 1, dtype=np.uint64)[None, :] * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def assign(keys: Sequence[str], sizes: Sequence[int], nodes: int) -> np.ndarray:
    """The node of each item: its part (see the module docs). Pure: the same on every machine."""
    if nodes < 1:
        raise ConfigError(f"nodes={nodes} must be >= 1")
    n = len(keys)
    owner = np.zeros(n, dtype=np.int64)
    if nodes == 1 or n == 0:
        return owner
    hashes = _hashes(keys)
    # Best node first; ties (equal weights) broken by node number.
    prefs = np.argsort(-_weights(hashes, nodes).astype(np.float64), axis=1, kind="stable").tolist()
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

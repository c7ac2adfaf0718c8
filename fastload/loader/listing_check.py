"""One listing per job: the ranks of a distributed sampler check that they split the same items.

A :class:`~fastload.loader.sampler.ShardedSampler`'s split is a pure function of the
items it is given, so ranks whose datasets list different items (a replaced node
lists the remote afresh while the others reuse the listing recorded in their caches)
would read some items twice and others never, and with unequal step counts hang the
job's next collective. :func:`check` compares the ranks' listings once, when the
sampler is built, and raises one error on every rank, so none is left waiting.

Vocabulary:

* *listing*: what a sampler splits, in order: a dataset's ``item_keys()`` (with the
  sizes, where the split weighs bytes: ``partition="node"``), else only its length.
* *digest*: a :class:`Digest`, the item count and blake2b over the listing's chunks.
* *chunk*: :data:`CHUNK` consecutive items hashed together; comparing chunk digests
  finds the first item that differs without sending whole listings.

The comparison needs an initialised default process group that the sampler spans
(its ``world_size`` and ``rank`` are the group's): ranks given by hand, or a sampler
over a subgroup, are not compared (``docs/loader.md``, distributed training).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.errors import ConfigError

__all__ = ["CHUNK", "Digest", "check", "dataset_listing", "digest", "mismatch_message"]

CHUNK = 1 << 12  # items per chunk digest: 16 B each, ~2,400 for 10M items
_SHOWN = 4  # listings (one per digest) whose first differing item is looked up


@dataclass(frozen=True)
class Digest:
    """A listing's item count and digest (hex), and each chunk's digest."""

    count: int
    hex: str
    chunks: tuple[bytes, ...]


def digest(count: int, keys: Sequence[str] = (), sizes: Sequence[int] | None = None) -> Digest:
    """The digest of ``count`` items named by ``keys`` (none: only the count), with ``sizes``."""
    chunks = []
    for start in range(0, len(keys), CHUNK):
        h = hashlib.blake2b(digest_size=16)
        # NUL ends each key: no URL holds one, so two listings never join alike.
        h.update("\0".join(keys[start : start + CHUNK]).encode() + b"\0")
        if sizes is not None:
            h.update(np.asarray(sizes[start : start + CHUNK], dtype=np.int64).tobytes())
        chunks.append(h.digest())
    whole = hashlib.blake2b(count.to_bytes(8, "little") + b"".join(chunks), digest_size=16)
    return Digest(count, whole.hexdigest(), tuple(chunks))


def dataset_listing(dataset: Sized) -> list[str]:
    """A dataset's keys for the global split (no sizes: a FileDataset may HEAD for them); [] when it has none."""
    keys_of = getattr(dataset, "item_keys", None)
    return list(keys_of()) if callable(keys_of) else []


def _spans_default_group(world_size: int, rank: int) -> bool:
    import torch.distributed as dist

    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return False
    return bool(dist.get_world_size() == world_size and dist.get_rank() == rank)


def _gather(obj: Any, world_size: int) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def check(
    dataset: Sized, world_size: int, rank: int, keys: Sequence[str] | None = None, sizes: Sequence[int] | None = None
) -> None:
    """Raise on every rank when the ranks' listings differ; nothing when they agree or cannot be compared.

    A collective over the default process group: every rank of it must build its
    sampler (as DDP does), once per sampler. ``keys`` default to the dataset's own
    (:func:`dataset_listing`), listed only when there is a group to compare with.

    Raises:
        ConfigError: Two ranks hold different listings; names each one, the first item
            that differs, the likely cause and the fix.
    """
    if not _spans_default_group(world_size, rank):
        return
    if keys is None:
        keys = dataset_listing(dataset)
    own = digest(len(dataset), keys, sizes)
    seen = _gather((own.count, own.hex), world_size)
    if len(set(seen)) == 1:
        return
    groups: dict[tuple[int, str], list[int]] = {}
    for r, key in enumerate(seen):
        groups.setdefault(key, []).append(r)
    shown = [ranks[0] for ranks in groups.values()][:_SHOWN]
    # Two more rounds, on the error path only, decided by gathered data alike on every rank.
    chunks = _gather(own.chunks if rank in shown else None, world_size)
    first = _first_chunk([chunks[r] for r in shown])
    lo = first * CHUNK
    part = None
    if rank in shown:
        some = list(keys[lo : lo + CHUNK])
        weights: list[int | None] = [None] * len(some) if sizes is None else [int(s) for s in sizes[lo : lo + CHUNK]]
        part = list(zip(some, weights))
    items = _gather(part, world_size)
    url = getattr(dataset, "url", None)
    raise ConfigError(mismatch_message(groups, _first_item(lo, {r: items[r] for r in shown}), url if isinstance(url, str) else None))


def _first_chunk(listings: list[tuple[bytes, ...]]) -> int:
    """The first chunk where any listing differs from the first one's (or ends first)."""
    ref, first = listings[0], None
    for other in listings[1:]:
        at = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
        first = at if first is None else min(first, at)
    return first or 0


def _first_item(lo: int, parts: dict[int, list[tuple[str, int | None]]]) -> tuple[int, dict[int, tuple[str, int | None] | None]] | None:
    """``(position, each shown rank's item there)`` of the first difference at or after ``lo``; None if none is found."""
    ranks = list(parts)
    longest = max(len(p) for p in parts.values())
    for j in range(longest):
        at = {r: parts[r][j] if j < len(parts[r]) else None for r in ranks}
        if len(set(at.values())) > 1:
            return lo + j, at
    return None


def _ranks_text(ranks: list[int]) -> str:
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(spans)


def mismatch_message(
    groups: dict[tuple[int, str], list[int]],
    first: tuple[int, dict[int, tuple[str, int | None] | None]] | None = None,
    url: str | None = None,
) -> str:
    """The error for ranks whose listings differ: ``groups`` maps ``(count, digest)`` to its ranks."""
    held = "; ".join(f"{_ranks_text(ranks)}: {count} items (digest {hex_[:12]})" for (count, hex_), ranks in groups.items())
    text = (
        "the ranks split different listings of the dataset, so items would be read twice or never and ranks "
        f"could take different step counts (a hang at the next collective): {held}"
    )
    if first is not None:
        pos, at = first

        def shown(item: tuple[str, int | None] | None) -> str:
            if item is None:
                return "no item"
            return repr(item[0]) if item[1] is None else f"{item[0]!r} ({item[1]} B)"

        text += f". First difference at item {pos}: " + ", ".join(f"rank {r} has {shown(i)}" for r, i in at.items())
    return text + (
        ". Likely cause: a node reused the listing recorded in its cache while another listed the remote afresh. "
        f"Fix: refresh the listing on every node (`fastload cache {url or 'URL'} --refresh`, or refresh=True in "
        "the dataset on every rank), or give every node one shared cache"
    )

"""Property: a run cut at random steps and resumed yields what an uninterrupted run yields.

Random dataset kinds (map-style, stateful iterable, its own iterator, stateless
generator), 0, 1 or 4 workers, persistent or not, in_order or not, one or two cuts
(a state saved right after a restore). Sample for sample; as a multiset where batches
come out of order. A few dozen cases here, a few hundred in the slow suite.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
import torch
from _resume_cases import EpochStream, Ids, PlainGen, SelfIterStream, run

from fastload.loader.dataloader import DataLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

KINDS = ("map", "stateful", "own-iterator", "stateless")


def _case(rng: random.Random, workers: tuple[int, ...]) -> dict[str, Any]:
    return {
        "kind": rng.choice(KINDS),
        "workers": rng.choice(workers),
        "persistent": rng.random() < 0.5,
        "in_order": rng.random() < 0.6,
        "every": rng.choice((1, 1, 2, 3)),
        "n": rng.randrange(9, 30),
        "batch": rng.choice((1, 2, 3)),
        "cuts": rng.choice((1, 1, 2)),
        "seed": rng.randrange(1 << 16),
    }


def _make(c: dict[str, Any]) -> DataLoader:
    kind, n = c["kind"], c["n"]
    ds: Any = {
        "map": Ids,
        "stateful": EpochStream,
        "own-iterator": SelfIterStream,
        "stateless": PlainGen,
    }[kind](n)
    extra: dict[str, Any] = {}
    if kind == "map":
        extra = {"shuffle": True, "generator": torch.Generator().manual_seed(c["seed"])}
    return DataLoader(
        ds, batch_size=c["batch"], num_workers=c["workers"], persistent_workers=c["persistent"] and c["workers"] > 0,
        in_order=c["in_order"], snapshot_every_n_steps=c["every"], **extra,
    )  # fmt: skip


def _batches(c: dict[str, Any]) -> int:
    """Batches per epoch: each worker batches its own shard of an IterableDataset."""
    n, b, w = c["n"], c["batch"], max(1, c["workers"])
    if c["kind"] == "map":
        return -(-n // b)
    return sum(-(-len(range(i, n, w)) // b) for i in range(w))


def _check(c: dict[str, Any]) -> None:
    rng = random.Random(c["seed"])
    epochs = 2
    plain = run(lambda: _make(c), epochs, set())
    # Cut points: (epoch, batches into it) with batches up to the epoch's length; -1: after it ended.
    points = [(e, k) for e in range(epochs) for k in [*range(_batches(c) + 1), -1]]
    cuts = set(rng.sample(points, c["cuts"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stateless kind's replay warning
        got = run(lambda: _make(c), epochs, cuts)
    if c["in_order"] or c["workers"] <= 1:
        assert got == plain, (c, sorted(cuts))
    else:
        assert sorted(got) == sorted(plain), (c, sorted(cuts))


def _cases(count: int, seed: int, workers: tuple[int, ...]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_case(rng, workers) for _ in range(count)]


# The normal suite: mostly in-process (worker processes take ~0.3 s to start each pass).
@pytest.mark.parametrize(
    "case",
    _cases(30, 33, (0,)) + _cases(4, 34, (1, 4)),
    ids=lambda c: f"{c['kind']}-w{c['workers']}-{c['seed']}",
)
def test_resume_at_random_steps_equals_an_uninterrupted_run(case: dict[str, Any]) -> None:
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", _cases(300, 3300, (0, 1, 4)), ids=lambda c: f"{c['kind']}-w{c['workers']}-{c['seed']}"
)
def test_resume_at_random_steps_equals_an_uninterrupted_run_slow(case: dict[str, Any]) -> None:
    _check(case)

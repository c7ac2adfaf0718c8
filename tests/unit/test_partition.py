"""Node partitions (fastload.read.partition, ShardedSampler(partition="node")): fixed parts of
near-equal bytes, shuffled within a node, equal steps everywhere, minimal moves on N -> M."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import fastload
from fastload.config import Settings
from fastload.errors import ConfigError
from fastload.loader.sampler import ShardedSampler
from fastload.read import partition
from fastload.read.reader import Reader

TOPOLOGY_ENV = ("GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "SLURM_NODEID", "SLURM_NNODES")


class Sized:
    """A dataset whose items have names and sizes, as a FileDataset's do."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def item_keys(self) -> list[str]:
        return [f"s3://bucket/train/{i:06d}.jpg" for i in range(len(self.sizes))]

    def item_sizes(self) -> list[int]:
        return self.sizes


def lognormal(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).lognormal(11, 0.6, n).astype(int).tolist()


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TOPOLOGY_ENV:
        monkeypatch.delenv(name, raising=False)


def test_node_count_changes_move_about_the_least_share() -> None:
    # 2 -> 3 nodes must move a third of the bytes (to the new node), 3 -> 2 the third
    # the removed node held; rendezvous hashing moves little more. Reassigning every
    # item from scratch (a new split by position) would move about half or more.
    ds = Sized(lognormal(3000))
    keys, sizes = ds.item_keys(), ds.item_sizes()
    for before, after in ((2, 3), (3, 2)):
        items, nbytes, least = partition.moved(keys, sizes, before, after)
        assert least == sum(sizes) // 3
        assert nbytes <= 1.2 * least, (before, after, nbytes / least)
        assert items <= 1.2 * len(keys) / 3, (before, after, items)


def test_parts_hold_near_equal_bytes_and_are_pure() -> None:
    ds = Sized(lognormal(2000, seed=1))
    for nodes in (2, 3, 5):
        owner = partition.assign(ds.item_keys(), ds.item_sizes(), nodes)
        loads = np.bincount(owner, weights=ds.sizes, minlength=nodes)
        assert loads.max() / loads.mean() < 1.02, (nodes, loads)
        # Computed again (another machine, another run): the same parts.
        assert (partition.assign(ds.item_keys(), ds.item_sizes(), nodes) == owner).all()


def samplers(ds: object, nodes: int, per_node: int, **kw: object) -> list[ShardedSampler]:
    world = nodes * per_node
    return [ShardedSampler(ds, world, r, nodes=nodes, node_rank=r // per_node, partition="node", **kw)  # type: ignore[arg-type]
            for r in range(world)]


def test_node_parts_stay_fixed_and_shuffle_within_each_epoch() -> None:
    ds = Sized([1000] * 64)
    ranks = samplers(ds, nodes=2, per_node=2, seed=3)
    parts: list[set[int]] = [set(), set()]
    orders = []
    for epoch in range(3):
        seen: list[int] = []
        for s in ranks:
            s.set_epoch(epoch)
            seen += s.indices()
        assert sorted(seen) == list(range(64))  # the epoch covers the dataset once
        for node in (0, 1):
            got = set(ranks[2 * node].indices()) | set(ranks[2 * node + 1].indices())
            assert len(got) == 32
            if epoch:
                assert got == parts[node]  # the node's part is the same every epoch
            parts[node] = got
        orders.append(ranks[0].indices())
    assert orders[0] != orders[1] != orders[2]  # but its order is not


def test_every_rank_takes_the_same_steps_when_parts_differ_in_count() -> None:
    ds = Sized(lognormal(101, seed=2))
    for drop_last in (False, True):
        ranks = samplers(ds, nodes=3, per_node=2, drop_last=drop_last)
        lengths = {len(s.indices()) for s in ranks} | {len(s) for s in ranks}
        assert len(lengths) == 1, lengths
        for node in range(3):  # no rank strays outside its node's part
            a, b = ranks[2 * node].indices(), ranks[2 * node + 1].indices()
            assert set(a) | set(b) <= set(ranks[2 * node]._part)
        if not drop_last:
            covered = set().union(*(s.indices() for s in ranks))
            assert covered == set(range(101))


def test_node_partition_resumes_exactly() -> None:
    ds = Sized(lognormal(80, seed=4))
    first = samplers(ds, nodes=2, per_node=2, seed=7)[3]
    first.set_epoch(5)
    full = first.indices()
    state = first.state_dict()
    again = samplers(ds, nodes=2, per_node=2, seed=0)[3]
    again.load_state_dict(state)
    again.set_start(7)
    assert list(again) == full[7:]


def test_global_stays_the_default() -> None:
    ds = Sized([1] * 10)
    assert ShardedSampler(ds, 2, 1, shuffle=False).indices() == [1, 3, 5, 7, 9]  # type: ignore[arg-type]


def test_topology_from_torchrun_and_slurm_and_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="nodes= and node_rank="):
        partition.topology(4, 1)
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert partition.topology(4, 3) == partition.Topology(2, 1, 2, 1)
    with pytest.raises(ConfigError, match="rank=1 is not on node 1"):
        partition.topology(4, 1)
    for name, value in (("GROUP_RANK", "0"), ("LOCAL_WORLD_SIZE", "4"), ("WORLD_SIZE", "12")):
        monkeypatch.setenv(name, value)
    assert partition.topology(12, 2) == partition.Topology(3, 0, 4, 2)  # torchrun's wins over Slurm's
    with pytest.raises(ConfigError, match="partition="):
        ShardedSampler(Sized([1] * 8), 2, 0, partition="nodes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="only apply with distributed=True"):
        fastload.DataLoader(list(range(8)), partition="node")


def make_files(root: Path, n: int) -> None:
    root.mkdir()
    for i in range(n):
        (root / f"{i:03d}.bin").write_bytes(bytes([i]) * (500 + 37 * i))


def test_stage_fetches_exactly_one_nodes_part_and_logs_moves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_files(tmp_path / "remote", 40)
    url = str(tmp_path / "remote")
    for node in (0, 1):
        settings = Settings(cache_dir=tmp_path / f"cache{node}")
        report = fastload.stage(url, settings=settings, progress=False, nodes=2, node_rank=node)
        ds = fastload.FileDataset(url, settings=settings)
        reads = set()
        for rank in (2 * node, 2 * node + 1):
            reads |= {ds.items[i].url for i in ShardedSampler(ds, 4, rank, partition="node", nodes=2, node_rank=node).indices()}
        reader = Reader(settings)
        cached = {i.url for i in ds.items if all(reader.cache.entry(reader.identity.key(i, b)) for b in reader.identity.blocks(i))}
        assert cached == reads  # what the node reads is staged, and nothing else
        assert report.items == len(reads) and report.node == f"{node}/2"
    # Rerun the node-0 cache as one of three nodes: the move is logged, in bytes.
    settings = Settings(cache_dir=tmp_path / "cache0")
    ds = fastload.FileDataset(url, settings=settings)
    with caplog.at_level(logging.INFO, logger="fastload"):
        ShardedSampler(ds, 3, 0, partition="node", nodes=3, node_rank=0)
    assert "split over 3 nodes, was 2" in caplog.text


def test_cli_stages_one_nodes_part_with_the_rank_from_slurm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from fastload.cli import main

    make_files(tmp_path / "remote", 30)
    url, cache = str(tmp_path / "remote"), str(tmp_path / "cache")
    assert main(["cache", url, "--cache-dir", cache, "--nodes", "3", "--json"]) == 1
    assert "--node-rank" in capsys.readouterr().err  # no rank anywhere: said so, nothing staged
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert main(["cache", url, "--cache-dir", cache, "--nodes", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ds = fastload.FileDataset(url, settings=Settings(cache_dir=Path(cache)))
    part = ShardedSampler(ds, 3, 2, partition="node", nodes=3, node_rank=2)._part
    assert report["node"] == "2/3" and report["items"] == len(part)
    assert report["remote_bytes"] == sum(ds.items[i].size for i in part)


def test_a_node_partitioned_loader_resumes_mid_epoch() -> None:
    data = list(range(50))

    def loader() -> fastload.DataLoader:
        return fastload.DataLoader(data, batch_size=4, shuffle=True, distributed=True, rank=3, world_size=4,
                                   partition="node", nodes=2, node_rank=1, seed=9)

    first = loader()
    first.set_epoch(2)
    whole = [b.tolist() for b in first]
    assert set().union(*whole) <= set(first.sampler._part)  # type: ignore[attr-defined]
    it = iter(first)
    head = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    again = loader()
    again.load_state_dict(state)
    assert head + [b.tolist() for b in again] == whole


def test_a_dataset_too_small_for_its_nodes_is_named() -> None:
    with pytest.raises(ConfigError, match="3 items split over 4 nodes leave a part of 0"):
        samplers(Sized([1, 1, 1]), nodes=4, per_node=1)

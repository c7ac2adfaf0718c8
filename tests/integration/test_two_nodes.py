"""Two real torchrun nodes (2 ranks each, gloo, their own caches) read one nginx for 3 epochs.

With partition="node" each node fetches its own half once, so the server sends about
one dataset in all; with partition="global" each node meets most of the dataset.
Bytes sent come from nginx's access log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("two_node_script.py")
ROOT = Path(__file__).resolve().parents[2]
ITEMS, ITEM_BYTES, EPOCHS = 64, 8192, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(url: str, partition: str, base: Path) -> list[dict[str, Any]]:
    """Both nodes' agents, run at once; each rank's record."""
    out = base / partition
    out.mkdir()
    port = _free_port()
    agents = []
    for node in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            "FASTLOAD_CACHE_DIR": str(base / f"{partition}-cache{node}"),
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
            "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(SCRIPT), url, partition, str(out),
        ]  # fmt: skip
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for agent in agents:
        try:
            logs.append(agent.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _sent(log: Path) -> int:
    """Body bytes nginx sent for the dataset's files (not its folder page)."""
    total = 0
    for line in log.read_text().splitlines():
        request, _, rest = line.partition('"')[2].partition('"')
        method, path = request.split()[:2]
        if method == "GET" and not path.endswith("/"):
            total += int(rest.split()[1])
    return total


def test_node_partitions_cross_the_link_once_and_global_ones_do_not(
    tmp_path: Path, nginx_server: Callable[..., Any]
) -> None:
    www = tmp_path / "www"
    www.mkdir()
    for i in range(ITEMS):
        (www / f"{i:03d}.bin").write_bytes(os.urandom(ITEM_BYTES))
    server = nginx_server(www)
    log = server.workdir / "access.log"
    dataset = ITEMS * ITEM_BYTES
    ranks = _job(server.url + "/", "node", tmp_path)
    node_ratio = _sent(log) / dataset
    # The same job reshuffling across nodes (the default), against the same server.
    global_ranks = _job(server.url + "/", "global", tmp_path)
    global_ratio = _sent(log) / dataset - node_ratio
    print(f"\nserver sent / dataset: partition='node' {node_ratio:.3f}, partition='global' {global_ratio:.3f}")

    assert len({r["steps"] for r in ranks}) == 1  # every rank steps alike
    for epoch in range(EPOCHS):
        for job in (ranks, global_ranks):
            seen = [u for r in job for u in r["epochs"][epoch]]
            assert len(seen) == ITEMS and len(set(seen)) == ITEMS  # each epoch covers the dataset once
    touched: list[set[str]] = [set(), set()]
    for r in ranks:
        for epoch in r["epochs"]:
            touched[r["node"]] |= set(epoch)
        assert r["epochs"][0] != r["epochs"][1] != r["epochs"][2]  # orders differ between epochs
    shares = [len(t) / ITEMS for t in touched]
    print(f"items per node / items: {shares[0]:.3f}, {shares[1]:.3f}")
    assert all(0.45 <= share <= 0.55 for share in shares) and not touched[0] & touched[1]
    assert 0.99 <= node_ratio <= 1.1  # each byte crossed once per cluster
    assert global_ratio > 1.4  # each node met most of the dataset: ~1.75 x

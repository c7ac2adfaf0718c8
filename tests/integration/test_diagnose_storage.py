"""The storage probe finds a kernel-shaped link's rate, end to end.

nginx serves sample JPEGs inside a network namespace whose loopback carries
``tc tbf rate R``; ``fastload diagnose --json URL`` runs inside the namespace too
(its 127.0.0.1 is private to it). The measured best throughput must be within
25% of R, and the verdict's storage row must follow from it. Needs root
(the ``shaped_link`` fixture skips with the reason otherwise).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RATES = {"100mbit": 12.5e6, "200mbit": 25e6}


@pytest.fixture(scope="module")
def www(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fastload.samples import make_image_folder

    root = tmp_path_factory.mktemp("www")
    make_image_folder(root / "train", n=40)
    return root


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rate", sorted(RATES))
def test_storage_probe_finds_the_shaped_rate(rate, www, tmp_path, shaped_link, nginx_server):
    link = shaped_link(rate=rate)
    http = nginx_server(www, netns=link.name)
    url = f"{http.url}/train/"
    cmd = [sys.executable, "-m", "fastload", "diagnose", "--json", "--quick", "--no-gpu",
           "--cache-dir", str(tmp_path / "cache"), url]
    done = link.run_in(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)

    store = report["storage"]
    assert store["status"] == "ok", store
    assert store["objects"] == 40 and store["listing"]["items"] == 40
    sizes = [p.stat().st_size for p in (www / "train").rglob("*.jpg")]
    # nginx's autoindex lists no exact sizes, so the average comes from HEADs of 8 objects.
    assert store["sizes_from"] == "HEAD of 8 objects"
    assert min(sizes) <= store["avg_object_bytes"] <= max(sizes)
    nominal = RATES[rate]
    assert 0.75 * nominal <= store["best_bps"] <= 1.25 * nominal, (rate, store["levels"])

    verdict = report["verdict"]
    by = {s["name"]: s for s in verdict["ops"]}
    assert by["storage"]["samples_per_s"] == pytest.approx(store["best_bps"] / store["avg_object_bytes"])
    cold = [s for s in verdict["ops"] if s["in_path"] and s["epochs"] in ("cold", "all") and s["samples_per_s"]]
    assert verdict["cold"]["limit"] == min(cold, key=lambda s: s["samples_per_s"])["name"]


def test_storage_probe_over_s3_reads_sizes_from_the_listing(www, moto_server, s3_bucket, s3_options):
    from fastload._servers import upload_tree
    from fastload.diagnose.storage import StorageBudget, probe_storage

    upload_tree(www / "train", moto_server.endpoint_url, s3_bucket, "train")
    got = probe_storage(f"s3://{s3_bucket}/train/", s3_options, pattern="**/*.jpg",
                        budget=StorageBudget(level_s=0.2, max_connections=4, ttfb_requests=3))
    sizes = [p.stat().st_size for p in (www / "train").rglob("*.jpg")]
    assert got["status"] == "ok" and got["protocol"] == "s3"
    assert got["sizes_from"] == "listing" and got["dataset_bytes"] == sum(sizes)
    assert got["listing"]["matched"] == 40 and got["objects"] == 40
    assert [lv["connections"] for lv in got["levels"]][:2] == [1, 2]
    assert got["best_bps"] > 0 and got["ttfb_ms"]["n"] == 3

"""One reader of a dataset, started with others on one cache folder (tests/integration/test_one_get_per_node.py).

Usage: python one_get_script.py URL CACHE_DIR GO_FILE OUT_JSON ORDER HOW [BLOCK_BYTES]

Opens ``fastload.FileDataset(URL)`` (an nginx folder: a listing without sizes), writes
OUT_JSON.ready, waits until GO_FILE exists (so the readers start together), then reads every sample in ORDER
(``up`` or ``down``) and writes OUT_JSON: a digest per URL, blocks fetched here, seconds.

HOW: ``batches`` (read_batch of 8 at a time: the read path, Fetcher.complete), ``ahead``
(fetch_ahead of 64 samples, then their reads: the fetch-ahead path, as fastload.DataLoader
does) or ``loader`` (a fastload.DataLoader, batch_size=8, num_workers=0).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path


def main(url: str, cache_dir: str, go: str, out: str, order: str, how: str, block_bytes: str = "8MiB") -> int:
    import fastload
    from fastload.config import Settings, parse_size

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    settings = Settings(cache_dir=Path(cache_dir), block_bytes=parse_size(block_bytes), request_timeout_s=20.0)
    ds = fastload.FileDataset(url, settings=settings)
    n = len(ds)
    indices = list(range(n)) if order == "up" else list(range(n - 1, -1, -1))
    Path(out + ".ready").write_text("")
    while not os.path.exists(go):
        time.sleep(0.001)
    t0 = time.perf_counter()
    samples = []
    if how == "loader":
        loader = fastload.DataLoader(ds, batch_size=8, sampler=indices, collate_fn=lambda b: b)
        for batch in loader:
            samples += batch
    else:
        for k in range(0, n, 8):
            if how.startswith("ahead") and k % 64 == 0:
                ds.fetch_ahead(indices[k : k + 64])
            samples += ds.read_batch(indices[k : k + 8])
    seconds = time.perf_counter() - t0
    digests = {s["url"]: hashlib.sha256(bytes(s["data"])).hexdigest() for s in samples}
    Path(out).write_text(json.dumps({"digests": digests, "fetched": ds.reader.misses, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""A key-list s3:// dataset gets to its first GET cheaply (issue 34, item 6): what it leaves undone is checked
here; how long it takes is measured, not tested (the figure and the script: docs/storage.md).

s3fs (with aiobotocore and aiohttp, ~0.2 s of CPU to import) is not imported before the first GET,
and botocore's own data files are parsed into plain dicts (s3_resolve._Plain), not by its
OrderedDict loader, which took twice the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import json, sys
import fastload
from fastload.config import Settings
from pathlib import Path
import botocore.loaders

parsed = []
_load = botocore.loaders.JSONFileLoader._load_file
botocore.loaders.JSONFileLoader._load_file = lambda self, path, how: parsed.append(path) or _load(self, path, how)
urls = [f"s3://bucket/k{i}" for i in range(100)]
options = {"key": "AK", "secret": "SK", "endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "us-east-1"}}
ds = fastload.FileDataset(urls, storage_options=options, settings=Settings(cache_dir=Path(sys.argv[1])))
route = ds.reader.sources.of(urls[0]).route
wire = route.wire(urls[0])
batch, lines = route.sign([wire], ["Range: bytes=0-9"])
print(json.dumps({"wire": wire, "signed": bool(lines), "s3fs": "s3fs" in sys.modules, "parsed": parsed}))
"""


def _run(cache: Path) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_first_get_is_ready_without_s3fs_and_botocores_ordered_parse(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    from fastload.transport import curl

    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    got = _run(tmp_path / "cache")
    assert got["wire"] == "http://127.0.0.1:9/bucket/k0" and got["signed"] is True
    assert got["s3fs"] is False
    assert not [p for p in got["parsed"] if "service-2" in p or "endpoints" in p]  # type: ignore[union-attr]

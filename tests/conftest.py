"""Shared fixtures: real nginx, moto S3, a GCS emulator and shaped-link servers.

Where a server is missing, its tests skip with the reason, and the run ends with
one line per missing server saying how many tests skipped and how to get it.
Under FASTLOAD_REQUIRE_SERVERS=1 (set by .ci/run after installing them), a
missing nginx or moto fails the test instead of hiding it. Traffic shaping needs
root, so a shaped-link test skips without it even in CI.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fastload import _servers

ROOT = Path(__file__).resolve().parents[1]
# gcsfs >= 2026.10 asks GCS's gRPC control plane for each bucket's layout, and an
# emulator has none: each call then waits 60 s before gcsfs falls back. Read at its import.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="session")
def load_script() -> Callable[[str], ModuleType]:
    """Loads a script by its path under the repo (benchmarks/ is not a package and stays
    out of pytest's collection); each path is loaded once per session."""

    def load(rel: str) -> ModuleType:
        name = "fastload_script_" + re.sub(r"\W", "_", rel)
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, ROOT / rel)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
        return module

    return load


# Reasons require_server skipped for, each with how to get the server; the summary
# line counts the skipped tests per reason (tests/integration/test_fresh_machine.py).
_MISSING_SERVERS: dict[str, str] = {}
NGINX_MISSING = "nginx not found"
NGINX_HOW = "`sudo make test` installs it (scripts/install-test-deps), or: apt-get install nginx"


def require_server(available: bool, reason: str, how: str = "") -> None:
    """Skips the test when a server is unavailable, or fails it in CI."""
    if available:
        return
    if os.environ.get("FASTLOAD_REQUIRE_SERVERS") == "1":
        pytest.fail(f"{reason} (FASTLOAD_REQUIRE_SERVERS=1, so this fails instead of skipping)")
    _MISSING_SERVERS[reason] = how
    pytest.skip(reason)  # how to get it: once, in the summary line


def pytest_terminal_summary(terminalreporter: Any) -> None:
    skipped = [str(getattr(r, "longrepr", "")) for r in terminalreporter.stats.get("skipped", [])]
    for reason, how in _MISSING_SERVERS.items():
        n = sum(reason in text for text in skipped)
        terminalreporter.write_line(f"fastload: {n} tests skipped: {reason}; {how or 'install it'}")


@pytest.fixture
def nginx_server() -> Iterator[Callable[..., _servers.NginxServer]]:
    """Factory: ``nginx_server(root, **kwargs)`` starts nginx over ``root``.

    Every server it started is stopped (and its processes reaped) on teardown.
    """
    require_server(_servers.nginx_available(), NGINX_MISSING, NGINX_HOW)
    started: list[_servers.NginxServer] = []

    def start(root: Path, **kwargs: Any) -> _servers.NginxServer:
        server = _servers.NginxServer(root, **kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[_servers.MotoServer]:
    """One moto S3 server for the session; use unique buckets (``s3_bucket``)."""
    require_server(_servers.moto_available(), "moto server missing", "pip install 'moto[server]'")
    require_server(importlib.util.find_spec("s3fs") is not None, "s3fs missing", "pip install s3fs")
    with _servers.MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def signed_moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_servers.SignedMotoServer]:
    """moto's S3 in a child process that checks every signature (bucket "signed"), for the session."""
    require_server(_servers.moto_available(), "moto server missing", "pip install 'moto[server]'")
    server = _servers.SignedMotoServer(tmp_path_factory.mktemp("signed-moto") / "requests.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_servers.GcsEmulator]:
    """gcp-storage-emulator in a child process for the session; use unique buckets."""
    require_server(_servers.gcs_emulator_available(), "gcp-storage-emulator missing", "pip install gcp-storage-emulator")
    require_server(importlib.util.find_spec("gcsfs") is not None, "gcsfs missing", "pip install gcsfs")
    server = _servers.GcsEmulator(tmp_path_factory.mktemp("gcs-emulator") / "requests.log").start()
    yield server
    server.stop()


@pytest.fixture
def no_aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS credentials, profile, region or instance metadata from this machine: what a test passes is all."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION",
                "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3_options(moto_server: _servers.MotoServer) -> dict[str, Any]:
    """s3fs ``storage_options`` that point at the session's moto server."""
    return _servers.s3_storage_options(moto_server.endpoint_url)


@pytest.fixture
def s3_bucket(moto_server: _servers.MotoServer) -> Iterator[str]:
    """A fresh, empty bucket name on the moto server, removed afterwards."""
    import s3fs  # present: moto_server checked it

    bucket = f"fastload-test-{uuid.uuid4().hex[:12]}"
    _servers.create_bucket(moto_server.endpoint_url, bucket)
    yield bucket
    fs = s3fs.S3FileSystem(
        skip_instance_cache=True, **_servers.s3_storage_options(moto_server.endpoint_url)
    )
    fs.rm(bucket, recursive=True)


@pytest.fixture
def shaped_link() -> Iterator[Callable[..., _servers.ShapedLink]]:
    """Factory: ``shaped_link(rate="200mbit", ...)`` builds a shaped namespace.

    Skips (always, root is not something CI can install) when shaping is
    unavailable. Every namespace is deleted on teardown.
    """
    reason = _servers.shaping_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    made: list[_servers.ShapedLink] = []

    def make(**kwargs: Any) -> _servers.ShapedLink:
        link = _servers.ShapedLink(**kwargs)
        made.append(link)
        return link.start()

    yield make
    for link in reversed(made):
        link.close()

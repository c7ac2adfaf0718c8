"""A GCS emulator (gcp-storage-emulator, from PyPI) in a child process on a free port.

It speaks GCS's JSON API: bucket and object upload, listing with prefix and
delimiter, media download with Range. Its media downloads carry no
``x-goog-generation`` header (real GCS sends one), so an object read from a key
list gets no version there (docs/storage.md lists what has not run against GCS).

Private: import it through :mod:`fastload._servers`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from fastload._servers.errors import ServerError
from fastload._servers.ports import free_port, wait_listening

__all__ = ["GcsEmulator", "gcs_emulator_available"]


def gcs_emulator_available() -> bool:
    """Whether ``gcp-storage-emulator`` is importable here (the test extra installs it)."""
    return importlib.util.find_spec("gcp_storage_emulator") is not None


class GcsEmulator:
    """gcp-storage-emulator serving from memory, each request one line of :attr:`log`.

    gcsfs talks to it with ``storage_options={"endpoint_url": emulator.endpoint_url,
    "token": "anon"}`` (:meth:`storage_options`).
    """

    def __init__(self, log: Path, host: str = "127.0.0.1") -> None:
        self.host, self.log = host, log
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise ServerError("GcsEmulator.endpoint_url is only known after start()")
        return f"http://{self.host}:{self.port}"

    def storage_options(self) -> dict[str, Any]:
        """gcsfs's options for this emulator: its endpoint, no credentials."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "fastload"}

    def start(self) -> GcsEmulator:
        self.port = free_port(self.host)
        with open(self.log, "wb") as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", self.host, "--port", str(self.port),
                 "--in-memory"], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_listening(self.host, self.port, self._proc, "gcp-storage-emulator", self.log)
        except ServerError:
            self.stop()
            raise
        return self

    def _call(self, method: str, path: str, data: bytes | None = None, content_type: str = "application/json") -> Any:
        req = urllib.request.Request(self.endpoint_url + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        with urllib.request.urlopen(req, timeout=30) as answer:
            body = answer.read()
        return json.loads(body) if body else None

    def create_bucket(self, bucket: str) -> None:
        self._call("POST", "/storage/v1/b?project=fastload", json.dumps({"name": bucket}).encode())

    def upload(self, bucket: str, name: str, data: bytes) -> dict[str, Any]:
        """Store ``data`` as ``name``; returns the object's metadata (its ``generation``...)."""
        path = f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=media&name={quote(name, safe='')}"
        meta: dict[str, Any] = self._call("POST", path, data, "application/octet-stream")
        return meta

    def upload_tree(self, root: Path, bucket: str, prefix: str = "") -> int:
        """Upload every file under ``root`` as ``prefix + relative path``; returns how many."""
        files = sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            self.upload(bucket, prefix + path.relative_to(root).as_posix(), path.read_bytes())
        return len(files)

    def requests(self, method: str, path_prefix: str, status: int | None = None) -> int:
        """How many ``method`` requests for paths under ``path_prefix`` (answered ``status``) the log holds."""
        line = re.compile(rf'"{method} {re.escape(path_prefix)}\S* HTTP/1\.[01]" (\d+)')
        return sum(1 for m in line.finditer(self.log.read_text(errors="replace"))
                   if status is None or int(m.group(1)) == status)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

"""Free ports and waiting for a server child to listen: shared by the servers started as processes.

Private: used by :mod:`fastload._servers`' modules.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from fastload._servers.errors import ServerError


def free_port(host: str) -> int:
    """A port the kernel has free on ``host`` now (a server that cannot listen on port 0 is handed
    it; another process may take it in between, so callers that can retry do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], what: str, log: Path,
                   timeout_s: float = 30.0) -> None:
    """Return once ``proc`` accepts connections on ``host:port``.

    Raises:
        ServerError: It exited, or did not listen within ``timeout_s`` (the end of ``log`` says why).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError as err:
            if time.monotonic() > deadline or proc.poll() is not None:
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise ServerError(f"{what} did not start on port {port}: {tail}") from err
            time.sleep(0.1)

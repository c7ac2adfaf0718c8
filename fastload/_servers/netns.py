"""Kernel-shaped slow links for benchmarks: a network namespace plus ``tc tbf``.

A :class:`ShapedLink` is a Linux network namespace whose loopback is throttled
by a token-bucket filter, so a real server and a real client talk over a link
of a chosen rate while traffic never leaves 127.0.0.1. It needs root.

The namespace's ``127.0.0.1`` is private to it: Python code in the parent
namespace *cannot* connect to a server started inside. Start the server there
(``NginxServer(root, netns=link.name)``) and run the client there too, e.g.
``link.run_in([sys.executable, "benchmarks/x/bench.py", "--url", url])``.

Private: import it through :mod:`fastload._servers`.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
from typing import Any

from fastload._servers.errors import ServerError

__all__ = ["ShapedLink", "shaping_available", "shaping_unavailable_reason"]


def _ip(args: list[str]) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ServerError(
            f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}"
        )


@functools.cache
def shaping_unavailable_reason() -> str | None:
    """Returns why a :class:`ShapedLink` cannot be built here, or None if it can.

    Tries a throwaway namespace once per process, since containers often lack
    the capability even as root.
    """
    if os.geteuid() != 0:
        return "traffic shaping needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"traffic shaping needs {' and '.join(missing)} (apt-get install iproute2)"
    try:
        with ShapedLink(name_prefix="flprobe"):
            pass
    except (ServerError, OSError, subprocess.SubprocessError) as err:
        return f"cannot build a shaped network namespace here: {err}"
    return None


def shaping_available() -> bool:
    """Returns True when :class:`ShapedLink` works here (root, ip, tc, netns)."""
    return shaping_unavailable_reason() is None


class ShapedLink:
    """A network namespace whose loopback is rate-limited by ``tc tbf``.

    Run a server in it (``NginxServer(..., netns=link.name)``) and the client
    in it too (:meth:`run_in`, :meth:`popen_in`); see the module docstring.
    Needs root. The namespace is deleted on exit, also after an error.

    Args:
        name_prefix: Prefix of the namespace name (pid and a random suffix follow).
        rate: tbf rate in tc units ("200mbit" is 25 MB/s).
        burst: tbf bucket size. It must hold at least one loopback packet (64 KiB)
            and about rate/HZ bytes, so raise it for rates above ~1gbit.
        latency: tbf queueing limit (how long a packet may wait for tokens).
    """

    def __init__(
        self,
        name_prefix: str = "fl",
        rate: str = "200mbit",
        burst: str = "128kb",
        latency: str = "100ms",
    ) -> None:
        self.name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self._created = False

    @property
    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def start(self) -> ShapedLink:
        """Creates the namespace, brings up its loopback, and adds the qdisc."""
        _ip(["netns", "add", self.name])
        self._created = True
        try:
            _ip(["netns", "exec", self.name, "ip", "link", "set", "lo", "up"])
            tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
            _ip(["netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "root", *tbf])
        except BaseException:
            self.close()
            raise
        return self

    def run_in(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run(cmd, **kwargs)`` inside the namespace."""
        return subprocess.run([*self.exec_prefix, *cmd], **kwargs)

    def popen_in(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(cmd, **kwargs)`` inside the namespace."""
        return subprocess.Popen([*self.exec_prefix, *cmd], **kwargs)

    def close(self) -> None:
        """Deletes the namespace. Idempotent."""
        if self._created:
            self._created = False
            _ip(["netns", "delete", self.name])

    def __enter__(self) -> ShapedLink:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

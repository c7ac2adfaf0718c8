"""A real nginx serving a directory: Range requests, autoindex, ETags.

nginx cannot listen on port 0, so :class:`NginxServer` picks a free port and
retries when another process wins the race. With ``netns=`` it runs inside a
:class:`~fastload._servers.netns.ShapedLink` namespace, reachable only from there.

Private: import it through :mod:`fastload._servers`.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastload._servers.errors import ServerError
from fastload._servers.ports import free_port

__all__ = ["NginxServer", "find_nginx", "nginx_available"]


# Debian puts nginx in /usr/sbin, which is not on a non-root user's PATH.
_NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")

# Runs inside a namespace: exits 0 if host:port accepts a TCP connection, else 1.
_PROBE = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 0.5)"


def find_nginx() -> str | None:
    """Returns the path of the nginx binary, or None when there is none."""
    found = shutil.which("nginx")
    if found:
        return found
    return next((c for c in _NGINX_CANDIDATES if os.access(c, os.X_OK)), None)


@functools.cache
def nginx_available() -> bool:
    """Returns True when an nginx binary exists and runs (``nginx -v``)."""
    binary = find_nginx()
    if binary is None:
        return False
    try:
        return subprocess.run([binary, "-v"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _nginx_quote(path: Path) -> str:
    text = str(path)
    # "$" would start an nginx variable and '"' or "\\" would end or escape the quoting.
    if any(ch in text for ch in '"$\\\n'):
        raise ValueError(
            f"path {text!r} contains a character nginx cannot quote ('\"$\\\\' or newline)"
        )
    return f'"{text}"'


class NginxServer:
    """A real nginx serving one directory over HTTP, for tests and benchmarks.

    It serves ``root`` with autoindex (fsspec's HTTPFileSystem lists a directory
    by parsing its HTML links), Range requests, sendfile, ETag and Last-Modified.
    nginx runs in the foreground (``daemon off``) as our child, in its own
    process group, so :meth:`stop` ends exactly the processes it started.

    Args:
        root: Directory to serve; must exist.
        host: Address to listen on.
        port: Port to listen on; None picks a free one (retrying on a race).
        netns: Run nginx inside this network namespace (see :class:`ShapedLink`).
            Its URL is then reachable only from inside that namespace.
        workers: nginx ``worker_processes``.
        start_timeout_s: How long to wait for nginx to accept connections.
        unix_socket: Also listen on a Unix socket in the private temp dir
            (:attr:`unix_socket_path`). A proxy inside a shaped namespace reaches
            nginx through it without the bytes crossing the shaped loopback twice
            (benchmarks/peers).
        locations: Extra ``location`` blocks for the server (nginx syntax), ahead of
            the catch-all static one: benchmarks/s3 answers S3 listings from files.
    """

    def __init__(
        self,
        root: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        netns: str | None = None,
        workers: int = 2,
        start_timeout_s: float = 15.0,
        unix_socket: bool = False,
        locations: str = "",
    ) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"nginx root {self.root} is not a directory")
        self.host = host
        self.port = port
        self.netns = netns
        self.workers = workers
        self.start_timeout_s = start_timeout_s
        self.unix_socket = unix_socket
        self.locations = locations
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. ``http://127.0.0.1:8123``."""
        if self.port is None or self._proc is None:
            raise ServerError("NginxServer.url is only known after start()")
        return f"http://{self.host}:{self.port}"

    @property
    def unix_socket_path(self) -> Path | None:
        """The Unix socket nginx also listens on (``unix_socket=True``), else None."""
        return self._tmp / "nginx.sock" if (self.unix_socket and self._tmp is not None) else None

    @property
    def pid(self) -> int | None:
        """PID of the nginx master process, or None when not running."""
        return None if self._proc is None else self._proc.pid

    @property
    def workdir(self) -> Path | None:
        """Private temp dir with nginx.conf and the logs; None when stopped."""
        return self._tmp

    def error_log_tail(self, lines: int = 20) -> str:
        """Returns the last ``lines`` lines of nginx's error log and stderr."""
        if self._tmp is None:
            return ""
        text = ""
        # stderr repeats the error log, so it only helps when the log is empty.
        for name in ("error.log", "stderr.log"):
            path = self._tmp / name
            if not text and path.exists():
                text = path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> NginxServer:
        """Starts nginx and waits until it accepts connections.

        Raises:
            ServerError: nginx is missing, exited, or never accepted a connection;
                the message carries the tail of its error log.
        """
        binary = find_nginx()
        if binary is None:
            raise ServerError("nginx not found; install it (apt-get install nginx)")
        tmp = self._tmp = Path(tempfile.mkdtemp(prefix="fastload-nginx-"))
        fixed_port = self.port
        attempt = 0
        try:
            while True:
                attempt += 1
                self.port = fixed_port if fixed_port is not None else free_port(self.host)  # nginx cannot listen on port 0; retried if taken
                if self._launch(binary, tmp):
                    return self
                status = None if self._proc is None else self._proc.poll()
                log = self.error_log_tail()
                self._kill()
                # Only a lost race for an auto-picked port is worth another try.
                lost_race = fixed_port is None and "Address already in use" in log
                if not lost_race or attempt >= 5:
                    what = (
                        f"did not accept connections within {self.start_timeout_s:.0f} s"
                        if status is None
                        else f"exited with status {status}"
                    )
                    raise ServerError(
                        f"nginx on {self.host}:{self.port} (netns={self.netns}) {what}; "
                        f"error log tail:\n{log}"
                    )
        except BaseException:
            self.stop()
            raise

    def _write_config(self, tmp: Path) -> Path:
        # Running as root, nginx drops workers to "nobody", which cannot read
        # pytest's 0700 temp dirs; keep workers as the current user instead.
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
        temp_paths = "\n".join(
            f"    {kind}_temp_path {_nginx_quote(tmp / kind)};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        unix_path = Path(f"unix:{tmp / 'nginx.sock'}")
        # Behind a proxy nginx cannot know the client's port, so its folder redirects
        # ("/dir" -> "/dir/") must be relative to reach the client through the proxy.
        unix_listen = (
            f"\n        listen {_nginx_quote(unix_path)};\n        absolute_redirect off;"
            if self.unix_socket
            else ""
        )
        conf = f"""
daemon off;
worker_processes {int(self.workers)};
pid {_nginx_quote(tmp / "nginx.pid")};
error_log {_nginx_quote(tmp / "error.log")} warn;
{user}
events {{ worker_connections 1024; }}
http {{
    access_log {_nginx_quote(tmp / "access.log")};
{temp_paths}
    types {{ text/html html; image/jpeg jpg jpeg; application/x-tar tar; }}
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    server {{
        listen {self.host}:{int(self.port or 0)};{unix_listen}
        server_name localhost;
        root {_nginx_quote(self.root)};
{self.locations}
        location / {{ autoindex on; autoindex_format html; etag on; }}
    }}
}}
"""
        path = tmp / "nginx.conf"
        path.write_text(conf)
        return path

    def _launch(self, binary: str, tmp: Path) -> bool:
        conf = self._write_config(tmp)
        for name in ("error.log", "stderr.log"):  # a retry must not see old errors
            (tmp / name).unlink(missing_ok=True)
        # -e sends even pre-config errors to our log instead of /var/log/nginx.
        cmd = [binary, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")]
        if self.netns is not None:
            # `ip netns exec` execs nginx in place, so the PID is nginx's own.
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        with open(tmp / "stderr.log", "ab") as stderr:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout_s
        pid_file = tmp / "nginx.pid"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            # nginx writes its pid file only after binding every listen socket,
            # so a connection accepted before that may be a squatter's, not ours.
            if self._pid_file_matches(pid_file) and self._accepts():
                return True
            time.sleep(0.05)
        return False

    def _pid_file_matches(self, pid_file: Path) -> bool:
        try:  # nginx removes the file when it exits, so no exists() check first
            pid = pid_file.read_text().strip()
        except FileNotFoundError:
            return False
        return self._proc is not None and pid == str(self._proc.pid)

    def _accepts(self) -> bool:
        if self.netns is None:
            with socket.socket() as sock:
                sock.settimeout(0.5)
                return sock.connect_ex((self.host, int(self.port or 0))) == 0
        # Our own 127.0.0.1 is not the namespace's, so probe from inside it.
        probe = ["ip", "netns", "exec", self.netns, sys.executable, "-c", _PROBE]
        try:
            done = subprocess.run(
                [*probe, self.host, str(self.port)], capture_output=True, timeout=9
            )
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM: nginx's fast shutdown, master reaps workers
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            # Killing only the master would orphan the workers and their socket;
            # the process group is nginx's alone (start_new_session=True).
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        """Stops nginx by PID, waits for it, and removes its temp dir. Idempotent."""
        self._kill()
        if self._tmp is not None:
            shutil.rmtree(self._tmp)
            self._tmp = None

    def __enter__(self) -> NginxServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

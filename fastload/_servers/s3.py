"""moto's S3 server on a free port, and s3fs helpers to fill it.

Private: import it through :mod:`fastload._servers`.
"""

from __future__ import annotations

import functools
import logging
import re
import urllib.request
from pathlib import Path
from typing import Any

from fastload._servers.errors import ServerError
from fastload._servers.ports import free_port, wait_listening

__all__ = ["MotoServer", "SignedMotoServer", "create_bucket", "moto_available", "s3_storage_options", "upload_tree"]


@functools.cache
def moto_available() -> bool:
    """Returns True when ``moto[server]`` is importable."""
    try:
        from moto.server import ThreadedMotoServer  # noqa: F401
    except ImportError:
        return False
    return True


class MotoServer:
    """moto's S3 server on a free port, in a thread of this process.

    State lives in moto's process-global backends, so two servers in one process
    share buckets; use unique bucket names (or :meth:`reset`).

    Args:
        host: Address to listen on.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port: int | None = None
        self._server: Any = None

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint, e.g. ``http://127.0.0.1:40123``."""
        if self.port is None:
            raise ServerError("MotoServer.endpoint_url is only known after start()")
        return f"http://{self.host}:{self.port}"

    def start(self) -> MotoServer:
        """Starts the server; returns once it is listening."""
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as err:
            raise ImportError("MotoServer needs moto's server: pip install 'moto[server]'") from err
        # Port 0 is safe here: werkzeug binds before start() returns and
        # get_host_and_port() reads the real port. A fixed busy port would make
        # moto's start() wait forever, which is why no port argument is offered.
        werkzeug_log = logging.getLogger("werkzeug")
        if werkzeug_log.level == logging.NOTSET:
            # Otherwise werkzeug prints one line per request to stderr, which
            # drowns benchmark and demo output; a level set by the user wins.
            werkzeug_log.setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address=self.host, port=0, verbose=False)
        self._server.start()
        self.port = int(self._server.get_host_and_port()[1])
        return self

    def reset(self) -> None:
        """Drops all buckets and objects in moto's backends."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def stop(self) -> None:
        """Shuts the server down and joins its thread. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        self.port = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def s3_storage_options(endpoint_url: str) -> dict[str, Any]:
    """Returns s3fs ``storage_options`` for a moto endpoint (dummy credentials)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
    }


def _s3fs(endpoint_url: str) -> Any:
    try:
        import s3fs
    except ImportError as err:
        raise ImportError("S3 helpers need s3fs: pip install 'fastload[s3]'") from err
    # A private instance: s3fs caches instances and listings per options, and a
    # cached listing would hide the objects we are about to write.
    return s3fs.S3FileSystem(skip_instance_cache=True, **s3_storage_options(endpoint_url))


def _ensure_bucket(fs: Any, bucket: str) -> None:
    if fs.exists(bucket):
        return
    # Not fs.mkdir: s3fs sends LocationConstraint=<region_name>, and S3 (and
    # moto) reject "us-east-1" as a location constraint.
    fs.call_s3("create_bucket", Bucket=bucket)
    fs.invalidate_cache()


def create_bucket(endpoint_url: str, bucket: str) -> None:
    """Creates ``bucket`` on the endpoint unless it exists."""
    _ensure_bucket(_s3fs(endpoint_url), bucket)


def upload_tree(local_dir: Path, endpoint_url: str, bucket: str, prefix: str = "") -> list[str]:
    """Uploads every file under ``local_dir`` to ``s3://bucket/prefix/...``.

    Creates the bucket if needed. Returns the sorted ``s3://`` URLs written.
    """
    local_dir = Path(local_dir)
    fs = _s3fs(endpoint_url)
    _ensure_bucket(fs, bucket)
    base = f"{bucket}/{prefix.strip('/')}".rstrip("/")
    urls = []
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        key = f"{base}/{path.relative_to(local_dir).as_posix()}"
        fs.put_file(str(path), key)
        urls.append(f"s3://{key}")
    return urls


class SignedMotoServer:
    """moto's S3, IAM and STS in a child process that checks every request's signature.

    moto checks signatures and access keys once ``INITIAL_NO_AUTH_ACTION_COUNT``
    requests have passed, a setting read when moto imports, so this server runs in
    its own process. Its first requests make an IAM user with an allow-all policy,
    its access key, and a role that user may assume (:meth:`start`); from then on
    a wrong secret, an unknown key or a bad session token is refused as AWS would.
    Each request is one line of :attr:`log` (werkzeug's access log: ``"GET /b/k HTTP/1.1" 206``).
    """

    _SETUP_ACTIONS = 6  # the requests start() makes before signatures are checked

    def __init__(self, log: Path, host: str = "127.0.0.1") -> None:
        self.host, self.log = host, log
        self.port: int | None = None
        self.key = self.secret = ""
        self._proc: Any = None

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise ServerError("SignedMotoServer.endpoint_url is only known after start()")
        return f"http://{self.host}:{self.port}"

    def start(self) -> SignedMotoServer:
        import json
        import os
        import subprocess
        import sys

        import boto3

        self.port = free_port(self.host)
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(self._SETUP_ACTIONS))
        with open(self.log, "wb") as out:
            self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                                          env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_listening(self.host, self.port, self._proc, "moto's server", self.log)
        except ServerError:
            self.stop()
            raise
        allow = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})
        trust = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]})
        iam = boto3.client("iam", endpoint_url=self.endpoint_url, aws_access_key_id="setup",
                           aws_secret_access_key="setup", region_name="us-east-1")
        iam.create_user(UserName="fastload")
        key = iam.create_access_key(UserName="fastload")["AccessKey"]
        iam.put_user_policy(UserName="fastload", PolicyName="all", PolicyDocument=allow)
        iam.create_role(RoleName="fastload", AssumeRolePolicyDocument=trust)
        iam.put_role_policy(RoleName="fastload", PolicyName="all", PolicyDocument=allow)
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.client("s3").create_bucket(Bucket="signed")  # the sixth request
        return self

    def client(self, service: str, key: str | None = None, secret: str | None = None, token: str | None = None) -> Any:
        """A boto3 client of this server, signed with the user's key unless others are given."""
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint_url, aws_access_key_id=key or self.key,
                            aws_secret_access_key=secret or self.secret, aws_session_token=token,
                            region_name="us-east-1")

    def requests(self, method: str, path_prefix: str, status: int | None = None) -> int:
        """How many ``method`` requests for paths under ``path_prefix`` (answered ``status``) the log holds."""
        needle = f'"{method} {path_prefix}'
        plain = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))  # werkzeug colours its lines
        lines = [line for line in plain.splitlines() if needle in line]
        if status is not None:
            lines = [line for line in lines if f'" {status} ' in line]
        return len(lines)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except Exception:
                proc.kill()
                proc.wait()
        self.port = None

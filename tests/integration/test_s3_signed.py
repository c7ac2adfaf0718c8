"""S3 GETs signed on libcurl (fastload.source.s3) against a moto server that checks every signature.

Each test reads objects through the user's road (FileDataset + DataLoader, or
staging) and counts the requests in the server's own log.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _servers
from fastload.config import Settings
from fastload.errors import CredentialsError
from fastload.source import RemoteItem, Source
from fastload.transport import curl

pytestmark = pytest.mark.integration

N = 12


@pytest.fixture(scope="module")
def signed(signed_moto: _servers.SignedMotoServer) -> _servers.SignedMotoServer:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    s3 = signed_moto.client("s3")
    for i in range(N):
        s3.put_object(Bucket="signed", Key=f"keys/{i:03d} x+y.bin", Body=bytes([i]) * (5000 + i))
    return signed_moto


def _urls(prefix: str = "keys/") -> list[str]:
    return [f"s3://signed/{prefix}{i:03d} x+y.bin" for i in range(N)]


def _epoch(tmp_path: Path, options: dict[str, Any], urls: list[str], **loader: Any) -> list[bytes]:
    settings = Settings(cache_dir=tmp_path / "cache", retries=2)
    ds = fastload.FileDataset(urls, storage_options=options, settings=settings)
    got: list[bytes] = []
    for batch in fastload.DataLoader(ds, batch_size=4, **loader):
        got.extend(batch["data"])
    return got


def _expected() -> list[bytes]:
    return [bytes([i]) * (5000 + i) for i in range(N)]


def _options(server: _servers.SignedMotoServer, **creds: Any) -> dict[str, Any]:
    return {**creds, "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": "us-east-1"}}


def test_key_list_takes_one_signed_get_per_object_and_no_head(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    heads, gets = signed.requests("HEAD", "/signed/keys/"), signed.requests("GET", "/signed/keys/")
    got = _epoch(tmp_path, _options(signed, key=signed.key, secret=signed.secret), _urls())
    assert got == _expected()
    assert signed.requests("HEAD", "/signed/keys/") == heads  # sized by the GET's Content-Range
    assert signed.requests("GET", "/signed/keys/") - gets == N


def test_listed_prefix_reads_each_object_with_one_get(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    heads, gets = signed.requests("HEAD", "/signed/keys/"), signed.requests("GET", "/signed/keys/")
    settings = Settings(cache_dir=tmp_path / "cache", retries=2)
    ds = fastload.FileDataset("s3://signed/keys/", storage_options=_options(signed, key=signed.key, secret=signed.secret),
                              settings=settings)
    got = [d for batch in fastload.DataLoader(ds, batch_size=4) for d in batch["data"]]
    assert got == _expected()
    assert signed.requests("HEAD", "/signed/keys/") == heads
    assert signed.requests("GET", "/signed/keys/") - gets == N


def test_listing_fans_out_per_common_prefix_and_follows_continuation_tokens(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    s3 = signed.client("s3")
    tree = {"top.bin": b"t", "a/1.bin": b"one", "a/b/2.bin": b"two", "c/3.bin": b"three", "a/b/": b""}
    tree |= {f"many/{i:04d}.bin": i.to_bytes(2, "big") for i in range(1003)}  # two pages of at most 1000
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: s3.put_object(Bucket="signed", Key=f"tree/{kv[0]}", Body=kv[1]), tree.items()))
    pages, heads = signed.requests("GET", "/signed?"), signed.requests("HEAD", "/signed")
    src = Source("s3://signed/tree", _options(signed, key=signed.key, secret=signed.secret))
    found, folders = src.find()
    assert isinstance(found, dict)
    assert sorted(found) == sorted(k for k in tree if not k.endswith("/"))  # the "a/b/" marker is no item
    assert folders == 4  # a/, a/b/, c/, many/
    assert found["a/b/2.bin"] == RemoteItem("s3://signed/tree/a/b/2.bin", 3, found["a/b/2.bin"].version)
    assert len(found["a/b/2.bin"].version) == 32  # the ETag, quotes stripped, as s3fs lists it
    # One page per common prefix (root, a/, a/b/, c/, many/) and one more for many/'s continuation.
    assert signed.requests("GET", "/signed?") - pages == 6
    assert signed.requests("HEAD", "/signed") == heads
    # The dataset reads what the listing found: one GET each, sized already.
    settings = Settings(cache_dir=tmp_path / "cache")
    ds = fastload.FileDataset("s3://signed/tree/", pattern="a/**", storage_options=src.storage_options,
                              settings=settings)
    assert sorted(d for b in fastload.DataLoader(ds, batch_size=2) for d in b["data"]) == [b"one", b"two"]


def test_wrong_secret_is_a_credentials_error_without_the_secret(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    secret = "WrongSecret-5d1e0b9a"
    with pytest.raises(CredentialsError) as info:
        _epoch(tmp_path, _options(signed, key=signed.key, secret=secret), _urls()[:2])
    assert "signed/keys/000" in str(info.value) and "credentials" in str(info.value)
    assert secret not in str(info.value)


def test_session_token_is_sent_and_a_bad_one_refused(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    creds = signed.client("sts").assume_role(RoleArn="arn:aws:iam::123456789012:role/fastload",
                                             RoleSessionName="fastload-test")["Credentials"]
    options = _options(signed, key=creds["AccessKeyId"], secret=creds["SecretAccessKey"], token=creds["SessionToken"])
    assert _epoch(tmp_path / "a", options, _urls()) == _expected()
    with pytest.raises(CredentialsError):
        _epoch(tmp_path / "b", {**options, "token": "not-the-token"}, _urls()[:2])


@pytest.mark.parametrize("client", ["auto", "aiohttp"])
@pytest.mark.parametrize("bad", ["secret", "token"])
def test_a_refused_listing_is_a_credentials_error_naming_s3s_code(
        bad: str, client: str, tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    """A listed prefix, not a key list: the listing's answer names the code (issue 32, item 7). A bad token
    ended as SourceError "Bad Request" after retries (s3fs's HEAD has no body to read a code from)."""
    creds = signed.client("sts").assume_role(RoleArn="arn:aws:iam::123456789012:role/fastload",
                                             RoleSessionName="fastload-test")["Credentials"]
    options = _options(signed, key=creds["AccessKeyId"], secret=creds["SecretAccessKey"], token=creds["SessionToken"])
    options[bad] = "WrongValue-5d1e0b9a"
    with pytest.raises(CredentialsError) as info:
        fastload.FileDataset("s3://signed/keys/", storage_options=options,
                             settings=Settings.from_env({}, cache_dir=tmp_path / "cache", http_client=client))
    msg = str(info.value)
    # s3fs's road asks with a HEAD, whose answer has no body: the status, and what it may mean.
    code = "no S3 error code" if client == "aiohttp" else "SignatureDoesNotMatch" if bad == "secret" else "InvalidToken"
    assert msg.startswith("s3://signed/keys") and code in msg and "WrongValue" not in msg, msg
    assert "fix:" in msg and "token" in msg


def test_credentials_from_environment_variables(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", signed.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", signed.secret)
    options = _options(signed)
    assert Source(_urls()[0], options).route is not None  # signed on libcurl, not s3fs
    assert _epoch(tmp_path, options, _urls()) == _expected()


def test_credentials_from_a_profile_file(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "credentials"
    path.write_text(f"[training]\naws_access_key_id = {signed.key}\naws_secret_access_key = {signed.secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    options = _options(signed, profile="training")
    assert Source(_urls()[0], options).route is not None
    assert _epoch(tmp_path, options, _urls()) == _expected()


def test_expiring_credentials_are_refreshed_in_the_middle_of_an_epoch(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile whose credential_process hands out credentials that expire within botocore's refresh
    window, so botocore asks the process again before each batch of GETs. Half-way through, the key in
    use is deleted at the server and a new one handed out: every byte arrives and no GET is refused."""
    iam = signed.client("iam")
    iam.create_user(UserName="rotating")
    allow = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="rotating", PolicyName="all", PolicyDocument=json.dumps(allow))
    keys = [iam.create_access_key(UserName="rotating")["AccessKey"] for _ in range(2)]

    def hand_out(key: dict[str, Any]) -> None:
        expires = datetime.now(timezone.utc) + timedelta(seconds=60)
        current.write_text(json.dumps({"Version": 1, "AccessKeyId": key["AccessKeyId"],
                                       "SecretAccessKey": key["SecretAccessKey"], "Expiration": expires.isoformat()}))

    current, calls, script = tmp_path / "current.json", tmp_path / "calls", tmp_path / "issue.py"
    hand_out(keys[0])
    script.write_text(textwrap.dedent(f"""
        import sys
        with open({str(calls)!r}, "a") as f:
            f.write("x")
        sys.stdout.write(open({str(current)!r}).read())
    """))
    config = tmp_path / "config"
    config.write_text(f"[profile rotating]\ncredential_process = {sys.executable} {script}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    settings = Settings(cache_dir=tmp_path / "cache", retries=2)
    ds = fastload.FileDataset(_urls(), storage_options=_options(signed, profile="rotating"), settings=settings)
    refused = signed.requests("GET", "/signed/keys/", status=403)
    got: list[bytes] = []
    half = list(range(N // 2))
    try:
        # The DataLoader fetches a whole small epoch ahead at once: the rotation falls between two
        # loaders over the same dataset (one Source, one botocore credentials object), at the half.
        for batch in fastload.DataLoader(ds, batch_size=2, sampler=half):
            got.extend(batch["data"])
        hand_out(keys[1])
        iam.delete_access_key(UserName="rotating", AccessKeyId=keys[0]["AccessKeyId"])
        before = len(calls.read_text())
        for batch in fastload.DataLoader(ds, batch_size=2, sampler=range(N // 2, N)):
            got.extend(batch["data"])
    finally:
        for key in keys:
            try:
                iam.delete_access_key(UserName="rotating", AccessKeyId=key["AccessKeyId"])
            except Exception:  # the first is gone already
                pass
    assert got == _expected()
    assert len(calls.read_text()) > before  # asked again after the rotation
    assert signed.requests("GET", "/signed/keys/", status=403) == refused  # no GET went out with the deleted key


def test_workers_fork_and_sign_in_the_child(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None, capfd: pytest.CaptureFixture[str]) -> None:
    got = _epoch(tmp_path, _options(signed, key=signed.key, secret=signed.secret), _urls(), num_workers=2)
    assert sorted(got) == sorted(_expected())
    assert "Unclosed client session" not in capfd.readouterr().err


# In a process of its own: run inside pytest's, its two forked passes were followed, in the full
# suite only, by tests/unit/test_pipelines.py finding its stats ContextVar unset (cause not found).
_ROUTE_ONCE = textwrap.dedent("""
    import json, os, sys
    import fastload
    from fastload.config import Settings
    from fastload.source import s3
    options, urls, cache, made = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    configured = s3.configured
    def counted(url, opts):
        with open(made, "a") as f:
            f.write(f"{os.getpid()}\\n")
        return configured(url, opts)
    s3.configured = counted
    def epoch():
        ds = fastload.FileDataset(urls, storage_options=options, settings=Settings(cache_dir=cache, retries=2))
        return sorted(bytes(d) for b in fastload.DataLoader(ds, batch_size=4, num_workers=2) for d in b["data"])
    first = epoch()
    made_first = open(made).read().split()
    os.unlink(made)
    second = epoch()  # a new dataset, every sample cached
    print(json.dumps({"pid": os.getpid(), "made_first": made_first, "made_second": os.path.exists(made),
                      "same": first == second, "n": len(first)}))
""")


def test_workers_inherit_the_route_the_parent_made_before_the_fork(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    """botocore's resolution (s3.configured) runs once, in the parent, for a pass with samples to fetch; not
    in each forked worker at its first GET. A pass over a dataset the cache holds whole makes no route."""
    options = _options(signed, key=signed.key, secret=signed.secret)
    run = subprocess.run([sys.executable, "-c", _ROUTE_ONCE, json.dumps(options), json.dumps(_urls()),
                          str(tmp_path / "cache"), str(tmp_path / "made.txt")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["n"] == N and out["same"]
    assert out["made_first"] == [str(out["pid"])]  # the parent alone, not the two workers
    assert out["made_second"] is False


def test_workers_sign_with_refreshing_profile_credentials_made_before_the_fork(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route the workers inherit holds botocore's refreshable credentials from a profile's
    credential_process (expiring within botocore's refresh window): each worker refreshes them itself,
    and every GET is signed and answered (a child process, as the test above)."""
    expires = (datetime.now(timezone.utc) + timedelta(seconds=60)).isoformat()
    issued, calls = tmp_path / "issued.json", tmp_path / "calls"
    issued.write_text(json.dumps({"Version": 1, "AccessKeyId": signed.key, "SecretAccessKey": signed.secret,
                                  "Expiration": expires}))
    script = tmp_path / "issue.py"
    script.write_text(f"import os, sys\nopen({str(calls)!r}, 'a').write(str(os.getppid()) + ' ')\n"
                      f"sys.stdout.write(open({str(issued)!r}).read())\n")
    config = tmp_path / "config"
    config.write_text(f"[profile issued]\ncredential_process = {sys.executable} {script}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    refused = signed.requests("GET", "/signed/keys/", status=403)
    run = subprocess.run([sys.executable, "-c", _ROUTE_ONCE, json.dumps(_options(signed, profile="issued")),
                          json.dumps(_urls()), str(tmp_path / "cache"), str(tmp_path / "made.txt")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["n"] == N and out["same"] and out["made_first"] == [str(out["pid"])]
    assert signed.requests("GET", "/signed/keys/", status=403) == refused
    asked_by = set(calls.read_text().split())
    assert len(asked_by - {str(out["pid"])}) >= 1  # a worker (another pid) asked the process itself


def test_an_unknown_option_keeps_gets_on_s3fs_and_says_which(
        signed: _servers.SignedMotoServer, caplog: pytest.LogCaptureFixture) -> None:
    options = _options(signed, key=signed.key, secret=signed.secret) | {"version_aware": True}
    with caplog.at_level("INFO", logger="fastload"):
        src = Source(_urls()[0], options)
        assert src.route is None
    assert "'version_aware'" in caplog.text and "s3fs" in caplog.text
    item = src.fetch_first(RemoteItem(_urls()[0], -1, ""), 100)
    assert item[0].size == 5000 and item[1] == bytes(100)


def test_region_from_aws_region_and_virtual_hosting_on_aws(no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if curl.engine() is None:
        pytest.skip(f"libcurl's engine cannot run here: {curl.unavailable()}")
    monkeypatch.setenv("AWS_REGION", "eu-west-2")
    route = Source("s3://my-bucket/a/b c.jpg", {"key": "k", "secret": "s"}).route
    assert route is not None and route.wire("s3://my-bucket/a/b c.jpg") == "https://my-bucket.s3.eu-west-2.amazonaws.com/a/b%20c.jpg"
    batch, lines = route.sign([route.wire("s3://my-bucket/x")], [])
    assert lines is not None and "/eu-west-2/s3/aws4_request" in lines[0] and any(b.startswith("x-amz-date: ") for b in batch)
    monkeypatch.delenv("AWS_REGION")
    assert Source("s3://my-bucket/x", {"key": "k", "secret": "s"}).route is None  # no region: s3fs finds it


def test_requester_pays_header_is_signed_with_the_rest(
        tmp_path: Path, signed: _servers.SignedMotoServer, no_aws_env: None) -> None:
    options = _options(signed, key=signed.key, secret=signed.secret) | {"requester_pays": True}
    route = Source(_urls()[0], options).route
    assert route is not None and "x-amz-request-payer: requester" in route.headers
    assert _epoch(tmp_path, options, _urls()) == _expected()  # moto checks the signature over that header too


def test_anonymous_reads_go_unsigned(
        tmp_path: Path, moto_server: Any, s3_bucket: str, no_aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=moto_server.endpoint_url, aws_access_key_id="a",
                          aws_secret_access_key="b", region_name="us-east-1")
    client.put_object(Bucket=s3_bucket, Key="public/x.bin", Body=b"open data" * 100, ACL="public-read")
    options = {"anon": True, "client_kwargs": {"endpoint_url": moto_server.endpoint_url, "region_name": "us-east-1"}}
    route = Source(f"s3://{s3_bucket}/public/x.bin", options).route
    assert route is not None and route.sign([route.wire(f"s3://{s3_bucket}/public/x.bin")], []) == ([], None)
    def not_s3fs(*args: Any) -> Any:
        raise AssertionError("the GET went to s3fs, not to libcurl unsigned")

    monkeypatch.setattr(Source, "_fetch_first", not_s3fs)
    assert _epoch(tmp_path, options, [f"s3://{s3_bucket}/public/x.bin"]) == [b"open data" * 100]

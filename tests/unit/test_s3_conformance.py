"""The S3 fast road sends what botocore (through s3fs) would send, configuration by configuration (issue 34, item 5).

For each row, the same ``storage_options``, environment and profile file go to both:
fastload's route (fastload.source.s3.configured: URL, headers, signature by fastload.source.sigv4)
and s3fs's own aiobotocore client, whose GetObject is built, signed and stopped at ``before-send``
(nothing leaves the machine). URL, host, every x-amz header and the Authorization line must be
equal, signed at botocore's own x-amz-date. A configuration the fast road does not cover must
show up as a named fallback (route None, the setting named), never as a different request.
docs/storage.md's S3 table lists the same rows.

The baseline asks botocore not to add ``x-amz-checksum-mode`` (``response_checksum_validation=
"when_required"``): that header asks S3 for checksums botocore checks in its answer; the fast
road checks its own xxh3 of what it caches, and sends none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")

from fastload.source import s3, s3_resolve  # noqa: E402

BUCKET = "my-bucket"
KEY = "train/a b+c=~%d/ünï.jpg"
NBYTES = 100


class Sent(Exception):
    def __init__(self, request: Any) -> None:
        super().__init__("stopped before sending")
        self.request = request


def botocore_get(options: dict[str, Any], bucket: str = BUCKET, key: str = KEY) -> Any:
    """The GetObject s3fs's client would send for ``options``: built, signed, not sent."""
    import fsspec
    import fsspec.asyn

    config = {**(options.get("config_kwargs") or {}), "response_checksum_validation": "when_required"}
    fs = fsspec.filesystem("s3", **{**options, "config_kwargs": config}, skip_instance_cache=True)
    fs.connect()

    def stop(request: Any, **kwargs: Any) -> None:
        raise Sent(request)

    fs.s3.meta.events.register("before-send.s3.GetObject", stop)
    with pytest.raises(Sent) as sent:
        fsspec.asyn.sync(fs.loop, fs.s3.get_object, Bucket=bucket, Key=key, Range=f"bytes=0-{NBYTES - 1}",
                         **({"RequestPayer": "requester"} if options.get("requester_pays") else {}))
    return sent.value.request, fs.s3._endpoint.http_session._verify


def fast_road_get(route: s3.S3Route, amz_date: str, bucket: str = BUCKET, key: str = KEY) -> tuple[str, dict[str, str]]:
    """What the fast road sends for the same GET (CurlRoute.start's headers, S3Route.sign's), at ``amz_date``."""
    url = f"s3://{bucket}/{key}"
    bucket_route = route.of(bucket)
    assert bucket_route is not None
    wire = bucket_route.wire(url)
    headers = [*bucket_route.headers, f"Range: bytes=0-{NBYTES - 1}", "Accept-Encoding: identity"]
    batch, lines = bucket_route.sign([wire], headers, amz_date=amz_date)
    sent = {}
    for line in [*headers, *batch, *(lines or [])]:
        name, _, value = line.partition(":")
        sent[name.strip().lower()] = value.strip()
    return wire, sent


def _compare(options: dict[str, Any], bucket: str = BUCKET) -> s3.S3Route:
    route, why = s3.configured(f"s3://{bucket}/{KEY}", options)
    assert route is not None, f"fell back: {why}"
    request, verify = botocore_get(options, bucket)
    theirs = {k.lower(): (v.decode() if isinstance(v, bytes) else v) for k, v in request.headers.items()}
    wire, ours = fast_road_get(route, theirs.get("x-amz-date", "20260101T000000Z"), bucket)  # none: unsigned
    assert wire == request.url
    amz = {k: v for k, v in theirs.items() if k.startswith("x-amz-")}
    assert {k: v for k, v in ours.items() if k.startswith("x-amz-")} == amz
    assert ours.get("authorization") == theirs.get("authorization")  # host, path, region, service, headers: all signed
    assert ours["range"] == theirs["range"]
    bucket_route = route.of(bucket)
    assert bucket_route is not None
    from botocore.httpsession import get_cert_path

    if verify is False:
        assert bucket_route.verify is False
    elif isinstance(verify, str) and verify != get_cert_path(True):  # a CA the user named, not botocore's default
        assert bucket_route.verify is True and verify in (bucket_route.cainfo, bucket_route.capath)
    else:
        assert bucket_route.verify is True and bucket_route.cainfo is None and bucket_route.capath is None
    return route


@pytest.fixture
def aws(no_aws_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A clean AWS environment with a key in it, and the files a row may write its profile into."""
    import fsspec.config

    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "AWS_USE_FIPS_ENDPOINT",
                "AWS_USE_DUALSTACK_ENDPOINT", "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    monkeypatch.setattr(fsspec.config, "conf", {k: v for k, v in fsspec.config.conf.items() if k != "s3"})
    monkeypatch.setattr(s3_resolve, "_LEARNED", {})
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    return {"config": config, "credentials": credentials}


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    """A CA bundle file (any PEM certificate: botocore only opens it when it connects)."""
    import certifi

    path = tmp_path / "ca.pem"
    path.write_bytes(Path(certifi.where()).read_bytes())
    return path


ENDPOINT = "http://127.0.0.1:9000"
REGION = {"client_kwargs": {"region_name": "eu-west-1"}}

# id -> (storage_options, environment, profile file lines): each is one row of docs/storage.md's S3 table.
ROWS: dict[str, tuple[dict[str, Any], dict[str, str], str]] = {
    "endpoint in client_kwargs": ({"client_kwargs": {"endpoint_url": ENDPOINT, "region_name": "us-east-1"}}, {}, ""),
    "endpoint_url option": ({"endpoint_url": ENDPOINT}, {"AWS_DEFAULT_REGION": "us-east-1"}, ""),
    "endpoint in AWS_ENDPOINT_URL": ({}, {"AWS_ENDPOINT_URL": ENDPOINT, "AWS_DEFAULT_REGION": "us-east-1"}, ""),
    "endpoint in AWS_ENDPOINT_URL_S3": ({}, {"AWS_ENDPOINT_URL_S3": ENDPOINT, "AWS_DEFAULT_REGION": "us-east-1"}, ""),
    "endpoint in a profile": ({"profile": "lab"}, {}, f"[profile lab]\nregion = us-east-1\nendpoint_url = {ENDPOINT}\n"),
    "endpoint in the profile's s3 section": ({"profile": "lab"}, {},
                                             f"[profile lab]\nregion = us-east-1\nservices = lab\n[services lab]\ns3 =\n"
                                             f"  endpoint_url = {ENDPOINT}\n"),
    "virtual addressing at an endpoint": ({"client_kwargs": {"endpoint_url": "http://minio.lab:9000",
                                                              "region_name": "us-east-1"},
                                           "config_kwargs": {"s3": {"addressing_style": "virtual"}}}, {}, ""),
    "https endpoint, use_ssl=False": ({"endpoint_url": "https://minio.lab:9000", "use_ssl": False},
                                      {"AWS_DEFAULT_REGION": "us-east-1"}, ""),
    "region in client_kwargs": (REGION, {}, ""),
    "region in config_kwargs": ({"config_kwargs": {"region_name": "ap-southeast-2"}}, {}, ""),
    "region in AWS_DEFAULT_REGION": ({}, {"AWS_DEFAULT_REGION": "us-west-2"}, ""),
    "region in a profile": ({"profile": "eu"}, {}, "[profile eu]\nregion = eu-central-1\n"),
    "region in AWS_PROFILE's profile": ({}, {"AWS_PROFILE": "eu"}, "[profile eu]\nregion = eu-central-1\n"),
    "us-east-1 (global host)": ({"client_kwargs": {"region_name": "us-east-1"}}, {}, ""),
    "us-east-1 regional host": ({"client_kwargs": {"region_name": "us-east-1"},
                                 "config_kwargs": {"s3": {"us_east_1_regional_endpoint": "regional"}}}, {}, ""),
    "path addressing on AWS": ({**REGION, "config_kwargs": {"s3": {"addressing_style": "path"}}}, {}, ""),
    "bucket name with dots (path style over https)": (REGION, {}, ""),
    "aws-cn partition": ({"client_kwargs": {"region_name": "cn-north-1"}}, {}, ""),
    "aws-us-gov partition": ({"client_kwargs": {"region_name": "us-gov-west-1"}}, {}, ""),
    "FIPS in config_kwargs": ({"client_kwargs": {"region_name": "us-gov-west-1"},
                               "config_kwargs": {"use_fips_endpoint": True}}, {}, ""),
    "FIPS in AWS_USE_FIPS_ENDPOINT": ({"client_kwargs": {"region_name": "us-east-2"}},
                                      {"AWS_USE_FIPS_ENDPOINT": "true"}, ""),
    "dual-stack in config_kwargs": ({**REGION, "config_kwargs": {"use_dualstack_endpoint": True}}, {}, ""),
    "dual-stack in a profile": ({"profile": "ds"}, {}, "[profile ds]\nregion = eu-west-1\nuse_dualstack_endpoint = true\n"),
    "transfer acceleration": ({**REGION, "config_kwargs": {"s3": {"use_accelerate_endpoint": True}}}, {}, ""),
    "requester pays": ({**REGION, "requester_pays": True}, {}, ""),
    "key and secret in options": ({**REGION, "key": "AKIDOPTIONS", "secret": "secret/options"}, {}, ""),
    "keys in client_kwargs": ({"client_kwargs": {"region_name": "eu-west-1", "aws_access_key_id": "AKIDCLIENT",
                                                 "aws_secret_access_key": "client/secret"}}, {}, ""),
    "session token in options": ({**REGION, "key": "ASIAOPTIONS", "secret": "s", "token": "tok/en+=="}, {}, ""),
    "session token in AWS_SESSION_TOKEN": (REGION, {"AWS_SESSION_TOKEN": "env-token"}, ""),
    "keys in a profile's credentials": ({**REGION, "profile": "keys"}, {}, "[profile keys]\n"),
    "anonymous": ({**REGION, "anon": True}, {}, ""),
    "CA in client_kwargs verify": ({**REGION, "client_kwargs": {"region_name": "eu-west-1", "verify": "{ca}"}}, {}, ""),
    "CA in AWS_CA_BUNDLE": (REGION, {"AWS_CA_BUNDLE": "{ca}"}, ""),
    "CA in a profile's ca_bundle": ({"profile": "ca"}, {}, "[profile ca]\nregion = eu-west-1\nca_bundle = {ca}\n"),
    "CA folder in client_kwargs verify": ({"client_kwargs": {"region_name": "eu-west-1", "verify": "{ca_dir}"}}, {}, ""),
    "verify=False": ({"client_kwargs": {"region_name": "eu-west-1", "verify": False}}, {}, ""),
    "FSSPEC_S3_ENDPOINT_URL": ({}, {"FSSPEC_S3_ENDPOINT_URL": ENDPOINT, "AWS_DEFAULT_REGION": "us-east-1"}, ""),
}


def _fill(value: Any, ca: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{ca}", str(ca)).replace("{ca_dir}", str(ca.parent))
    if isinstance(value, dict):
        return {k: _fill(v, ca) for k, v in value.items()}
    return value


def _configure(row: tuple[dict[str, Any], dict[str, str], str], aws: dict[str, Path], ca: Path,
               monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import fsspec.config

    options, env, profile = (_fill(part, ca) for part in row)
    for name, value in env.items():
        if name.startswith("FSSPEC_S3_"):
            monkeypatch.setitem(fsspec.config.conf, "s3", {name[len("FSSPEC_S3_"):].lower(): value})
        else:
            monkeypatch.setenv(name, value)
    aws["config"].write_text(profile)
    names = [line[len("[profile "):-1] for line in profile.splitlines() if line.startswith("[profile ")]
    # A named profile takes its keys from the profile files (botocore skips the environment's then).
    aws["credentials"].write_text("".join(f"[{name}]\naws_access_key_id = AKIDPROFILE\n"
                                          "aws_secret_access_key = profile/secret\n" for name in names))
    return options


@pytest.mark.parametrize("row", list(ROWS))
def test_the_fast_road_sends_what_botocore_would(row: str, aws: dict[str, Path], ca: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    options = _configure(ROWS[row], aws, ca, monkeypatch)
    bucket = "my.dotted.bucket" if "dots" in row else BUCKET
    _compare(options, bucket)


def test_a_learned_region_sends_what_botocore_sends_in_that_region(aws: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"client_kwargs": {"region_name": "us-east-1"}}
    route, _ = s3.configured(f"s3://{BUCKET}/{KEY}", options)
    assert route is not None and route.region == "us-east-1"
    assert route.buckets.resolver.learn(BUCKET, "ap-northeast-1")
    request, _ = botocore_get({"client_kwargs": {"region_name": "ap-northeast-1"}})
    theirs = {k.lower(): (v.decode() if isinstance(v, bytes) else v) for k, v in request.headers.items()}
    wire, ours = fast_road_get(route, theirs["x-amz-date"])
    assert wire == request.url == f"https://{BUCKET}.s3.ap-northeast-1.amazonaws.com/" + wire.split("/", 3)[3]
    assert ours["authorization"] == theirs["authorization"]
    other = route.of("other-bucket")  # another bucket of the same Source keeps the configured region
    assert other is not None and other.region == "us-east-1"


# Configurations the fast road leaves, each by name: (storage_options, environment, what the log line names).
FALLBACKS: dict[str, tuple[dict[str, Any], dict[str, str], str]] = {
    "S3 Express One Zone bucket": (REGION, {}, "S3 Express One Zone"),
    "signature version s3 (SigV2)": ({**REGION, "config_kwargs": {"signature_version": "s3"}}, {}, "signature version 's3'"),
    "no region and no endpoint": ({}, {}, "no region is set"),
    "an option only s3fs reads": ({**REGION, "version_aware": True}, {}, "'version_aware'"),
}


@pytest.mark.parametrize("row", list(FALLBACKS))
def test_a_configuration_the_fast_road_does_not_cover_is_a_named_fallback(row: str, aws: dict[str, Path],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    options, env, named = FALLBACKS[row]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bucket = "data--usw2-az1--x-s3" if "Express" in row else BUCKET
    route, why = s3.configured(f"s3://{bucket}/{KEY}", options)
    assert route is None and named in why


def test_an_express_bucket_among_others_takes_s3fs_alone(aws: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    route, _ = s3.configured(f"s3://{BUCKET}/{KEY}", REGION)
    assert route is not None
    with caplog.at_level("INFO", logger="fastload"):
        assert not route.takes("s3://data--usw2-az1--x-s3/a") and not route.takes("s3://data--usw2-az1--x-s3/b")
    assert route.takes(f"s3://{BUCKET}/b") and route.takes("s3://another-bucket/c")
    assert caplog.text.count("S3 Express One Zone") == 1  # decided once for the bucket, not per object


def test_the_profile_ca_is_what_the_route_trusts(aws: dict[str, Path], ca: Path) -> None:
    aws["config"].write_text(f"[profile ca]\nregion = eu-west-1\nca_bundle = {ca}\n")
    aws["credentials"].write_text("[ca]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = profile/secret\n")
    route, _ = s3.configured(f"s3://{BUCKET}/k", {"profile": "ca"})
    assert route is not None and route.cainfo == str(ca) and route.verify is True

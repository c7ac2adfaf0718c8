"""Settings and size parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.config import Settings, format_size, parse_size
from fastload.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [("200GB", 200 * 10**9), ("1.5 GiB", int(1.5 * 2**30)), ("4096", 4096), ("512kb", 512_000), (10, 10), ("8MiB", 8 * 2**20)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "12 parsecs", "-5", "1..2MB", True])
def test_parse_size_rejects_with_a_named_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad)  # type: ignore[arg-type]


def test_env_is_read_in_one_place(tmp_path: Path) -> None:
    s = Settings.from_env({"FASTLOAD_CACHE_DIR": str(tmp_path), "FASTLOAD_CACHE_LIMIT": "2GB", "FASTLOAD_MAX_REQUESTS": "3"})
    assert (s.cache_dir, s.cache_limit_bytes, s.max_requests) == (tmp_path, 2 * 10**9, 3)


def test_workers_is_max_requests_old_name_taken_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request cap read like torch's num_workers; its old names still work, each warning once."""
    from fastload import config

    monkeypatch.setattr(config, "_warned", set())
    with pytest.warns(FutureWarning, match="'workers' is now 'max_requests'"):
        s = Settings(workers=5)
    assert s.max_requests == 5 and s.workers == 5 and s == Settings(max_requests=5)
    with pytest.warns(FutureWarning, match="FASTLOAD_WORKERS"):
        assert Settings.from_env({"FASTLOAD_WORKERS": "7"}).max_requests == 7
    assert Settings.from_env({"FASTLOAD_WORKERS": "7", "FASTLOAD_MAX_REQUESTS": "9"}).max_requests == 9
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        assert Settings(workers=6).max_requests == 6


def test_env_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="FASTLOAD_CACHE_LIMIT"):
        Settings.from_env({"FASTLOAD_CACHE_LIMIT": "lots"})


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTLOAD_CACHE_DIR", raising=False)
    assert Settings.from_env({}).cache_dir == Path.home() / ".cache" / "fastload"


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ConfigError):
        Settings(cache_limit_bytes=0)
    with pytest.raises(ConfigError):
        Settings(lz4_level=13)


def test_format_size() -> None:
    assert format_size(1_500_000) == "1.5 MB" and format_size(10_030_000) == "10 MB" and format_size(None) == "-"
    assert format_size(999) == "999 B"


@pytest.mark.parametrize(("value", "pure"), [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_pure_python_is_one_reading_of_the_variable(monkeypatch: pytest.MonkeyPatch, value: str | None, pure: bool) -> None:
    # gather and curl both ask pure_python(): "0" once kept gather's C path but turned off libcurl's.
    from fastload.config import pure_python

    if value is None:
        monkeypatch.delenv("FASTLOAD_PURE_PYTHON", raising=False)
    else:
        monkeypatch.setenv("FASTLOAD_PURE_PYTHON", value)
    assert pure_python() is pure


def test_settings_arguments_win_over_fastload_variables_which_win_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """One precedence (issue 32): FASTLOAD_RETRIES was ignored once Settings(...) was passed."""
    import pickle

    monkeypatch.setenv("FASTLOAD_RETRIES", "3")
    monkeypatch.setenv("FASTLOAD_RETRY_BUDGET_S", "600")
    s = Settings(retries=7)
    assert (s.retries, s.retry_budget_s, s.request_timeout_s) == (7, 600.0, 60.0)
    assert Settings().retries == 3 and Settings.from_env().retries == 3
    assert Settings.from_env({}).retries is None  # only the env it is given
    monkeypatch.setenv("FASTLOAD_RETRY_BUDGET_S", "5")
    assert pickle.loads(pickle.dumps(s)) == s and s.replace(backoff_s=1).retry_budget_s == 600.0  # read once, where built
    monkeypatch.setenv("FASTLOAD_RETRIES", "many")
    with pytest.raises(ConfigError, match="FASTLOAD_RETRIES='many'"):
        Settings()


def test_retries_caps_attempts_and_the_budget_bounds_waits() -> None:
    assert Settings.from_env({}).retries is None and Settings.from_env({}).retry_budget_s == 300.0
    assert Settings.from_env({}).fetch_wait_s >= 300.0
    assert Settings.from_env({}, retries=2).fetch_wait_s < 300.0
    with pytest.raises(ConfigError, match="retry_budget_s"):
        Settings(retry_budget_s=-1)
    with pytest.raises(ConfigError, match="retries=0"):
        Settings(retries=0)

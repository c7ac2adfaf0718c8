"""The public API: a sorted __all__ whose names all resolve, and doctests that run."""

from __future__ import annotations

import doctest

import pytest

import fastload
from fastload import codec, config, failures, loader, patch, stats
from fastload.source import items, sigv4


def test_all_is_sorted_and_resolves() -> None:
    assert fastload.__all__ == sorted(fastload.__all__)
    for name in fastload.__all__:
        assert getattr(fastload, name) is not None, name


def test_errors_inherit_builtins() -> None:
    assert issubclass(fastload.CacheFullError, OSError) and issubclass(fastload.ConfigError, ValueError)
    assert issubclass(fastload.RemoteNotFoundError, FileNotFoundError)
    assert issubclass(fastload.CredentialsError, PermissionError)


@pytest.mark.parametrize("module", [codec, config, failures, items, loader, patch, sigv4, stats])
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.failed == 0 and result.attempted > 0

"""The public API: a sorted __all__ whose names all resolve, and doctests that run."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import fastload
from fastload import errors

PACKAGE = Path(fastload.__file__).parent


def _modules_with_examples() -> list[str]:
    """Every fastload module whose source holds a docstring example (``>>>``), found by walking the package."""
    found = []
    for info in pkgutil.walk_packages([str(PACKAGE)], "fastload."):
        spec = importlib.util.find_spec(info.name)
        origin = spec.origin if spec else None
        if origin and origin.endswith(".py") and ">>> " in Path(origin).read_text():
            found.append(info.name)
    return sorted(found)


def test_all_is_sorted_and_resolves() -> None:
    assert fastload.__all__ == sorted(fastload.__all__)
    for name in fastload.__all__:
        assert getattr(fastload, name) is not None, name


def test_errors_inherit_builtins() -> None:
    assert issubclass(fastload.CacheFullError, OSError) and issubclass(fastload.ConfigError, ValueError)
    assert issubclass(fastload.RemoteNotFoundError, FileNotFoundError)
    assert issubclass(fastload.CredentialsError, PermissionError)


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_docstring_examples_are_found_without_a_list() -> None:
    names = _modules_with_examples()
    assert {"fastload.codec", "fastload.config", "fastload.loader.dataloader", "fastload.source.sigv4"} <= set(names)


def test_every_error_class_is_exported_and_raised() -> None:
    """An error users cannot import, or one that is never raised, is a promise the API breaks."""
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.FastloadError) and c.__module__ == errors.__name__]
    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "errors.py")
    for cls in classes:
        assert cls.__name__ in fastload.__all__, f"{cls.__name__} is raised but not exported"
        if cls is not errors.FastloadError:
            assert re.search(rf"\b{cls.__name__}\(", code), f"{cls.__name__} is exported but never raised"

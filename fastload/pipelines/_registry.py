"""A lazy registry of the heavy optional parts the pipelines use.

Names map to a module plus an install hint, and are imported on first use, as
fsspec's ``fsspec/registry.py`` does for its filesystems. So ``import
fastload.pipelines`` never imports DALI (about 800 MB of libraries) and a
missing part fails with a message that says how to install it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

__all__ = ["OPTIONAL", "available", "load"]


@dataclass(frozen=True)
class Optional_:
    """One optional dependency: what to import and how to get it."""

    module: str
    hint: str


OPTIONAL: dict[str, Optional_] = {
    "dali": Optional_("nvidia.dali", "pip install 'fastload[dali]'"),
    "dali.fn": Optional_("nvidia.dali.fn", "pip install 'fastload[dali]'"),
    "dali.types": Optional_("nvidia.dali.types", "pip install 'fastload[dali]'"),
    "dali.math": Optional_("nvidia.dali.math", "pip install 'fastload[dali]'"),
    "torchvision.io": Optional_(
        "torchvision.io", "pip install torchvision (the build that matches your torch)"
    ),
    "PIL.Image": Optional_("PIL.Image", "pip install pillow"),
}

_loaded: dict[str, ModuleType] = {}
_failed: dict[str, str] = {}


def load(name: str) -> ModuleType:
    """Import the optional part ``name`` (a key of :data:`OPTIONAL`) on first use.

    Raises:
        ImportError: It is not installed, or it is installed but does not import
            (torchvision built for another torch raises RuntimeError or OSError on
            import; that is reported the same way, with the original error).
    """
    mod = _loaded.get(name)
    if mod is not None:
        return mod
    spec = OPTIONAL[name]
    if name in _failed:
        raise ImportError(f"{spec.module} is not usable here ({_failed[name]}); fix: {spec.hint}")
    try:
        mod = importlib.import_module(spec.module)
    except Exception as err:  # a broken install raises anything, not only ImportError
        _failed[name] = f"{type(err).__name__}: {err}"
        raise ImportError(f"{spec.module} is not usable here ({_failed[name]}); fix: {spec.hint}") from err
    _loaded[name] = mod
    return mod


def available(name: str) -> bool:
    """Whether ``name`` imports here (imports it once to find out; cheap after that)."""
    if name in _loaded:
        return True
    if name in _failed:
        return False
    top = OPTIONAL[name].module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        _failed[name] = f"{top} is not installed"
        return False
    try:
        load(name)
    except ImportError:
        return False
    return True

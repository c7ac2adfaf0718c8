"""Torch's classes, captured at import, and torch's iterator surface on fastload's iterator.

Code written for torch reaches into the iterator: Lightning's teardown calls
``loader._iterator._shutdown_workers()`` when the iterator is a
``_MultiProcessingDataLoaderIter``; tests and tools map worker ids to
``it._workers[i].pid``. So the iterator fastload returns is an instance of a
subclass of the torch iterator class it wraps (``isinstance`` holds), and every
attribute and method of that torch iterator is forwarded to it: reads, writes
and calls reach torch's object, and no state is copied. fastload's own
attributes are slots on :class:`fastload.loader.iterator._LoaderIter`, whose names
no torch iterator uses (checked when a class is built).

Torch's classes are captured here at import, never looked up through the
module attribute later (``fastload.patch_torch()`` rebinds torch's names).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.utils.data import dataloader as _torch_dataloader

__all__ = [
    "TORCH_BASE_ITER",
    "TORCH_DATALOADER",
    "TORCH_SINGLE_ITER",
    "surfaced",
]

TORCH_DATALOADER: type[_torch_dataloader.DataLoader[Any]] = _torch_dataloader.DataLoader
TORCH_BASE_ITER = _torch_dataloader._BaseDataLoaderIter
TORCH_SINGLE_ITER = _torch_dataloader._SingleProcessDataLoaderIter


def _attribute(name: str) -> property:
    def get(self: Any) -> Any:
        return getattr(self._torch, name)

    def put(self: Any, value: Any) -> None:
        setattr(self._torch, name, value)

    def drop(self: Any) -> None:
        delattr(self._torch, name)

    return property(get, put, drop, f"torch's iterator's {name}, forwarded")


def _method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._torch, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"torch's iterator's {name}(), forwarded"
    return call


def _torch_getattr(self: Any, name: str) -> Any:
    # Anything not forwarded by name (an attribute torch added after the class was
    # built) is read from the torch iterator too.
    if name == "_torch":
        raise AttributeError(name)
    return getattr(self._torch, name)


def _own_names(kind: type) -> set[str]:
    names: set[str] = set()
    for cls in kind.__mro__[:-1]:  # all but object
        names.update(vars(cls))
        names.update(getattr(cls, "__slots__", ()))
    return names


@functools.cache
def surfaced(kind: type, torch_cls: type, attributes: frozenset[str]) -> type:
    """A subclass of ``kind`` and ``torch_cls`` that forwards torch's surface to ``self._torch``.

    Args:
        kind: fastload's iterator class (a :class:`~fastload.loader.iterator._LoaderIter`).
        torch_cls: The class of the torch iterator it wraps.
        attributes: The torch iterator's instance attribute names (``vars(it)``).

    Raises:
        TypeError: A name of torch's iterator is also one of fastload's (a torch
            upgrade added it): forwarding would be ambiguous.
    """
    own = _own_names(kind)
    clash = sorted(a for a in attributes if a in own)
    if clash:
        raise TypeError(
            f"torch's {torch_cls.__name__} uses fastload's iterator names {clash}; rename them in fastload"
        )
    ns: dict[str, Any] = {
        "__slots__": (),
        "__module__": kind.__module__,
        "__getattr__": _torch_getattr,
    }
    for cls in reversed(torch_cls.__mro__[:-1]):
        for name, value in vars(cls).items():
            if name.startswith("__") or name in own:
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                ns[name] = _method(name)
    for name in attributes:
        ns[name] = _attribute(name)
    return type(f"{kind.__name__}[{torch_cls.__name__}]", (kind, torch_cls), ns)

"""A batch's tensor leaves: collected in order, and put back into the same containers; its bytes.

The container rules are torch's own (``torch.utils.data._utils.pin_memory``): a
mapping, namedtuple, tuple or sequence is rebuilt as the same type where it can be
constructed, else as a dict or list; strings and bytes are leaves that stay. The
device prefetcher (fastload.device.prefetch) copies every leaf of a batch in one DMA and
rebuilds the batch around the copies.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch

__all__ = ["collect_tensors", "nbytes", "rebuild"]


def collect_tensors(data: Any, out: list[torch.Tensor]) -> None:
    """Append every tensor leaf of ``data`` to ``out`` in depth-first order."""
    if isinstance(data, torch.Tensor):
        out.append(data)
    elif isinstance(data, (str, bytes)):
        return
    elif isinstance(data, Mapping):
        for v in data.values():
            collect_tensors(v, out)
    elif isinstance(data, (tuple, Sequence)):
        for v in data:
            collect_tensors(v, out)


def rebuild(data: Any, new: Iterator[torch.Tensor]) -> Any:
    """Return ``data`` with its tensor leaves replaced, in order, by ``new``'s items.

    Containers are rebuilt as torch's ``pin_memory`` rebuilds them: the same mapping,
    namedtuple, tuple or sequence type where it can be constructed, else dict / list.
    """
    if isinstance(data, torch.Tensor):
        return next(new)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        items = {k: rebuild(v, new) for k, v in data.items()}
        if type(data) is dict:
            return items
        try:
            if isinstance(data, MutableMapping):
                clone = copy.copy(data)
                clone.update(items)
                return clone
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(rebuild(v, new) for v in data))
        return type(data)(rebuild(v, new) for v in data)
    if isinstance(data, Sequence):
        values = [rebuild(v, new) for v in data]
        if type(data) is list:
            return values
        try:
            if isinstance(data, MutableSequence):
                seq: MutableSequence[Any] = copy.copy(data)
                for i, v in enumerate(values):
                    seq[i] = v
                return seq
            return type(data)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    return data


def nbytes(obj: Any) -> int:
    """Bytes held by the tensors, arrays, bytes and nested containers in ``obj``.

    Other leaves count 0. Used to fill the ``bytes`` column cheaply (no copies); it
    runs once per batch, so the common containers are walked without generators.
    """
    kind = type(obj)
    if kind is tuple or kind is list:
        total = 0
        for v in obj:
            total += nbytes(v)
        return total
    if kind is dict:
        total = 0
        for v in obj.values():
            total += nbytes(v)
        return total
    if kind is str or obj is None or kind is int or kind is float:
        return 0
    if kind is bytes or kind is bytearray:
        return len(obj)
    n = getattr(obj, "nbytes", None)  # torch.Tensor, numpy.ndarray, memoryview
    if isinstance(n, int):
        return n
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0

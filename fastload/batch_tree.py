"""A batch's tensor leaves: collected in order, and put back into the same containers.

The container rules are torch's own (``torch.utils.data._utils.pin_memory``): a
mapping, namedtuple, tuple or sequence is rebuilt as the same type where it can be
constructed, else as a dict or list; strings and bytes are leaves that stay. The
device prefetcher (fastload.prefetch) copies every leaf of a batch in one DMA and
rebuilds the batch around the copies.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch

__all__ = ["collect_tensors", "rebuild"]


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

"""What the parent learns from torch's worker messages beyond the batch: its index, a worker's end state.

torch's multi-process iterator reads every worker message through its own
``_get_data()``. :func:`receiver` puts a :class:`Receiver` in that method's place on
one torch iterator (an instance attribute: the iterator stays torch's own class, and
torch's code calls it as before). It records:

* **sent**: torch's index of the batch just received (``_send_idx`` when it was sent):
  out of order (``in_order=False``) it tells which batch of the epoch was delivered
  (:class:`fastload.loader.snapshot.WorkerStates`);
* **ended**: per worker, the end state carried by its end-of-shard message
  (:class:`fastload.loader.snapshot.Ended`), for a state saved at the epoch's end and
  for the next epoch of persistent workers.

The receiver holds the iterator by a weak reference: the iterator's ``__del__`` still
shuts its workers down as soon as the iterator is dropped.
"""

from __future__ import annotations

import weakref
from typing import Any

from fastload.loader.snapshot import Ended

__all__ = ["Receiver", "receiver"]


class Receiver:
    """Stands in for one torch iterator's ``_get_data``; see the module docstring."""

    __slots__ = ("ref", "get", "sent", "ended")

    def __init__(self, it: Any) -> None:
        self.ref = weakref.ref(it)
        self.get = type(it)._get_data  # the class's function: no reference back to the iterator
        self.sent = (
            -1
        )  # torch's index of the latest batch (not an int for torch's control messages)
        self.ended: dict[int, dict[str, Any] | None] = {}  # worker id -> its end state, this epoch

    def __call__(self) -> tuple[Any, Any]:
        idx, data = self.get(self.ref())
        self.sent = idx
        if type(data) is Ended:
            self.ended[data.worker_id] = data.state
        return idx, data

    def last(self) -> int:
        """torch's index of the batch received most recently."""
        return int(self.sent)


def receiver(it: Any) -> Receiver:
    """The :class:`Receiver` of torch's multi-process iterator ``it`` (put in place once)."""
    found = it.__dict__.get("_get_data")
    if isinstance(found, Receiver):
        return found
    rec = Receiver(it)
    it._get_data = rec
    return rec

"""The torch APIs fastload uses that differ across the torch versions it supports (``torch>=2.1``).

Each shim picks the newest spelling that exists and falls back to what older
torch has; ``tests/unit/test_torch_compat.py`` runs each with the newer API hidden.
"""

from __future__ import annotations

import torch

__all__ = ["accelerator_available", "empty_host_cache"]


def accelerator_available() -> bool:
    """Whether an accelerator is present, as torch's DataLoader decides where to pin.

    ``torch.accelerator`` arrived in torch 2.6; before it torch's DataLoader pinned
    only for CUDA, so that is the answer there.
    """
    accelerator = getattr(torch, "accelerator", None)
    is_available = getattr(accelerator, "is_available", None)
    if is_available is None:
        return bool(torch.cuda.is_available())
    return bool(is_available())


def empty_host_cache() -> bool:
    """Give torch's cached, unused pinned blocks back to the driver; False if torch cannot.

    ``torch.accelerator.empty_host_cache`` (newer torch) or the private
    ``torch._C._host_emptyCache`` (torch 2.5+). Blocks whose copies are still in
    flight are not in the cache yet and stay.
    """
    accelerator = getattr(torch, "accelerator", None)
    fn = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if fn is None:
        return False
    fn()
    return True

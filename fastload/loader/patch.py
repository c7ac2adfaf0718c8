"""``fastload.patch_torch()``: fastload's DataLoader behind torch's name, for frameworks.

Frameworks (PyTorch Lightning, Hugging Face Accelerate, a lab's trainer) build
their own loaders with ``torch.utils.data.DataLoader(...)``. Rebinding that name,
and ``torch.utils.data.dataloader.DataLoader``, makes every loader built through
it a :class:`fastload.DataLoader`, which yields what torch's would
(``tests/unit/test_patch_torch.py``). fastload itself always uses torch's class as
captured at import (:mod:`fastload.loader.torch_surface`), so the rebinding cannot loop.

A framework module that ran ``from torch.utils.data import DataLoader`` before the
patch keeps torch's class in its own namespace: patch first, then import it.
"""

from __future__ import annotations

import functools
import inspect
from types import TracebackType
from typing import Any

import torch.utils.data
import torch.utils.data.dataloader

from fastload.errors import ConfigError
from fastload.loader.dataloader import DataLoader
from fastload.loader.torch_surface import TORCH_DATALOADER

__all__ = ["TorchPatch", "patch_torch"]

_TORCH_PARAMS = frozenset(inspect.signature(TORCH_DATALOADER.__init__).parameters)
#: fastload's keyword-only additions, the only defaults a patch may set.
ADDITIONS = tuple(
    p for p in inspect.signature(DataLoader.__init__).parameters if p not in _TORCH_PARAMS
)
_MODULES = (torch.utils.data, torch.utils.data.dataloader)


class TorchPatch:
    """The handle :func:`patch_torch` returns: ``undo()`` puts torch's names back.

    Also a context manager: ``with fastload.patch_torch(): ...`` undoes on exit.

    Attributes:
        defaults: The keyword defaults loaders built through torch's name get while
            the patch is in force.
        loader_class: The class bound to torch's names while the patch is in force.
    """

    def __init__(self, defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self._active = False
        self.loader_class = _with_defaults(self) if defaults else DataLoader
        self._saved = [vars(m)["DataLoader"] for m in _MODULES]
        for m in _MODULES:
            vars(m)["DataLoader"] = self.loader_class
        self._active = True

    @property
    def active(self) -> bool:
        """Whether torch's names still point at :attr:`loader_class` through this patch."""
        return self._active

    def undo(self) -> None:
        """Restore both names to what they were before the patch (again: no-op)."""
        if not self._active:
            return
        self._active = False
        for m, saved in zip(_MODULES, self._saved):
            if vars(m)["DataLoader"] is self.loader_class:  # a later patch in force keeps its own
                vars(m)["DataLoader"] = saved

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<fastload.TorchPatch {state}: torch.utils.data.DataLoader -> {self.loader_class.__qualname__}>"


def _with_defaults(patch: TorchPatch) -> type[DataLoader[Any]]:
    # A subclass, so only loaders built through torch's name get the defaults (and
    # only while the patch is in force: a framework may have kept the class); its
    # __init__ keeps DataLoader's signature (inspect follows __wrapped__), which
    # frameworks read to rebuild a loader from its attributes.
    class PatchedDataLoader(DataLoader):  # type: ignore[type-arg]
        @functools.wraps(DataLoader.__init__)  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if patch.active:
                kwargs = {**patch.defaults, **kwargs}
            super().__init__(*args, **kwargs)

    # Named as the class it stands for; the qualname stays local, so pickling one
    # fails loudly rather than coming back as another class.
    PatchedDataLoader.__name__ = "DataLoader"
    PatchedDataLoader.__qualname__ = "patch_torch.<locals>.DataLoader"
    PatchedDataLoader.__doc__ = (
        f"fastload.DataLoader with the defaults {patch.defaults!r} (fastload.patch_torch)"
    )
    return PatchedDataLoader


def patch_torch(**defaults: Any) -> TorchPatch:
    """Bind ``torch.utils.data.DataLoader`` (and ``torch.utils.data.dataloader.DataLoader``) to fastload's.

    Args:
        **defaults: Defaults for fastload's keyword-only additions (``device=``,
            ``stats=``, ``read_threads=``, ...) in loaders built through torch's name
            while the patch is in force; an argument the caller passes wins.

    Returns:
        A :class:`TorchPatch`; call ``.undo()``, or use it as a context manager.

    Raises:
        ConfigError: A default names no fastload addition (torch's own arguments are
            the framework's to choose).

    Example:
        >>> import torch.utils.data
        >>> with patch_torch(stats=False):
        ...     loader = torch.utils.data.DataLoader(list(range(6)), batch_size=4)
        >>> type(loader).__module__, loader.stats_enabled, [b.tolist() for b in loader]
        ('fastload.loader.patch', False, [[0, 1, 2, 3], [4, 5]])
        >>> torch.utils.data.DataLoader.__module__
        'torch.utils.data.dataloader'
    """
    unknown = sorted(set(defaults) - set(ADDITIONS))
    if unknown:
        raise ConfigError(
            f"patch_torch() got {unknown}: it sets defaults only for fastload's additions "
            f"({', '.join(ADDITIONS)}); pass torch's own arguments where the loader is built"
        )
    return TorchPatch(defaults)

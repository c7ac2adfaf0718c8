"""Import paths of the modules that moved into layer packages, still answering.

Issue 37 gathered the modules at fastload/'s root into one package per layer
(docs/architecture.md). Code outside fastload may still name a module by its old
path: a script's ``import fastload.curl``, or a pickle, which names each class by
its module (a checkpoint holding a ``fastload.sampler.ShardedSampler``, a worker
payload's ``fastload._worker_pack.Span``). :data:`MOVED` maps each old path to its
new one, and :class:`OldPaths` (installed on ``sys.meta_path`` by
``import fastload``) loads the new module under the old name: one module object,
both names, so a class unpickled through either is the same class.

Only module paths are kept; the names in ``fastload.__all__`` never moved
(tests/unit/test_import_paths.py imports each documented path and unpickles
objects pickled before the move).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["MOVED", "OldPaths", "install"]

#: old module path -> the module it is now
MOVED: dict[str, str] = {
    "fastload._loader_iter": "fastload.loader.iterator",
    "fastload._loop": "fastload.transport.loop",
    "fastload._torch_compat": "fastload.device.torch_compat",
    "fastload._torch_surface": "fastload.loader.torch_surface",
    "fastload._worker_pack": "fastload.device.worker_pack",
    "fastload._worker_stats": "fastload.loader.worker_stats",
    "fastload.answers": "fastload.transport.answers",
    "fastload.batch_tree": "fastload.device.batch_tree",
    "fastload.curl": "fastload.transport.curl",
    "fastload.diagnose.live": "fastload.loader.live",
    "fastload.failures": "fastload.transport.failures",
    "fastload.gather": "fastload.cache.gather",
    "fastload.hostlimit": "fastload.transport.hostlimit",
    "fastload.identity": "fastload.fetch.identity",
    "fastload.partition": "fastload.read.partition",
    "fastload.patch": "fastload.loader.patch",
    "fastload.prefetch": "fastload.device.prefetch",
    "fastload.readahead": "fastload.loader.readahead",
    "fastload.reader": "fastload.read.reader",
    "fastload.resume": "fastload.loader.resume",
    "fastload.sampler": "fastload.loader.sampler",
}


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of :data:`MOVED` and loads the module at its new path."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        # The import system sets __spec__ on what this returns; exec_module puts the
        # module's own spec back, so the module still says where it lives.
        module.__dict__.setdefault("_fl_own_spec", module.__spec__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__dict__.pop("_fl_own_spec")


_FINDER = OldPaths()


def install() -> None:
    """Put the old paths' finder on ``sys.meta_path`` once (``import fastload`` does)."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_FINDER)

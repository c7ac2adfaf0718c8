"""fastload: keep GPUs fed when training data sits behind a slow link.

The public API lives here; everything else is importable but not promised.
Names that need torch (``DataLoader``, the datasets) are imported on first use,
so ``fastload cache`` works on a machine without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from fastload import _moved
from fastload.cache import Cache
from fastload.config import Settings, format_size, parse_size
from fastload.errors import (
    CacheError,
    CacheFullError,
    CacheLimitError,
    CacheReadOnlyError,
    CertificateError,
    CodecError,
    ConfigError,
    CredentialsError,
    DecodeError,
    EmptyDatasetError,
    FastloadError,
    LoaderError,
    RemoteChangedError,
    RemoteNotFoundError,
    SourceError,
    SQLiteVersionError,
    StoppedError,
)
from fastload.fs import FastloadFileSystem, arrow_filesystem, open
from fastload.read.reader import Reader
from fastload.source import RemoteItem, Source
from fastload.stage import StageReport, stage
from fastload.stats import LoaderStats, StatsCollector, current_collector

__version__ = "0.1.0"

_moved.install()  # old module paths (fastload.curl, fastload.sampler...) still import

# name -> "module:attr"; imported lazily because these need torch.
_LAZY = {
    "ArrayDataset": "fastload.dataset:ArrayDataset",
    "DataLoader": "fastload.loader.dataloader:DataLoader",
    "DevicePrefetcher": "fastload.device.prefetch:DevicePrefetcher",
    "FileDataset": "fastload.dataset:FileDataset",
    "LitDataset": "fastload.formats.litdata:LitDataset",
    "MDSDataset": "fastload.formats.mds:MDSDataset",
    "ResumableSampler": "fastload.loader.sampler:ResumableSampler",
    "ShardedSampler": "fastload.loader.sampler:ShardedSampler",
    "TarDataset": "fastload.dataset:TarDataset",
    "TokenDataset": "fastload.dataset:TokenDataset",
    "TorchPatch": "fastload.loader.patch:TorchPatch",
    "patch_torch": "fastload.loader.patch:patch_torch",
}

__all__ = [
    "ArrayDataset",
    "Cache",
    "CacheError",
    "CacheFullError",
    "CacheLimitError",
    "CacheReadOnlyError",
    "CertificateError",
    "CodecError",
    "ConfigError",
    "CredentialsError",
    "DataLoader",
    "DecodeError",
    "DevicePrefetcher",
    "EmptyDatasetError",
    "FastloadError",
    "FastloadFileSystem",
    "FileDataset",
    "LitDataset",
    "LoaderError",
    "LoaderStats",
    "MDSDataset",
    "Reader",
    "RemoteChangedError",
    "RemoteItem",
    "RemoteNotFoundError",
    "ResumableSampler",
    "SQLiteVersionError",
    "Settings",
    "ShardedSampler",
    "Source",
    "SourceError",
    "StageReport",
    "StatsCollector",
    "StoppedError",
    "TarDataset",
    "TokenDataset",
    "TorchPatch",
    "arrow_filesystem",
    "current_collector",
    "format_size",
    "open",
    "parse_size",
    "patch_torch",
    "stage",
]


def __getattr__(name: str) -> Any:
    if name == "pipelines":  # a subpackage: `fastload.pipelines.ImageClassification(...)`
        package = importlib.import_module("fastload.pipelines")
        globals()[name] = package
        return package
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}")
    module, attr = target.split(":")
    try:
        value = getattr(importlib.import_module(module), attr)
    except ImportError as err:
        raise ImportError(f"fastload.{name} needs torch ({err}); fix: pip install torch") from err
    globals()[name] = value
    return value

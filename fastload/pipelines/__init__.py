"""GPU decode and augmentation pipelines, with DALI or torch, as a DataLoader collate step.

A pipeline object is called on the list of samples the loader gathered for one
batch and returns tensors on the device, so it plugs in as ``collate_fn``::

    import fastload
    from fastload.pipelines import ImageClassification

    ds = fastload.FileDataset("s3://bucket/train", "**/*.jpg", label="parent")
    pipe = ImageClassification(train=True, size=224, dtype="float16", device="cuda")
    loader = fastload.DataLoader(ds, batch_size=256, shuffle=True, collate_fn=pipe)
    for batch in loader:
        batch["image"], batch["label"]  # (256, 3, 224, 224) float16 and int64, on cuda

Only the encoded bytes (JPEG, or LZ4 chunks for :class:`ArrayPipeline`) cross
the GPU link. Epochs, shuffling, ``distributed=True`` and ``state_dict`` resume
are the loader's and work unchanged. See docs/pipelines.md.

DALI is optional and imported on first use (``pip install 'fastload[dali]'``);
without it, ``backend="auto"`` uses the torch backend.

Layer: above the faces (fastload.dataset), fastload.read and fastload.device (its copies go
through a DevicePrefetcher); beside fastload.loader, which it never imports (it plugs in as a
``collate_fn``); imported by diagnose.
"""

from __future__ import annotations

from fastload.pipelines._common import BACKENDS, DTYPES, IMAGENET_MEAN, IMAGENET_STD
from fastload.pipelines._registry import available
from fastload.pipelines.array import ArrayPipeline, CompressedArrayDataset, Payload, read_payload
from fastload.pipelines.image import ImageClassification

__all__ = [
    "ArrayPipeline",
    "BACKENDS",
    "CompressedArrayDataset",
    "DTYPES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageClassification",
    "Payload",
    "available",
    "read_payload",
]

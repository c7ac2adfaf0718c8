"""The DALI backend: one graph per pipeline, built for a placement, fed from Python.

Each graph function below is the *only* definition of its pipeline; the
placement (``"gpu"`` or ``"cpu"``) is a parameter that picks operator devices:

* ``"gpu"``: ``decoders.image(device="mixed")`` (nvJPEG: Huffman decoding on the
  CPU, or on the GPU's hardware JPEG decoder where it has one; the IDCT and
  colour conversion on the GPU; not yet run on a GPU), GPU resize and
  crop/mirror/normalize, ``decoders.inflate`` (nvCOMP) for LZ4 chunks. The
  pipeline is built with ``device_id`` = the target GPU.
* ``"cpu"``: the same operators on the CPU and ``device_id=None``, which needs
  no GPU, driver or CUDA runtime (DALI's ``Pipeline`` docstring; NVIDIA/DALI PR
  2165); DALI has no CPU inflate, so LZ4 payloads are decoded on host threads
  before they are fed.

Batches are fed with ``feed_input`` to a named ``fn.external_source``, and each
output is copied into a tensor torch allocated (:func:`to_torch`), on torch's
current stream for GPU outputs, as DALI's own torch plugin does. A DLPack view
would be no copy, but DALI frees its buffers in its own stream's order
(``alloc_raw_async_shared``): ``__dlpack__(stream)`` makes torch wait for DALI,
never DALI for torch, so the next run could reuse a buffer before a torch kernel
queued on the view had read it. ``copy_to_external(..., non_blocking=True)``
makes DALI's buffer wait for the copy instead
(``tests/gpu/test_pipelines_gpu.py::test_dali_outputs_survive_the_next_run_while_torch_is_busy``).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from fastload.pipelines import _registry

_SAMPLE_RE = re.compile(r"sample (?:#|of idx |at index )(\d+)")


def image_graph(
    *,
    placement: str,
    train: bool,
    size: int,
    resize: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    flip: float,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    dtype: str,
    layout: str,
    attempts: int,
) -> Any:
    """Image classification: decode, (random-resized-crop + flip | resize + center crop), normalize.

    The val resize computes its output size exactly as the torch backend does
    (shorter side = ``resize``, longer side truncated, as torchvision), from the
    JPEG header (``peek_image_shape``), because DALI's own ``resize_shorter``
    maps the longer side with a sub-pixel offset and disagrees by ~1.4 levels.
    """
    fn = _registry.load("dali.fn")
    types = _registry.load("dali.types")
    dmath = _registry.load("dali.math")
    decoder = "mixed" if placement == "gpu" else "cpu"
    jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
    if train:
        images = fn.decoders.image_random_crop(
            jpegs,
            device=decoder,
            output_type=types.RGB,
            random_area=list(scale),
            random_aspect_ratio=list(ratio),
            num_attempts=attempts,
        )
        images = fn.resize(images, size=[float(size), float(size)])
        mirror: Any = fn.random.coin_flip(probability=flip)
        crop: Any = None
    else:
        shape = fn.peek_image_shape(jpegs, dtype=types.FLOAT)
        short = dmath.min(shape[0], shape[1])
        # 1e-3 guards exact quotients against float32 rounding (256*w/h = 341.0000 -> 340).
        out_hw = dmath.floor(shape[0:2] * (float(resize) / short) + 1e-3)
        images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
        images = fn.resize(images, size=out_hw)
        mirror, crop = 0, (size, size)
    kwargs: dict[str, Any] = {
        "dtype": types.UINT8 if dtype == "uint8" else (types.FLOAT16 if dtype == "float16" else types.FLOAT),
        "output_layout": layout,
        "mirror": mirror,
    }
    if crop is not None:
        kwargs["crop"] = crop
    if dtype != "uint8" and mean is not None and std is not None:  # uint8: raw pixels
        kwargs["mean"] = [255.0 * m for m in mean]
        kwargs["std"] = [255.0 * s for s in std]
    return fn.crop_mirror_normalize(images, **kwargs)


def array_graph(*, placement: str) -> Any:
    """Raw bytes of cached arrays: LZ4 chunks inflated on the GPU, or host-decoded bytes on CPU.

    GPU inputs: ``payload`` (the whole stored payload, header included, as 1-D
    uint8), ``offsets`` and ``sizes`` (each LZ4 chunk's place in it, from
    :meth:`fastload.codec.PayloadInfo.chunk_offsets`), ``shape`` (one chunk's
    raw size, the same for the whole batch). Output per sample: (chunks, chunk
    bytes) uint8, the last chunk zero-padded by DALI. CPU input: the raw bytes.
    """
    fn = _registry.load("dali.fn")
    types = _registry.load("dali.types")
    payload = fn.external_source(name="payload", dtype=types.UINT8, ndim=1)
    if placement != "gpu":
        return payload  # DALI's inflate is GPU-only; the host has decoded these bytes
    offsets = fn.external_source(name="offsets", dtype=types.INT32, ndim=1)
    sizes = fn.external_source(name="sizes", dtype=types.INT32, ndim=1)
    shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
    return fn.decoders.inflate(
        payload.gpu(), chunk_offsets=offsets, chunk_sizes=sizes, shape=shape, dtype=types.UINT8
    )


class DaliRunner:
    """Builds a graph into a DALI pipeline on first use and runs it on fed batches.

    The pipeline is rebuilt when a batch is larger than the one it was built for,
    and after a failed run (DALI marks a pipeline invalid after an operator error).

    Args:
        graph: One of the graph functions above.
        graph_kwargs: Its arguments (``placement`` included).
        device_index: GPU ordinal for ``placement="gpu"``; ignored on CPU.
        threads: DALI CPU worker threads.
        seed: The pipeline seed; random operators derive theirs from it.
    """

    def __init__(
        self,
        graph: Callable[..., Any],
        graph_kwargs: dict[str, Any],
        *,
        device_index: int | None,
        threads: int,
        seed: int,
    ) -> None:
        self.graph = graph
        self.graph_kwargs = graph_kwargs
        self.placement = graph_kwargs["placement"]
        self.device_index = device_index if self.placement == "gpu" else None
        self.threads = threads
        self.seed = seed
        self._pipe: Any = None
        self._max_batch = 0
        #: Pipelines built so far (first use, growth and recoveries).
        self.builds = 0

    def _build(self, batch_size: int) -> None:
        dali = _registry.load("dali")
        self._pipe = None
        pipe = dali.pipeline_def(self.graph)(
            batch_size=batch_size,
            num_threads=self.threads,
            device_id=self.device_index,
            seed=self.seed,
            prefetch_queue_depth=1,  # fed one batch at a time, run at once
            exec_dynamic=True,  # DALI's default since 2.0; outputs are copied out anyway (to_torch)
            **self.graph_kwargs,
        )
        pipe.build()
        self._pipe, self._max_batch = pipe, batch_size
        self.builds += 1

    def run(self, feeds: dict[str, list[np.ndarray]]) -> tuple[Any, ...]:
        """Feed one batch to each named input and run; returns DALI's TensorLists.

        Raises:
            RuntimeError: DALI's own error (an operator failed on some sample); the
                pipeline is rebuilt on the next call.
        """
        n = len(next(iter(feeds.values())))
        if self._pipe is None or n > self._max_batch:
            self._build(max(n, self._max_batch))
        pipe = self._pipe
        try:
            for name, batch in feeds.items():
                pipe.feed_input(name, batch)
            return tuple(pipe.run())
        except RuntimeError:
            self._pipe = None  # "Current pipeline object is no longer valid"
            raise


def failed_sample(err: BaseException) -> int | None:
    """The batch position DALI's error message names ("Failed to decode sample #2"), if any."""
    match = _SAMPLE_RE.search(str(err))
    return int(match.group(1)) if match else None


def _torch_dtype(dali_dtype: Any) -> torch.dtype:
    """The torch dtype of a DALI output dtype (``DALIDataType.FLOAT`` -> ``torch.float32``)."""
    types = _registry.load("dali.types")
    names = {"FLOAT": "float32", "FLOAT64": "float64", "FLOAT16": "float16", "BOOL": "bool"}
    for name in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", *names):
        if dali_dtype == getattr(types.DALIDataType, name):
            return cast(torch.dtype, getattr(torch, names.get(name, name.lower())))
    raise TypeError(f"DALI output dtype {dali_dtype} has no torch dtype here")


def to_torch(batch: Any) -> torch.Tensor:
    """A dense DALI TensorList copied into one tensor that torch allocated and owns.

    GPU outputs are copied on torch's current stream, so a torch kernel queued
    after this call reads the copy; with ``non_blocking=True`` DALI's buffer
    waits for the copy before DALI can reuse it (module docstring).
    """
    dense = batch.as_tensor()
    dtype = _torch_dtype(dense.dtype)
    shape = tuple(int(d) for d in dense.shape())
    if not hasattr(batch, "device_id"):  # only TensorListGPU has one; a CPU copy is a memcpy
        out = torch.empty(shape, dtype=dtype)
        batch.copy_to_external(ctypes.c_void_p(out.data_ptr()))
        return out
    device = torch.device("cuda", int(batch.device_id()))
    out = torch.empty(shape, dtype=dtype, device=device)
    stream = torch.cuda.current_stream(device)
    batch.copy_to_external(
        ctypes.c_void_p(out.data_ptr()), cuda_stream=ctypes.c_void_p(stream.cuda_stream), non_blocking=True
    )
    return out

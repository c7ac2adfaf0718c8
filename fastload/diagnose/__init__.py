"""Diagnostics: ``fastload diagnose``, ``fastload bench`` and live loader stats.

Modules (each imported on first use, so ``import fastload.diagnose`` is cheap):

* :mod:`~fastload.diagnose.run` - runs every probe, builds the report
* :mod:`~fastload.diagnose.env` - OS, CPU, RAM, torch/CUDA, driver, DALI; warnings
* :mod:`~fastload.diagnose.gpu` - NVML per device (``nvidia-ml-py``, extra ``[diag]``)
* :mod:`~fastload.diagnose.link` - H2D/D2H bandwidth and eGPU detection
* :mod:`~fastload.diagnose.storage` - TTFB, throughput against concurrency, list speed
* :mod:`~fastload.diagnose.disk` - cache disk read speed and cache state
* :mod:`~fastload.diagnose.compute` - CPU/GPU JPEG decode, LZ4 decode
* :mod:`~fastload.diagnose.verdict` - per-op ceilings, the limit, the advice
* :mod:`~fastload.diagnose.report` / :mod:`~fastload.diagnose.plot` - text and PNG output
* :mod:`~fastload.diagnose.bench` - ``fastload bench``

See docs/diagnostics.md.

Layer: the top but one (only the CLI imports it); it may import every layer below, the loader
and the pipelines included (``fastload bench`` runs the real DataLoader).
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_diagnose"]


def run_diagnose(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run every probe; see :func:`fastload.diagnose.run.run_diagnose`."""
    from fastload.diagnose.run import run_diagnose as run

    return run(*args, **kwargs)

"""Small helpers shared by the probes: section results, timing loops, number formats.

Every probe returns a plain dict (it goes straight into ``--json``) with a
``status`` of ``"ok"``, ``"skipped"`` (with a one-line ``reason``) or ``"error"``
(with the exception's text). :func:`guarded` turns an unexpected exception in one
probe into an ``"error"`` section, so one broken probe never hides the others.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("fastload.diagnose")

# Optional parts: import name -> (module to import, install hint). Imported on first
# use only, so `fastload diagnose` runs with none of them (STYLE.md: lazy registries).
OPTIONAL: dict[str, tuple[str, str]] = {
    "pynvml": ("pynvml", "pip install 'fastload[diag]' (nvidia-ml-py)"),
    "matplotlib": ("matplotlib", "pip install 'fastload[diag]' (matplotlib)"),
    "PIL": ("PIL.Image", "pip install 'fastload[samples]' (Pillow)"),
    "torch": ("torch", "pip install torch"),
    "torchvision": ("torchvision.io", "pip install torchvision"),
}


class MissingOptional(ImportError):
    """An optional package is not installed; ``str()`` carries the install hint."""


def optional(name: str) -> Any:
    """Import the optional module registered as ``name``, or raise with its install hint."""
    module, hint = OPTIONAL[name]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingOptional(f"{name} is not installed; fix: {hint}") from err


def ok(**fields: Any) -> dict[str, Any]:
    """A measured section."""
    return {"status": "ok", **fields}


def skipped(reason: str, **fields: Any) -> dict[str, Any]:
    """A section that could not run here, with one line saying why."""
    return {"status": "skipped", "reason": reason, **fields}


def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run probe ``fn``; an unexpected exception becomes an ``"error"`` section.

    A :class:`MissingOptional` becomes ``"skipped"`` with its install hint.
    """
    t0 = time.perf_counter()
    try:
        out = fn()
    except MissingOptional as err:
        out = skipped(str(err))
    except Exception as err:  # one broken probe must not hide the others
        _log.debug("probe %s failed", name, exc_info=True)
        out = {"status": "error", "reason": f"{type(err).__name__}: {err}"}
    out.setdefault("probe_seconds", round(time.perf_counter() - t0, 3))
    return out


def timed_loop(fn: Callable[[], int], budget_s: float, min_calls: int = 1, *, cpu: bool = True) -> tuple[int, float]:
    """Call ``fn`` (returning a unit count) for ``budget_s`` of wall time; return (units, seconds).

    With ``cpu=True`` the seconds are this thread's CPU time (``time.thread_time``),
    not wall time: a rate "per core" then means what it says even when other
    processes share the cores, which would lower a wall-clock rate by their share.
    Work that waits on a device (GPU decode) needs ``cpu=False``.
    """
    units, calls = 0, 0
    clock = time.thread_time if cpu else time.perf_counter
    t0 = time.perf_counter()
    c0 = clock()
    while True:
        units += fn()
        calls += 1
        if time.perf_counter() - t0 >= budget_s and calls >= min_calls:
            return units, max(clock() - c0, 1e-9)


def sig(x: float, digits: int = 2) -> float:
    """Round ``x`` to ``digits`` significant digits.

    >>> sig(4321), sig(0.012345, 3)
    (4300, 0.0123)
    """
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, -int(math.floor(math.log10(abs(x)))) + digits - 1)


def fmt_rate(x: float | None) -> str:
    """A samples/s figure for prose.

    >>> fmt_rate(4321), fmt_rate(113.4), fmt_rate(None)
    ('4,300', '113', '-')
    """
    if x is None:
        return "-"
    if x >= 1000:
        return f"{sig(x, 2):,.0f}"
    if x >= 10:
        return f"{x:.0f}"
    return f"{x:.2g}"


def fmt_bps(x: float | None) -> str:
    """Bytes/s for prose: ``2.6e9 -> '2.6 GB/s'`` (decimal units, as the reference doc)."""
    if x is None:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if x >= scale:
            v = x / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{x:.0f} B/s"


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of a non-empty list, nearest rank."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]

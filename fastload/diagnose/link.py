"""The host-to-GPU link: measured H2D/D2H bandwidth, and eGPU detection.

Thunderbolt and USB4 tunnel PCIe, and their ports always advertise 2.5 GT/s
(Gen1) whatever they really move (the USB4 specification; M. Limonciello's Linux
patch, mail-archive.com/nouveau@lists.freedesktop.org/msg42849.html), so
the reported link generation cannot be trusted on its own. Nor can an idle
reading: a desktop GPU parks its link at Gen1 when idle and raises it only
under load. :func:`measure_link` first copies for :data:`WARMUP_S` seconds, then
times copies of one buffer with CUDA events, pageable and pinned host memory,
both directions, and reads the link generation and width through NVML *while*
the timed copies run. :func:`classify_link` (pure, unit-tested) compares the
pinned H2D rate with what that link and the maximum PCIe generation and width
should give, and with the sysfs ``removable`` flag that external devices carry.
Only a narrow link (x4 or less, as Thunderbolt, USB4 and OCuLink give) is
called an eGPU from its rate: a x16 card that reads Gen1 or moves 3 GB/s is a
slow or parked slot, not an enclosure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastload.diagnose._util import MissingOptional, median, ok, optional, skipped

__all__ = [
    "LANE_BYTES_PER_S",
    "NARROW_WIDTH",
    "PINNED_EFFICIENCY",
    "WARMUP_S",
    "classify_link",
    "measure_link",
    "pcie_bytes_per_s",
    "under_load",
]

#: Usable bytes/s per lane after line encoding: Gen1/2 8b/10b, Gen3-5 128b/130b, Gen6 FLIT.
LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.56e9}
#: Pinned H2D reaches about 75% of the nominal rate on healthy slots (12.2 of 15.75 GB/s
#: on PCIe 3.0 x16, mpicbg-scicomp/gearshifft PR 82; 22.5-25 of 31.5 GB/s on PCIe 4.0 x16,
#: NVlabs/cuda-oxide PR 976 and NVIDIA/nvbandwidth issue 42).
PINNED_EFFICIENCY = 0.75
#: A link below this share of its expected rate is flagged.
SLOW_SHARE = 0.5
#: Widest link still read as an eGPU's (Thunderbolt/USB4 tunnels and OCuLink are x4).
NARROW_WIDTH = 4
#: Seconds of copies before timing: one copy may not raise a parked link from Gen1.
WARMUP_S = 0.25


def pcie_bytes_per_s(gen: int | None, width: int | None) -> float | None:
    """Nominal usable bytes/s of a PCIe link, or None when gen/width are unknown.

    >>> pcie_bytes_per_s(4, 16) / 1e9, pcie_bytes_per_s(1, 4) / 1e9, pcie_bytes_per_s(None, 16)
    (31.504, 1.0, None)
    """
    if not gen or not width or gen not in LANE_BYTES_PER_S:
        return None
    return LANE_BYTES_PER_S[gen] * width


def _band(bps: float) -> str:
    gb = bps / 1e9
    if gb < 1.5:
        return "slower than any Thunderbolt eGPU (a x1 riser or a Gen1/2 x4 slot?)"
    if gb < 4.0:
        return "Thunderbolt 3/4 or USB4 class (2.4-3.6 GB/s)"
    if gb < 7.5:
        return "PCIe 4.0 x4 / OCuLink / Thunderbolt 5 class (about 6.6 GB/s)"
    if gb < 16:
        return "PCIe 3.0 x16 or PCIe 4.0 x8 class"
    if gb < 30:
        return "PCIe 4.0 x16 class"
    return "PCIe 5.0 x16 class"


def classify_link(
    h2d_pinned_bps: float,
    *,
    gen_current: int | None = None,
    width_current: int | None = None,
    gen_max: int | None = None,
    width_max: int | None = None,
    removable: bool | None = None,
) -> dict[str, Any]:
    """Compare a measured pinned H2D rate with the link's reported and maximum capability.

    ``gen_current``/``width_current`` should be read while copies run (an idle
    link may be parked at Gen1). The rate-based eGPU rules need a current width
    of at most :data:`NARROW_WIDTH`.

    Returns a dict with ``egpu_suspected`` (bool), ``slow`` (much slower than
    expected), ``evidence`` (sentences with numbers), ``expected_bps`` (from the
    max generation and width, at :data:`PINNED_EFFICIENCY`) and ``band`` (which
    kind of link the rate looks like).
    """
    evidence = []
    reported = pcie_bytes_per_s(gen_current, width_current)
    maximum = pcie_bytes_per_s(gen_max or gen_current, width_max or width_current)
    expected = maximum * PINNED_EFFICIENCY if maximum else None
    gb = h2d_pinned_bps / 1e9
    egpu = False
    slow = False
    if removable:
        egpu = True
        evidence.append("sysfs marks the GPU's PCI device 'removable' (Thunderbolt/USB4 attached)")
    narrow = width_current is not None and width_current <= NARROW_WIDTH
    if reported is not None and gen_current == 1 and narrow and h2d_pinned_bps > 1.2 * reported:
        egpu = True
        evidence.append(
            f"the link reports Gen1 x{width_current} ({reported / 1e9:.2f} GB/s) yet moves {gb:.2f} GB/s: "
            "a tunneled link (Thunderbolt/USB4 ports advertise 2.5 GT/s)"
        )
    if expected is not None and h2d_pinned_bps < SLOW_SHARE * expected:
        slow = True
        evidence.append(
            f"pinned H2D {gb:.2f} GB/s is {h2d_pinned_bps / expected:.0%} of the {expected / 1e9:.1f} GB/s "
            f"expected from PCIe Gen{gen_max or gen_current} x{width_max or width_current}"
        )
        if narrow and 1.5e9 <= h2d_pinned_bps < 4.0e9:
            egpu = True
            evidence.append(f"{gb:.2f} GB/s over a x{width_current} link is what Thunderbolt 3/4 and USB4 eGPUs move")
    return {
        "egpu_suspected": egpu,
        "slow": slow,
        "band": _band(h2d_pinned_bps),
        "reported_bps": reported,
        "expected_bps": expected,
        "evidence": evidence,
    }


LinkReader = Callable[[], tuple[int | None, int | None]]  # (generation, width) now


def _rate(torch: Any, copy: Any, nbytes: int, repeats: int, read_link: LinkReader | None, seen: list[Any]) -> float:
    """Bytes/s of ``copy`` (median of ``repeats``, timed with CUDA events) after a timed warm-up.

    ``read_link`` (NVML's current generation and width) is called while each timed
    copy is in flight; its readings go to ``seen``.
    """
    deadline = time.perf_counter() + WARMUP_S
    while True:  # first-touch, driver staging buffers, and a link raised out of its idle state
        copy()
        torch.cuda.synchronize()
        if time.perf_counter() >= deadline:
            break
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        copy()
        end.record()
        if read_link is not None:
            seen.append(read_link())
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / median(times)


def _bus_id(props: Any) -> str | None:
    domain = getattr(props, "pci_domain_id", None)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return None
    return f"{int(domain or 0):04x}:{int(bus):02x}:{int(dev):02x}.0"


def under_load(readings: list[Any]) -> dict[str, int | None]:
    """The fastest link seen while copies ran: the highest generation and width read.

    >>> under_load([(1, 16), (4, 16), (None, None)])
    {'gen': 4, 'width': 16}
    >>> under_load([])
    {'gen': None, 'width': None}
    """
    gens = [g for g, _ in readings if g]
    widths = [w for _, w in readings if w]
    return {"gen": max(gens, default=None), "width": max(widths, default=None)}


def _rates(torch: Any, dev: Any, nbytes: int, repeats: int, read_link: LinkReader | None) -> dict[str, Any]:
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # fault the pages in before timing
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    seen: list[Any] = []

    def rate(copy: Any, reader: LinkReader | None = None) -> float:
        return _rate(torch, copy, nbytes, repeats, reader, seen)

    return {
        "h2d_pageable_bps": rate(lambda: gpu.copy_(pageable)),
        "h2d_pinned_bps": rate(lambda: gpu.copy_(pinned, non_blocking=True), read_link),
        "d2h_pageable_bps": rate(lambda: pageable.copy_(gpu)),
        "d2h_pinned_bps": rate(lambda: pinned.copy_(gpu, non_blocking=True)),
        "pcie_under_load": under_load(seen),
    }


def _nvml_reader(pynvml: Any, index: int, bus_id: str | None) -> LinkReader | None:
    """NVML's current PCIe generation and width of CUDA device ``index``, or None without NVML."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id) if bus_id else pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # NVMLError_NotFound with an odd bus id format: CUDA order is NVML's by default
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            return None

    def read() -> tuple[int | None, int | None]:
        try:
            return (int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
                    int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)))
        except Exception:  # NotSupported on vGPUs and some consumer cards
            return (None, None)

    return read


def _one_device(torch: Any, index: int, nbytes: int, repeats: int, pynvml: Any) -> dict[str, Any]:
    dev = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(index)
    bus_id = _bus_id(props)
    reader = _nvml_reader(pynvml, index, bus_id) if pynvml is not None else None
    with torch.cuda.device(dev):
        rates = _rates(torch, dev, nbytes, repeats, reader)
        torch.cuda.empty_cache()  # the buffers died with _rates; give their memory back
    return {"index": index, "name": props.name, "pci_bus_id": bus_id, "buffer_bytes": nbytes, **rates}


def measure_link(nbytes: int = 64 * 1024**2, repeats: int = 5) -> dict[str, Any]:
    """Time pageable and pinned copies of ``nbytes`` each way on every CUDA device.

    Each device record has the four rates and ``pcie_under_load`` (NVML's link
    generation and width read during the pinned H2D copies; None without NVML).
    """
    try:
        torch = optional("torch")
    except MissingOptional as err:
        return skipped(str(err), devices=[])
    if not torch.cuda.is_available():
        return skipped("no CUDA device: torch.cuda.is_available() is False", devices=[])
    try:
        pynvml: Any = optional("pynvml")
        pynvml.nvmlInit()
    except Exception:  # no [diag] extra or no driver: rates only
        pynvml = None
    try:
        return ok(devices=[_one_device(torch, i, nbytes, repeats, pynvml) for i in range(torch.cuda.device_count())])
    finally:
        if pynvml is not None:
            pynvml.nvmlShutdown()


def attach_classification(link: dict[str, Any], gpus: dict[str, Any]) -> None:
    """Add ``classification`` to each measured device, using NVML's PCIe facts when present."""
    by_bus = {}
    for g in gpus.get("devices", []):
        bus = (g.get("pci_bus_id") or "").lower()
        by_bus[bus[-12:]] = g  # NVML pads the domain to 8 digits; compare the tail
    for i, d in enumerate(link.get("devices", [])):
        nvml = by_bus.get((d.get("pci_bus_id") or "").lower()[-12:])
        if nvml is None and i < len(gpus.get("devices", [])):
            nvml = gpus["devices"][i]  # no bus ids: same order unless CUDA_VISIBLE_DEVICES reorders
        pcie = (nvml or {}).get("pcie", {})
        loaded = d.get("pcie_under_load") or {}
        d["classification"] = classify_link(
            d["h2d_pinned_bps"],
            # Read during the copies where we could: an idle link may be parked at Gen1.
            gen_current=loaded.get("gen") or pcie.get("gen_current"),
            width_current=loaded.get("width") or pcie.get("width_current"),
            gen_max=pcie.get("gen_max"),
            width_max=pcie.get("width_max"),
            removable=pcie.get("removable"),
        )

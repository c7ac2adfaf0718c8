"""The host-to-GPU link: measured H2D/D2H bandwidth, and eGPU detection.

Thunderbolt and USB4 tunnel PCIe, and their ports always advertise 2.5 GT/s
(Gen1) whatever they really move (``shared/reference/limits.md`` section 1), so
the reported link generation cannot be trusted on its own. :func:`measure_link`
times copies of one buffer with pageable and pinned host memory in both
directions; :func:`classify_link` (pure, unit-tested) compares the pinned H2D
rate with what the reported and the maximum PCIe generation and width should
give, and with the sysfs ``removable`` flag that external devices carry.
"""

from __future__ import annotations

import time
from typing import Any

from fastload.diagnose._util import MissingOptional, median, ok, optional, skipped

__all__ = ["LANE_BYTES_PER_S", "PINNED_EFFICIENCY", "classify_link", "measure_link", "pcie_bytes_per_s"]

#: Usable bytes/s per lane after line encoding: Gen1/2 8b/10b, Gen3-5 128b/130b, Gen6 FLIT.
LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.56e9}
#: Pinned H2D reaches about 75% of the nominal rate on healthy slots (12.2 of 15.75 GB/s
#: on PCIe 3.0 x16, 22.5-25 of 31.5 GB/s on PCIe 4.0 x16; limits.md section 1).
PINNED_EFFICIENCY = 0.75
#: A link below this share of its expected rate is flagged.
SLOW_SHARE = 0.5


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
    if reported is not None and gen_current == 1 and h2d_pinned_bps > 1.2 * reported:
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
        if 1.5e9 <= h2d_pinned_bps < 4.0e9:
            egpu = True
            evidence.append(f"{gb:.2f} GB/s is what Thunderbolt 3/4 and USB4 eGPUs move")
    return {
        "egpu_suspected": egpu,
        "slow": slow,
        "band": _band(h2d_pinned_bps),
        "reported_bps": reported,
        "expected_bps": expected,
        "evidence": evidence,
    }


def _rate(copy: Any, sync: Any, nbytes: int, repeats: int) -> float:
    copy()  # warm-up: first-touch, driver staging buffers
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        sync()
        times.append(time.perf_counter() - t0)
    return nbytes / median(times)


def _bus_id(props: Any) -> str | None:
    domain = getattr(props, "pci_domain_id", None)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return None
    return f"{int(domain or 0):04x}:{int(bus):02x}:{int(dev):02x}.0"


def _rates(torch: Any, dev: Any, nbytes: int, repeats: int) -> dict[str, float]:
    sync = torch.cuda.synchronize
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # fault the pages in before timing
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return {
        "h2d_pageable_bps": _rate(lambda: gpu.copy_(pageable), sync, nbytes, repeats),
        "h2d_pinned_bps": _rate(lambda: gpu.copy_(pinned, non_blocking=True), sync, nbytes, repeats),
        "d2h_pageable_bps": _rate(lambda: pageable.copy_(gpu), sync, nbytes, repeats),
        "d2h_pinned_bps": _rate(lambda: pinned.copy_(gpu, non_blocking=True), sync, nbytes, repeats),
    }


def _one_device(torch: Any, index: int, nbytes: int, repeats: int) -> dict[str, Any]:
    dev = torch.device("cuda", index)
    with torch.cuda.device(dev):
        rates = _rates(torch, dev, nbytes, repeats)
        torch.cuda.empty_cache()  # the buffers died with _rates; give their memory back
    props = torch.cuda.get_device_properties(index)
    return {"index": index, "name": props.name, "pci_bus_id": _bus_id(props), "buffer_bytes": nbytes, **rates}


def measure_link(nbytes: int = 64 * 1024**2, repeats: int = 5) -> dict[str, Any]:
    """Time pageable and pinned copies of ``nbytes`` each way on every CUDA device."""
    try:
        torch = optional("torch")
    except MissingOptional as err:
        return skipped(str(err), devices=[])
    if not torch.cuda.is_available():
        return skipped("no CUDA device: torch.cuda.is_available() is False", devices=[])
    return ok(devices=[_one_device(torch, i, nbytes, repeats) for i in range(torch.cuda.device_count())])


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
        d["classification"] = classify_link(
            d["h2d_pinned_bps"],
            gen_current=pcie.get("gen_current"),
            width_current=pcie.get("width_current"),
            gen_max=pcie.get("gen_max"),
            width_max=pcie.get("width_max"),
            removable=pcie.get("removable"),
        )

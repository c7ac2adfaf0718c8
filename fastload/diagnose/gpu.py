"""Per-GPU facts through NVML (``nvidia-ml-py``, the ``[diag]`` extra).

Name, memory, PCIe link generation and width (current and max), temperature,
power draw against its limit, clocks, utilization and the active throttle
reasons. NVML is imported on first use; without it, or without a driver, the
section is skipped with one line saying why. Each query is guarded on its own:
consumer cards and vGPUs answer ``NotSupported`` to some of them, and that
must not lose the others.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastload.diagnose._util import MissingOptional, ok, optional, skipped

__all__ = ["THROTTLE_REASONS", "gpu_devices", "throttle_names"]

# Bit -> name of NVML's clocks event (throttle) reasons; stable across NVML versions.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    """The reasons set in NVML's throttle bitmask.

    >>> throttle_names(0x24)
    ['sw_power_cap', 'sw_thermal_slowdown']
    """
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _query(fn: Callable[[], Any], errors: dict[str, str], key: str) -> Any:
    try:
        return fn()
    except Exception as err:  # NVMLError_NotSupported and friends: record, keep going
        errors[key] = f"{type(err).__name__}: {err}"
        return None


def _removable(bus_id: str | None) -> bool | None:
    """sysfs ``removable`` of the GPU's PCI device: Thunderbolt/USB4 devices are 'removable'."""
    if not bus_id:
        return None
    # NVML gives "00000000:01:00.0"; sysfs names it "0000:01:00.0".
    domain, _, rest = bus_id.lower().partition(":")
    path = Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}" / "removable"
    try:
        return path.read_text().strip() == "removable"
    except OSError:
        return None


def _device(pynvml: Any, index: int) -> dict[str, Any]:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    errors: dict[str, str] = {}

    def q(key: str, fn: Callable[[], Any]) -> Any:
        return _query(fn, errors, key)

    mem = q("memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
    pci = q("pci", lambda: pynvml.nvmlDeviceGetPciInfo(h))
    bus_id = _text(pci.busId) if pci is not None else None
    reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    mask = q("throttle", lambda: int(reasons_fn(h)))
    power = q("power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
    limit = q("power_limit_w", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000)
    util = q("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
    info = {
        "index": index,
        "name": q("name", lambda: _text(pynvml.nvmlDeviceGetName(h))),
        "pci_bus_id": bus_id,
        "memory_total_bytes": None if mem is None else int(mem.total),
        "memory_used_bytes": None if mem is None else int(mem.used),
        "pcie": {
            "gen_current": q("pcie_gen", lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h))),
            "gen_max": q("pcie_gen_max", lambda: int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h))),
            "gen_gpu_max": q("pcie_gen_gpu_max", lambda: int(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(h))),
            "width_current": q("pcie_width", lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))),
            "width_max": q("pcie_width_max", lambda: int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))),
            "removable": _removable(bus_id),
        },
        "temperature_c": q("temperature", lambda: int(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))),
        "power_w": power,
        "power_limit_w": limit,
        "clocks_mhz": {
            "sm": q("clock_sm", lambda: int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))),
            "sm_max": q("clock_sm_max", lambda: int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))),
            "mem": q("clock_mem", lambda: int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM))),
            "mem_max": q("clock_mem_max", lambda: int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM))),
        },
        "utilization_pct": None if util is None else {"gpu": int(util.gpu), "memory": int(util.memory)},
        "throttle_mask": mask,
        "throttle_reasons": [] if mask is None else throttle_names(mask),
    }
    if errors:
        info["unsupported"] = errors
    return info


def gpu_devices() -> dict[str, Any]:
    """The GPU section: one record per NVML device, or skipped with the reason."""
    try:
        pynvml = optional("pynvml")
    except MissingOptional as err:
        return skipped(f"GPU details need NVML: {err}", devices=[])
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound / DriverNotLoaded on GPU-less machines
        return skipped(f"NVML cannot start ({type(err).__name__}: {err}): no NVIDIA driver here", devices=[])
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        if count == 0:
            return skipped("NVML sees no GPU", devices=[])
        return ok(devices=[_device(pynvml, i) for i in range(count)])
    finally:
        pynvml.nvmlShutdown()

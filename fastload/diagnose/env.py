"""Environment: OS, CPU, RAM, Python, torch/CUDA, the NVIDIA driver, DALI, packages.

Nothing here imports DALI (a multi-hundred-MB import): its version and the CUDA
major it was built for come from the installed distribution's metadata. The
driver's version and the CUDA version it supports come from NVML when
nvidia-ml-py is installed, else from ``/proc/driver/nvidia/version``.

:func:`warnings_for` turns the facts into one warning per known
incompatibility; it is pure, so the rules are unit-tested on synthetic facts.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from fastload.config import usable_cpus
from fastload.diagnose._util import MissingOptional, ok, optional, skipped

__all__ = ["environment", "gpu_sanity", "warnings_for"]

# Distribution names worth reporting; protocol backends first.
PACKAGES = (
    "fastload", "fsspec", "s3fs", "gcsfs", "adlfs", "aiohttp", "requests", "lz4", "xxhash",
    "numpy", "torch", "torchvision", "pillow", "pillow-simd", "nvidia-ml-py",
    "matplotlib", "tqdm",
)  # fmt: skip
_DALI_DIST = re.compile(r"^nvidia[-_]dali[-_](?:nightly[-_])?cuda(\d+)$", re.IGNORECASE)


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass  # not Linux, or no os-release: platform's answer below is enough
    return platform.platform()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no procfs (macOS, Windows): fall back to platform
    return platform.processor() or platform.machine()


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # no procfs: sysconf below
    if "MemTotal" not in out and hasattr(os, "sysconf"):
        try:
            out["MemTotal"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            pass  # unknown total RAM is reported as None
    return out


def _packages() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _dali() -> dict[str, Any] | None:
    for dist in metadata.distributions():
        name = dist.name or ""
        m = _DALI_DIST.match(name)
        if m:
            major = int(m.group(1)) // 10 if len(m.group(1)) == 3 else int(m.group(1))
            return {"distribution": name, "version": dist.version, "cuda_major": major}
    return None


def _driver() -> dict[str, Any]:
    """Driver version and the CUDA version it supports (NVML, else procfs)."""
    nvml_reason = None
    try:
        pynvml = optional("pynvml")
        pynvml.nvmlInit()
    except MissingOptional as err:
        nvml_reason = str(err)
    except Exception as err:  # pynvml.NVMLError: no driver library, no device
        nvml_reason = f"{type(err).__name__}: {err}"
    else:
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            cuda = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
        finally:
            pynvml.nvmlShutdown()
        return {
            "version": version.decode() if isinstance(version, bytes) else str(version),
            "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "source": "nvml",
        }
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return {"version": None, "cuda": None, "source": None,
                "reason": f"no NVIDIA driver (/proc/driver/nvidia/version is absent; NVML: {nvml_reason})"}
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return {"version": m.group(1) if m else text.split("\n", 1)[0], "cuda": None, "source": "procfs"}


def _gpu_hardware_present() -> bool:
    """An NVIDIA GPU seems present to the OS (device node or PCI vendor 0x10de display class)."""
    if Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia").exists():
        return True
    pci = Path("/sys/bus/pci/devices")
    try:
        for dev in pci.iterdir():
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
            if vendor == "0x10de" and klass.startswith("0x03"):
                return True
    except OSError:
        return False
    return False


def _torch() -> dict[str, Any]:
    try:
        torch = optional("torch")
    except MissingOptional as err:
        return {"installed": False, "reason": str(err)}
    info: dict[str, Any] = {
        "installed": True,
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": bool(torch.cuda.is_available()),
        "device_count": int(torch.cuda.device_count()) if torch.cuda.is_available() else 0,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
        cudnn = torch.backends.cudnn.version()
        info["cudnn"] = cudnn
    return info


def _pillow() -> dict[str, Any] | None:
    try:
        image = optional("PIL")
    except MissingOptional:
        return None
    from PIL import features

    return {"version": image.__version__, "libjpeg_turbo": bool(features.check_feature("libjpeg_turbo"))}


def environment() -> dict[str, Any]:
    """The environment section (always runs; never needs a GPU)."""
    mem = _meminfo()
    facts: dict[str, Any] = {
        "os": _os_name(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count() or 1,
        "cpu_usable": usable_cpus(),
        "ram_bytes": mem.get("MemTotal"),
        "ram_available_bytes": mem.get("MemAvailable"),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "torch": _torch(),
        "driver": _driver(),
        "gpu_hardware_present": _gpu_hardware_present(),
        "dali": _dali(),
        "pillow": _pillow(),
        "packages": _packages(),
    }
    facts["warnings"] = warnings_for(facts)
    return ok(**facts)


def _major(version: str | None) -> int | None:
    if not version:
        return None
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def warnings_for(facts: dict[str, Any]) -> list[str]:
    """One line per known incompatibility in ``facts`` (the environment section)."""
    out = []
    torch = facts.get("torch") or {}
    driver = facts.get("driver") or {}
    dali = facts.get("dali")
    driver_cuda = _major(driver.get("cuda"))
    gpu_hw = bool(facts.get("gpu_hardware_present"))
    if torch.get("installed") and torch.get("cuda") is None and (gpu_hw or driver.get("version")):
        out.append(
            f"torch {torch.get('version')} is a CPU-only build on a machine with an NVIDIA GPU; "
            "install a CUDA build (https://pytorch.org/get-started/locally/)"
        )
    torch_cuda = _major(torch.get("cuda"))
    if torch_cuda is not None and driver_cuda is not None and torch_cuda > driver_cuda:
        out.append(
            f"torch is built for CUDA {torch.get('cuda')} but the driver {driver.get('version')} supports "
            f"CUDA {driver.get('cuda')}; update the driver or install a torch built for CUDA {driver_cuda}.x"
        )
    if torch_cuda is not None and gpu_hw and not torch.get("cuda_available"):
        out.append(
            f"torch (CUDA {torch.get('cuda')}) sees no GPU though one is present: check the driver "
            "(nvidia-smi), CUDA_VISIBLE_DEVICES and the container's GPU access"
        )
    if dali is not None:
        dali_cuda = dali.get("cuda_major")
        if driver_cuda is not None and dali_cuda is not None and dali_cuda != driver_cuda:
            severity = "will not run" if dali_cuda > driver_cuda else "may not run"
            out.append(
                f"DALI {dali.get('version')} ({dali.get('distribution')}) is built for CUDA {dali_cuda} "
                f"but the driver supports CUDA {driver.get('cuda')}: its GPU operators {severity}; "
                f"install nvidia-dali-cuda{driver_cuda}0"
            )
        if torch_cuda is not None and dali_cuda is not None and dali_cuda != torch_cuda:
            out.append(
                f"DALI is built for CUDA {dali_cuda} and torch for CUDA {torch.get('cuda')}: two CUDA "
                "runtimes in one process; prefer matching majors"
            )
    pillow = facts.get("pillow")
    if pillow is None:
        out.append("Pillow is missing, so CPU JPEG decode is not measured: pip install 'fastload[samples]'")
    elif not pillow.get("libjpeg_turbo"):
        out.append("Pillow is built without libjpeg-turbo: CPU JPEG decode is 2-3x slower than it could be")
    if (facts.get("cpu_usable") or 1) < 4:
        out.append(
            f"only {facts.get('cpu_usable')} usable CPU cores: CPU-side JPEG decode will be slow; "
            "decode on the GPU where one is available"
        )
    load = facts.get("loadavg")
    cores = facts.get("cpu_count") or 1
    if load and load[0] > cores:
        out.append(
            f"the machine is busy (load average {load[0]:.1f} on {cores} cores): the CPU-side rates "
            "below are lower than on an idle machine; rerun when it is idle"
        )
    avail = facts.get("ram_available_bytes")
    if avail is not None and avail < 4e9:
        out.append(f"only {avail / 1e9:.1f} GB of RAM available: keep prefetch depths and workers small")
    return out


def gpu_sanity(size: int = 256) -> dict[str, Any]:
    """A small matmul on each CUDA device, checked against the CPU result."""
    try:
        torch = optional("torch")
    except MissingOptional as err:
        return skipped(str(err))
    if not torch.cuda.is_available():
        return skipped("no CUDA device: torch.cuda.is_available() is False")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    want = a @ b
    devices: list[dict[str, Any]] = []
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        try:
            got = (a.to(dev) @ b.to(dev)).cpu()
            max_err = float((got - want).abs().max())
            # TF32 matmuls differ from fp32 by ~1e-3 relative; far more means a broken device.
            good = bool(torch.allclose(got, want, rtol=1e-2, atol=1e-1))
            devices.append({"index": i, "ok": good, "max_abs_error": max_err})
        except Exception as exc:  # a device that cannot even run a matmul is the finding
            devices.append({"index": i, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return ok(devices=devices, all_ok=all(d["ok"] for d in devices))

"""Install the lowest allowed version of every dependency into a fresh venv, then import fastload.

Usage: python scripts/check_floors.py  (needs the package index; takes about a minute)

Reads ``[project].dependencies`` from pyproject.toml. Each ``name>=X`` is installed
as ``name==X`` from a wheel when one exists for this Python; otherwise (an old
release without wheels for a newer Python) the lowest later version that has one,
and the output says so. The venv does not see the system's site-packages, so
nothing newer leaks in. torch is not a dependency (users bring their own build)
and is not installed: ``import fastload`` must work without it.
Their own dependencies resolve as pip chooses (old ones build from source).
Exit status 0 when ``import fastload`` and ``import fastload.fs`` succeed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent


def floors() -> list[tuple[str, str]]:
    """(name, floor) of each ``name>=floor`` dependency."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = []
    for text in deps:
        req = Requirement(text)
        lows = [s.version for s in req.specifier if s.operator == ">="]
        if not lows:
            raise SystemExit(f"{text}: no >= floor to check")
        out.append((req.name, lows[0]))
    return out


def wheel_floor(pip: list[str], name: str, floor: str, scratch: str) -> str:
    """``floor`` when a wheel of it exists for this Python, else the lowest later one that has one."""
    got = subprocess.run(
        [*pip, "download", "-q", "--only-binary", ":all:", "--no-deps", "-d", scratch, f"{name}=={floor}"],
        capture_output=True, text=True,
    )  # fmt: skip
    if got.returncode == 0:
        return floor
    listed = re.search(r"from versions: ([^)]*)\)", got.stderr)
    if listed is None:
        raise SystemExit(f"{name}=={floor}: pip download failed:\n{got.stderr}")
    later = [Version(v) for v in listed.group(1).split(", ") if v and not Version(v).is_prerelease]
    later = [v for v in later if v >= Version(floor)]
    if not later:
        raise SystemExit(f"{name}>={floor}: no wheel for this Python")
    return str(min(later))


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fastload-floors-") as tmp:
        env_dir = os.path.join(tmp, "venv")
        venv.create(env_dir, with_pip=True, system_site_packages=False)
        python = os.path.join(env_dir, "bin", "python")
        pip = [python, "-m", "pip", "--disable-pip-version-check"]
        pins = []
        for name, floor in floors():
            pin = wheel_floor(pip, name, floor, os.path.join(tmp, "dl"))
            note = "" if pin == floor else f"  (declared {floor}: no wheel for Python {sys.version_info.major}.{sys.version_info.minor})"
            print(f"{name}=={pin}{note}")
            pins.append(f"{name}=={pin}")
        # Their own dependencies resolve as pip chooses; those too old to have wheels for
        # this Python (aiohttp 3.8's multidict < 6) build from source, as pure Python.
        pure = {f"{n}_NO_EXTENSIONS": "1" for n in ("MULTIDICT", "YARL", "FROZENLIST", "AIOHTTP", "PROPCACHE")}
        names = ",".join(pin.split("==")[0] for pin in pins)
        subprocess.run(
            [*pip, "install", "-q", "--prefer-binary", "--only-binary", names, *pins], check=True, env={**os.environ, **pure}
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        got = subprocess.run(
            [python, "-c", "import fastload, fastload.fs; print('import fastload: ok')"], cwd=tmp, env=env
        )
        return got.returncode


if __name__ == "__main__":
    sys.exit(main())

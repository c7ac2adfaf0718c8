"""``make gpu-bundle``: the wheels ``make gpu-check`` needs on a GPU machine with no package registry.

A lent CUDA machine has python3 with a CUDA torch and torchvision, and no
registry to install from; ``import fastload`` needs lz4 and xxhash, which it
lacks. This script downloads, here, the wheels of every runtime dependency of
``import fastload`` (``[project].dependencies`` in pyproject.toml) and of
``scripts/gpu_check.py`` (pytest and pytest-timeout, from the ``test`` extra),
resolved with their own dependencies, for the target's Python version and
platform, into one folder (git ignores it) that must stay under
:data:`LIMIT_BYTES`. On the GPU machine ``scripts/gpu_check.py --wheels DIR``
installs those it lacks into a temporary folder (``pip --no-index --target``)
and puts that on ``sys.path``; a package the machine already has is never
shadowed (its numpy was built with its torch).

fastload itself is not in the bundle: the check tests the checkout it sits in
(``python -m pytest`` puts the checkout first on ``sys.path``, so an installed
copy would be shadowed or, worse, tested instead of the code there), and a
wheel built here would be for this Python, not the target's. Its C extensions
are optional; there the pure-Python fallbacks run, and the report says which
(``fastload.native``).

Defaults: Python 3.12 (the lent H200 machine's python3 is 3.12.3) and
manylinux x86_64 (glibc 2.17 to 2.28 tags; pure-Python wheels match any).

    python scripts/gpu_bundle.py                       # -> .gpu-bundle/
    python scripts/gpu_bundle.py --python 3.11 --out /tmp/b
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # what the device tool carries with a working tree, all paths together
DEFAULT_PYTHON = "3.12"
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CHECK_NEEDS = ("pytest", "pytest-timeout")  # gpu_check's step 1; taken from the test extra with their pins
MANIFEST = "bundle.json"


def _pyproject() -> dict[str, object]:
    try:
        import tomllib
    except ImportError as err:  # Python 3.10
        raise SystemExit(f"gpu_bundle: reading pyproject.toml needs Python 3.11+ here ({err})") from err
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements() -> list[str]:
    """fastload's runtime dependencies and gpu_check's, as pyproject.toml pins them."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    reqs = list(project["dependencies"])
    test = project["optional-dependencies"]["test"]
    for name in CHECK_NEEDS:
        found = [r for r in test if re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0] == name]
        reqs.append(found[0] if found else name)
    return reqs


def build(out: Path, python: str, platforms: tuple[str, ...]) -> dict[str, object]:
    """Download the wheels into ``out`` (emptied of old wheels first) and write its manifest.

    Raises:
        SystemExit: pip failed (no registry, no wheel for the target), or the bundle
            is over :data:`LIMIT_BYTES`.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    reqs = requirements()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(out)]
    for tag in platforms:
        cmd += ["--platform", tag]
    done = subprocess.run([*cmd, *reqs], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpu_bundle: pip download failed for Python {python} on {', '.join(platforms)}:\n"
                         f"{done.stderr.strip()[-2000:]}\nfix: reach a package registry, or pick "
                         "--python/--platform values that have wheels")
    wheels = sorted(out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    if total > LIMIT_BYTES:
        raise SystemExit(f"gpu_bundle: {total / 2**20:.1f} MiB in {out}, over the {LIMIT_BYTES // 2**20} MiB a "
                         "device call carries; fix: drop a dependency the target already has from the bundle")
    manifest: dict[str, object] = {
        "python": python, "platforms": list(platforms), "requirements": reqs,
        "wheels": [w.name for w in wheels], "bytes": total,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle", help="the folder (default: .gpu-bundle)")
    p.add_argument("--python", default=DEFAULT_PYTHON, help=f"target Python X.Y (default {DEFAULT_PYTHON})")
    p.add_argument("--platform", action="append", dest="platforms",
                   help=f"a wheel platform tag, repeatable (default: {', '.join(DEFAULT_PLATFORMS)})")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    manifest = build(args.out, args.python, tuple(args.platforms or DEFAULT_PLATFORMS))
    wheels = manifest["wheels"]
    assert isinstance(wheels, list)
    print(f"gpu_bundle: {len(wheels)} wheels, {int(str(manifest['bytes'])) / 2**20:.1f} MiB, "
          f"for Python {args.python} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))

"""README.md tells a new user what they need: how to reach the `fastload` command
after `make demo` / `make test`, and where the guides are; the guides end cleanly
and cite nothing a clone lacks."""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_says_how_to_get_the_fastload_command() -> None:
    setup = README[README.index("## Set up"):README.index("## Quickstart")]
    venv = re.search(r"^VENV \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert venv is not None
    # The activation path is the venv the Makefile builds, and the alternative installs the package.
    assert f"source {venv[1]}/bin/activate" in setup and "fastload --help" in setup
    assert "pip install -e ." in setup
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    assert scripts.lstrip().startswith('fastload = "fastload.cli:main"')


def test_an_installed_fastload_puts_its_command_beside_the_interpreter() -> None:
    # What the README promises: installed into an environment (make's .venv, or your
    # own with pip install -e .), the command is in that environment's bin folder.
    try:
        dist = metadata.distribution("fastload")
    except metadata.PackageNotFoundError:
        pytest.skip("fastload is not installed in this environment (PYTHONPATH only)")
    assert any(ep.name == "fastload" and ep.group == "console_scripts" for ep in dist.entry_points)
    assert (Path(sys.executable).parent / "fastload").exists()


def test_readme_links_every_guide() -> None:
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", README))
    assert {"docs/storage.md", "docs/egpu.md"} <= linked
    for path in linked:
        assert (ROOT / path).is_file(), path


def _guides() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _guides(), ids=lambda p: p.name)
def test_each_guide_ends_with_one_newline(path: Path) -> None:
    text = path.read_text()
    assert text.endswith("\n") and not text.endswith("\n\n"), path


def test_nothing_cites_a_file_outside_the_repository() -> None:
    # A clean clone has no shared/reference/: cite the original sources instead.
    shipped = [*_guides(), *ROOT.glob("fastload/**/*.py"), *ROOT.glob("benchmarks/**/*.md"),
               *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("examples/*.py"), *ROOT.glob("scripts/*")]
    offenders = [str(p.relative_to(ROOT)) for p in shipped
                 if p.is_file() and re.search(r"shared/reference|\blimits\.md\b", p.read_text(errors="replace"))]
    assert offenders == []


def test_readme_benchmark_figures_match_their_results_file() -> None:
    """Each figure the README quotes is marked with the target it comes from, and equals that target's
    value in the latest peers run (rounded as printed): a rerun that moves a figure must move the README."""
    results = json.loads((ROOT / "benchmarks/peers/results/issue12/results.json").read_text())["targets"]
    text = (ROOT / "README.md").read_text()
    quoted = re.findall(r"<!-- figure: (\S+) -->([\d,.]+)(%|x| ms| JPEGs)", text)
    assert len(quoted) >= 6, quoted
    for name, shown, unit in quoted:
        value = float(results[name]["value"])
        number = float(shown.replace(",", ""))
        if unit == "%":
            assert number == round(100 * value), (name, shown, value)
        elif "," in shown or number >= 1000:
            assert number == round(value), (name, shown, value)
        else:
            assert number == round(value, len(shown.partition(".")[2])), (name, shown, value)

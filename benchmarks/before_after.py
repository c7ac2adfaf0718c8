"""One before/after run of two git refs: cold and warm epochs at 1 Gbit, the ordinary server, reliability.

Issue 25's acceptance asks for these figures "measured in one run before and after".
This script checks out both refs as detached git worktrees under a temp folder (the
built ``fastload/*.so`` copied from this checkout when ``native/`` and ``setup.py`` are
the same as the ref's, else built there with ``setup.py build_ext --inplace``) and runs
each tree's OWN benchmark scripts and tests, with PYTHONPATH set to that tree and the
same settings for both:

* **peers**: ``benchmarks/peers/bench.py --peers fastload --links 1gbit --modes raw``
  (nginx in a network namespace whose loopback carries ``tc tbf rate 1gbit``;
  ``FileDataset`` + ``fastload.DataLoader`` with its defaults; epoch 1 cold, the rest
  warm). Reported: cold samples/s, cold share of the link limit measured in the same
  run, warm samples/s (median of the warm epochs), CPU ms per object cold and warm.
  The JPEGs are generated once (``fastload.samples`` of the first tree that runs) and
  hard-linked into every run, so both trees read the same bytes and no run spends its
  ~1-2 min making them (``--data-dir`` keeps them for the next invocation, reused as
  they are); the rest of the tree's script runs unchanged.
* **ordinary**: ``benchmarks/ordinary_server/bench.py --servers http.server``
  (``fastload cache`` from ``python -m http.server``: listen backlog 5, no Range,
  200 Mbit link): fastload's share of the link's own 20 MB GET, and its MB/s.
* **reliability**: ``pytest tests/reliability -q`` of each tree with that tree's tests
  (``-m "not slow"`` by default, as ``make test``; ``--reliability-marks ''`` runs the
  full variants too): passed / failed / skipped and wall time, once per tree, after the
  benchmarks, so the suite's load cannot skew them.

The benchmark rounds alternate the trees in ABBA order (before, after | after, before |
...), so machine noise and drift hit both alike. Each metric's before and after medians
over every run, and their ratio, are printed as a table and written as JSON to
``--out``; the per-tree min-max spread is the noise estimate. Worktrees, the network
namespaces the child benchmarks made, and any process left in them are removed on exit,
also on an error, Ctrl-C or SIGTERM.

Usage::

    .venv/bin/python benchmarks/before_after.py --before <ref> [--after HEAD] --out /tmp/ba.json \
        [--data-dir /tmp/fastload-before-after-data]
    # fewer figures, faster: --rounds 2 --skip reliability; one part only: --skip peers,ordinary

On the shared 2-core VM the defaults took 5.6 min with a filled ``--data-dir`` and
8-10 min without: making the 3,000 JPEGs ~3 min once, 3 rounds x 2 trees of peers +
ordinary ~17 s each (~1.7 min), the reliability suite 2-3 min per tree. Between rounds
of one tree, cold figures moved ~3-5%, the ordinary server's ~5-10%, and warm
samples/s up to ~40% (a warm epoch is ~0.15 s): read the spread columns.

Only committed trees are compared: ``--after HEAD`` is the last commit, not the working
tree. Needs root for the shaped links; without it the child benchmarks fall back to
unshaped loopback and say so (the table's "links" line).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("peers", "ordinary", "reliability")
# Direction of "better" per metric; metrics not listed here are context (the link, the plain loop).
HIGHER, LOWER = "higher", "lower"
BETTER = {
    "peers.cold_samples_per_s": HIGHER, "peers.cold_link_share": HIGHER, "peers.warm_samples_per_s": HIGHER,
    "peers.cold_cpu_ms_per_object": LOWER, "peers.warm_cpu_ms_per_object": LOWER,
    "ordinary.fastload_link_fraction": HIGHER, "ordinary.fastload_mb_per_s": HIGHER,
    "reliability.passed": HIGHER, "reliability.failed": LOWER, "reliability.wall_s": LOWER,
}
# Counts, not measurements: any change the wrong way is worse, with no spread to forgive it.
EXACT = {"reliability.passed", "reliability.failed"}

# Runs a tree's peers bench.py with make_image_folder / make_uint8_arrays answered from a
# shared folder of hard links: the data is identical for both trees and made once.
_PEERS_DRIVER = r"""
import hashlib, importlib.util, os, shutil, sys
from pathlib import Path
script, store, argv = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
store.mkdir(parents=True, exist_ok=True)
spec = importlib.util.spec_from_file_location("fastload_before_after_peers", script)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)

def _link(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)

def shared(make):
    def made(dest, *args, **kwargs):
        key = hashlib.sha256(repr((make.__name__, args, sorted(kwargs.items()))).encode()).hexdigest()[:16]
        done = store / f"{make.__name__}-{key}"
        if not done.exists():
            tmp = store / f".tmp-{os.getpid()}-{key}"
            shutil.rmtree(tmp, ignore_errors=True)
            make(tmp, *args, **kwargs)
            os.rename(tmp, done)
        shutil.copytree(done, dest, copy_function=_link, dirs_exist_ok=True)
        return sorted(p for p in Path(dest).rglob("*") if p.is_file())
    return made

for name in ("make_image_folder", "make_uint8_arrays"):
    if callable(getattr(mod, name, None)):
        setattr(mod, name, shared(getattr(mod, name)))
sys.exit(mod.main(mod.parse_args(argv)))
"""


def _log(msg: str) -> None:
    print(f"[before_after {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--before", required=True, help="git ref of the 'before' tree")
    p.add_argument("--after", default="HEAD", help="git ref of the 'after' tree")
    p.add_argument("--repo", type=Path, default=ROOT, help="the git repository (its fastload/*.so are copied)")
    p.add_argument("--out", type=Path, help="write the JSON here")
    p.add_argument("--rounds", type=int, default=3, help="benchmark rounds; each runs both trees (ABBA order)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to leave out: {', '.join(PARTS)}")
    p.add_argument("--images", type=int, default=3000, help="JPEGs in the peers dataset (~110 KB each)")
    p.add_argument("--epochs", type=int, default=5, help="peers epochs per run: the first cold, the rest warm "
                   "(a warm epoch of 3,000 JPEGs lasts ~0.2 s, so the median of several)")
    p.add_argument("--peers-repeats", type=int, default=1, help="fastload runs per peers invocation")
    p.add_argument("--link", default="1gbit", help="the peers link (benchmarks/peers/bench.py --links)")
    p.add_argument("--ordinary-repeats", type=int, default=2, help="`fastload cache` runs per ordinary-server invocation")
    p.add_argument("--ordinary-files", type=int, default=300, help="files of the ordinary-server dataset")
    p.add_argument("--ordinary-rate", default="200mbit", help="the ordinary-server link")
    p.add_argument("--reliability-marks", default="not slow", help="pytest -m for the reliability suite ('' for all)")
    p.add_argument("--timeout-s", type=float, default=600, help="limit of one child benchmark or one tree's test suite")
    p.add_argument("--build", action="store_true", help="always build the C extensions in each tree")
    p.add_argument("--netns-prefix", default="flba", help="prefix of the network namespaces the benchmarks make")
    p.add_argument("--data-dir", type=Path, help="where the peers JPEGs are made once and kept for later runs "
                   "(default: inside the temp folder, removed); on the temp folder's file system they are hard-linked")
    p.add_argument("--keep", action="store_true", help="keep the temp folder (worktrees are removed regardless)")
    args = p.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    if args.skip - set(PARTS):
        p.error(f"--skip takes {', '.join(PARTS)}")
    if args.rounds < 1 or args.images < 10 or args.epochs < 2:
        p.error("--rounds must be >= 1, --images >= 10 and --epochs >= 2 (one cold, one warm)")
    return args


# -- pure parts: parsing each child's output, the summary ---------------------------------------


def peers_metrics(res: dict[str, Any]) -> list[dict[str, float]]:
    """One dict of metrics per fastload run in a peers results JSON (failed runs are left out)."""
    limits = {lk["name"]: lk["limit"]["mb_s"] for lk in res.get("links", [])}
    out: list[dict[str, float]] = []
    for run in res.get("all_runs") or res.get("runs", []):
        if run.get("peer") != "fastload" or "error" in run or len(run.get("epochs", [])) < 2:
            continue
        cold, warm = run["epochs"][0], run["epochs"][1:]
        m = {"peers.cold_samples_per_s": cold["samples_per_s"],
             "peers.warm_samples_per_s": statistics.median(e["samples_per_s"] for e in warm)}
        if limits.get(run.get("link")):
            m["peers.cold_link_share"] = cold["mb_s"] / limits[run["link"]]
            if not out:  # the link is measured once per invocation
                m["peers.link_mb_s"] = limits[run["link"]]
        if "cpu_ms_per_sample" in cold:
            m["peers.cold_cpu_ms_per_object"] = cold["cpu_ms_per_sample"]
        cpu = [e["cpu_ms_per_sample"] for e in warm if "cpu_ms_per_sample" in e]
        if cpu:
            m["peers.warm_cpu_ms_per_object"] = statistics.median(cpu)
        out.append(m)
    return out


def ordinary_metrics(res: dict[str, Any]) -> list[dict[str, float]]:
    """One dict of metrics per `fastload cache` run in an ordinary_server results JSON."""
    context = {"ordinary.link_mb_per_s": res.get("link_mb_per_s"),
               "ordinary.plain_link_fraction": res.get("plain_link_fraction")}
    context = {k: v for k, v in context.items() if v is not None}
    runs = [r for r in res.get("fastload", []) if "link_fraction" in r]
    # The context is one figure per invocation, however many fastload runs it made.
    return [(context if i == 0 else {}) | {"ordinary.fastload_link_fraction": r["link_fraction"],
                                           "ordinary.fastload_mb_per_s": r["mb_per_s"]} for i, r in enumerate(runs)]


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")


def pytest_counts(text: str) -> dict[str, int]:
    """passed / failed / skipped / error / ... from pytest's last summary line ("3 passed, 1 skipped in 2.0s")."""
    for line in reversed(text.strip().splitlines()):
        found = _COUNT.findall(line)
        if found and " in " in line:
            counts: dict[str, int] = {}
            for n, word in found:
                key = "error" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


def failed_tests(text: str) -> list[str]:
    """The node ids of pytest's "FAILED ..." / "ERROR ..." summary lines (``-ra``, the project's addopts)."""
    return [ln.split()[1] for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR ")) and len(ln.split()) > 1]


def summarise(samples: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Per metric: each tree's median and min-max over its runs, after/before, and whether after is worse.

    ``samples`` maps tree ("before", "after") to metric to values. ``worse`` is True when the
    metric has a direction and the after median is on the wrong side of the before median by
    more than the larger of the two trees' spreads (relative to the before median), which is
    the noise this run saw; None when it has no direction, or a side has fewer than two values
    (no spread to judge by). Counts (``EXACT``) are worse on any change the wrong way.
    """
    names = list(dict.fromkeys(k for tree in ("before", "after") for k in samples.get(tree, {})))
    rows = []
    for name in names:
        vals = {t: samples.get(t, {}).get(name, []) for t in ("before", "after")}
        med = {t: statistics.median(v) if v else None for t, v in vals.items()}
        b, a = med["before"], med["after"]
        ratio = a / b if a is not None and b else None
        row: dict[str, Any] = {"metric": name, "better": BETTER.get(name, "-"), "before": b, "after": a,
                               "after_over_before": ratio, "runs": {t: len(v) for t, v in vals.items()},
                               "spread": {t: [min(v), max(v)] if v else None for t, v in vals.items()}}
        worse = None
        if name in EXACT and a is not None and b is not None:
            worse = a < b if BETTER[name] == HIGHER else a > b
        elif name in BETTER and a is not None and b is not None and min(len(v) for v in vals.values()) > 1:
            noise = max((max(v) - min(v)) / abs(b) if b else 0.0 for v in vals.values())
            change = (a - b) / abs(b) if b else float(a != b) * (1 if a > b else -1)
            worse = bool(-change > noise) if BETTER[name] == HIGHER else bool(change > noise)
        row["worse"] = worse
        rows.append(row)
    return rows


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if float(v).is_integer() and abs(v) < 100:  # counts
        return str(int(v))
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) >= 1 else f"{v:.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as a markdown table."""
    lines = ["| metric | better | before median (min-max) n | after median (min-max) n | after/before | verdict |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for t in ("before", "after"):
            spread = r["spread"][t]
            rng = f" ({_fmt(spread[0])}-{_fmt(spread[1])})" if spread and r["runs"][t] > 1 else ""
            cells.append(f"{_fmt(r[t])}{rng} {r['runs'][t]}")
        ratio = "-" if r["after_over_before"] is None else f"{r['after_over_before']:.3f}"
        verdict = {True: "WORSE" if r["metric"] in EXACT else "WORSE (beyond the spread)",
                   False: "same or better" if r["metric"] in EXACT else "within the spread, or better",
                   None: "" if r["better"] == "-" else "n/a (a side has one run)"}[r["worse"]]
        lines.append(f"| {r['metric']} | {r['better']} | {cells[0]} | {cells[1]} | {ratio} | {verdict} |")
    return "\n".join(lines)


# -- trees, children, cleanup -------------------------------------------------------------------


@dataclass
class Tree:
    label: str
    ref: str
    commit: str
    path: Path
    extensions: str = ""


@dataclass
class Session:
    """What this run made, so that it can all be removed: worktrees, child processes, namespaces."""

    repo: Path
    netns_prefix: str
    trees: list[Tree] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    live: dict[int, subprocess.Popen[str]] = field(default_factory=dict)

    def git(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(["git", "-C", str(self.repo), *args], capture_output=True, text=True, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int, str, str, float]:
        """Runs a child in its own session (killed with its group on timeout); rc, stdout, stderr, seconds."""
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        self.children.append(proc.pid)
        self.live[proc.pid] = proc
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            out, err = proc.communicate()
            err += f"\n[before_after] timed out after {timeout_s:.0f} s"
        except BaseException:  # Ctrl-C, SIGTERM: the child and what it started go first
            _stop_group(proc)
            raise
        finally:
            self.live.pop(proc.pid, None)
            self.clean_netns()
        return proc.returncode, out, err, time.perf_counter() - t0

    def clean_netns(self) -> list[str]:
        """Deletes namespaces a child of ours made and left (its pid is in the name), and their processes."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False) \
            if shutil.which("ip") else None
        names = [ln.split()[0] for ln in (listed.stdout if listed else "").splitlines() if ln.strip()]
        ours = tuple(f"{p}-{pid}-" for pid in self.children for p in (self.netns_prefix, "flprobe"))
        removed = []
        for name in names:
            if not name.startswith(ours):
                continue
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
            removed.append(name)
        if removed:
            _log(f"removed leftover namespaces {removed}")
        return removed

    def close(self) -> None:
        for proc in list(self.live.values()):
            _stop_group(proc)
        self.clean_netns()
        for tree in self.trees:
            self.git("worktree", "remove", "--force", str(tree.path), check=False)
        self.git("worktree", "prune", check=False)


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the child's process group (the benchmarks clean up on it), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)


def _ext_sources(tree: Path) -> str:
    """A digest of what the C extensions are built from."""
    h = hashlib.sha256()
    for rel in ("setup.py", "native"):
        path = tree / rel
        for f in sorted([path] if path.is_file() else path.rglob("*") if path.is_dir() else []):
            if f.is_file() and f.suffix in {".py", ".c", ".h"}:
                h.update(str(f.relative_to(tree)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def add_tree(session: Session, label: str, ref: str, base: Path, python: str, build: bool) -> Tree:
    """A detached worktree of ``ref`` with working C extensions (copied when the sources match, else built)."""
    commit = session.git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = base / label
    session.git("worktree", "add", "--detach", str(path), commit)
    tree = Tree(label, ref, commit, path)
    session.trees.append(tree)
    built = sorted((session.repo / "fastload").glob("*.so"))
    if built and not build and _ext_sources(path) == _ext_sources(session.repo):
        for so in built:
            shutil.copy2(so, path / "fastload" / so.name)
        tree.extensions = f"copied from {session.repo}/fastload"
    else:
        done = subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"building the extensions of {ref} failed: {done.stderr[-1500:]}")
        tree.extensions = "built in the tree"
    _log(f"{label}: {ref} = {commit[:10]} at {path} (extensions {tree.extensions})")
    return tree


def _env(tree: Tree) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    return env | {"PYTHONPATH": str(tree.path), "PYTHONDONTWRITEBYTECODE": "1"}


def _last_json(text: str) -> dict[str, Any]:
    """The JSON object a benchmark printed last on stdout (indented or one line)."""
    start = text.rfind("\n{")
    start = 0 if text.startswith("{") and start < 0 else start + 1
    return dict(json.loads(text[start:]))


def _tail(text: str, n: int = 1200) -> str:
    return "\n".join(ln for ln in text.strip().splitlines() if ln.strip())[-n:]


# -- the parts ----------------------------------------------------------------------------------


def _run_json(session: Session, tree: Tree, cmd: list[str],
              args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """Run a tree's benchmark: what it reported (wall, rc; an error when it printed no JSON),
    its last JSON document (None then), and its stderr."""
    rc, out, err, wall = session.run(cmd, tree.path, _env(tree), args.timeout_s)
    got: dict[str, Any] = {"wall_s": round(wall, 1), "rc": rc}
    try:
        return got, _last_json(out), err
    except ValueError:
        return got | {"error": f"exited {rc}, no JSON: {_tail(err)}"}, None, err


def run_peers(session: Session, tree: Tree, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    script = tree.path / "benchmarks" / "peers" / "bench.py"
    argv = ["--peers", "fastload", "--links", args.link, "--modes", "raw", "--images", str(args.images),
            "--epochs", str(args.epochs), "--repeats", str(args.peers_repeats), "--peers-python", sys.executable,
            "--netns-prefix", args.netns_prefix, "--work-dir", str(work), "--out", str(work / f"peers-{tree.label}")]
    cmd = [sys.executable, "-c", _PEERS_DRIVER, str(script), str(args.data_dir or work / "data"), *argv]
    got, res, err = _run_json(session, tree, cmd, args)
    shutil.rmtree(work / f"peers-{tree.label}", ignore_errors=True)
    if res is None:
        return got
    got["metrics"] = peers_metrics(res)
    got["fallback"] = res.get("fallback")
    got["links"] = [{"name": lk["name"], "limit_mb_s": lk["limit"]["mb_s"]} for lk in res.get("links", [])]
    got["concurrency"] = [r.get("concurrency") for r in res.get("all_runs") or res.get("runs", [])]
    failed = [r.get("error", "")[-400:] for r in res.get("all_runs") or res.get("runs", []) if "error" in r]
    if failed or not got["metrics"]:
        got["error"] = "; ".join(failed) or f"no fastload run in the results: {_tail(err)}"
    return got


def run_ordinary(session: Session, tree: Tree, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    script = tree.path / "benchmarks" / "ordinary_server" / "bench.py"
    argv = ["--files", str(args.ordinary_files), "--rate", args.ordinary_rate, "--repeats", str(args.ordinary_repeats),
            "--netns-prefix", args.netns_prefix, "--pythonpath", str(tree.path)]
    if "--servers" in script.read_text():  # older trees ran http.server only
        argv += ["--servers", "http.server"]
    got, res, err = _run_json(session, tree, [sys.executable, str(script), *argv], args)
    if res is None:
        return got
    got["metrics"] = ordinary_metrics(res)
    got["link"] = res.get("link")
    got["concurrency"] = [r.get("concurrency") for r in res.get("fastload", [])]
    if not got["metrics"]:
        got["error"] = f"no fastload run in the results: {_tail(err)}"
    return got


def run_reliability(session: Session, tree: Tree, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-p", "no:cacheprovider"]
    cmd += ["-m", args.reliability_marks] if args.reliability_marks else []
    rc, out, err, wall = session.run(cmd, tree.path, _env(tree), args.timeout_s)
    counts = pytest_counts(out)
    got: dict[str, Any] = {"wall_s": round(wall, 1), "rc": rc, "counts": counts, "command": " ".join(cmd[1:]),
                           "failed_tests": failed_tests(out), "tail": _tail(out + err, 2500)}
    got["metrics"] = [{"reliability.passed": counts.get("passed", 0), "reliability.failed": counts.get("failed", 0)
                       + counts.get("error", 0), "reliability.skipped": counts.get("skipped", 0),
                       "reliability.wall_s": round(wall, 1)}] if counts else []
    if not counts:
        got["error"] = f"no pytest summary (exit {rc}): {_tail(out + err)}"
    return got


def plan_order(rounds: int) -> list[str]:
    """ABBA: before, after | after, before | ... so that drift over the run hits both trees alike."""
    return [t for r in range(rounds) for t in (("before", "after") if r % 2 == 0 else ("after", "before"))]


def collect(results: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """tree -> metric -> every run's value, from the parts' results."""
    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for r in results:
        for m in r.get("metrics", []):
            for k, v in m.items():
                samples[r["tree"]].setdefault(k, []).append(float(v))
    return samples


def run(args: argparse.Namespace, session: Session, base: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    trees = {label: add_tree(session, label, ref, base, sys.executable, args.build)
             for label, ref in (("before", args.before), ("after", args.after))}
    res: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "trees": {k: {"ref": t.ref, "commit": t.commit, "extensions": t.extensions} for k, t in trees.items()},
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "loadavg_at_start": os.getloadavg(), "cpus": os.cpu_count(), "runs": [], "parts_s": {},
    }
    work = base / "work"
    work.mkdir()
    if args.data_dir is not None:
        args.data_dir.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[str, Callable[[Tree], dict[str, Any]]]] = []
    if "peers" not in args.skip:
        parts.append(("peers", lambda t: run_peers(session, t, args, work)))
    if "ordinary" not in args.skip:
        parts.append(("ordinary", lambda t: run_ordinary(session, t, args, work)))
    t0 = time.perf_counter()
    for i, label in enumerate(plan_order(args.rounds) if parts else []):
        for part, fn in parts:
            got = fn(trees[label]) | {"part": part, "tree": label, "round": i // 2 + 1}
            res["runs"].append(got)
            values = "; ".join(f"{k.split('.', 1)[1]} {_fmt(v)}" for m in got.get("metrics", [])[:1] for k, v in m.items())
            _log(f"round {i // 2 + 1} {label:<6} {part:<8} {got['wall_s']:>6.1f} s  "
                 + (f"ERROR {got['error'][-300:]}" if "error" in got else values))
    res["parts_s"]["benchmarks"] = round(time.perf_counter() - t0, 1)
    if "reliability" not in args.skip:
        t0 = time.perf_counter()
        for label in ("before", "after"):
            got = run_reliability(session, trees[label], args) | {"part": "reliability", "tree": label, "round": 1}
            res["runs"].append(got)
            _log(f"reliability {label:<6} {got['wall_s']:>6.1f} s  {got['counts'] or got.get('error', '')[-300:]}"
                 + (f"  failed: {got['failed_tests']}" if got["failed_tests"] else ""))
        res["parts_s"]["reliability"] = round(time.perf_counter() - t0, 1)
    res["summary"] = summarise(collect(res["runs"]))
    res["links"] = sorted({f"peers: {lk['name']}" for r in res["runs"] for lk in r.get("links", [])}
                          | {f"ordinary: {r['link']}" for r in res["runs"] if r.get("link")})
    res["fallback"] = sorted({r["fallback"] for r in res["runs"] if r.get("fallback")})
    res["errors"] = [{k: r[k] for k in ("part", "tree", "round", "error")} for r in res["runs"] if "error" in r]
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    res["loadavg_at_end"] = os.getloadavg()
    return res


def report(res: dict[str, Any]) -> str:
    """The table and the lines around it."""
    t = res["trees"]
    lines = [f"before = {t['before']['ref']} ({t['before']['commit'][:10]}), after = {t['after']['ref']} "
             f"({t['after']['commit'][:10]}); {res['date_utc']} UTC, wall {res['wall_s']:.0f} s "
             f"(parts: {res['parts_s']}), load {res['loadavg_at_start']} -> {res['loadavg_at_end']}", "",
             table(res["summary"]), "",
             "links: " + "; ".join(res["links"])]
    if res["fallback"]:
        lines.append("FALLBACK (unshaped): " + "; ".join(res["fallback"]))
    lines += [f"reliability {r['tree']}: {r['counts']}, {r['wall_s']:.0f} s; failed: {', '.join(r['failed_tests'])}"
              for r in res["runs"] if r["part"] == "reliability" and r.get("failed_tests")]
    lines += [f"ERROR {e['part']} {e['tree']} round {e['round']}: {e['error'][-300:]}" for e in res["errors"]]
    return "\n".join(lines)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit, so the cleanup runs as it does on Ctrl-C."""
    previous = {sig: signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
                for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(args: argparse.Namespace) -> int:
    """Runs both trees; table on stderr, JSON on stdout and in ``args.out``. Exit 1 when a part failed."""
    repo = Path(subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--show-toplevel"], capture_output=True,
                               text=True, check=True).stdout.strip())
    base = Path(tempfile.mkdtemp(prefix="fastload-before-after-"))
    session = Session(repo, args.netns_prefix)
    try:
        with _terminate_as_exit():
            res = run(args, session, base)
    finally:
        session.close()
        if args.keep:
            _log(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(res, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    print(report(res), file=sys.stderr)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))

"""``--plot FILE.png`` for diagnose and bench (matplotlib, the ``[diag]`` extra).

Figures are drawn on an Agg canvas without pyplot, so no display and no global
backend switch are needed, and a user's own pyplot state is left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastload.diagnose._util import optional

__all__ = ["plot_bench", "plot_verdict", "require_matplotlib"]

_LIMIT, _OTHER, _OFF = "#d62728", "#1f77b4", "#c7c7c7"


def require_matplotlib() -> None:
    """Fail early, before any probe runs, when ``--plot`` cannot be honoured."""
    optional("matplotlib")


def _figure(rows: int, height: float) -> tuple[Any, Any]:
    optional("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, squeeze=False)[:, 0]


def plot_verdict(verdict: dict[str, Any], path: str | Path) -> Path:
    """Horizontal bars: each op's max samples/s; the limiting op in red."""
    ops = [s for s in verdict["ops"] if s["samples_per_s"]]
    fig, (ax,) = _figure(1, 1.2 + 0.45 * max(1, len(ops)))
    limits = {verdict["cold"]["limit"], verdict["warm"]["limit"]}
    names = [s["label"] + ("" if s["in_path"] else " (not in path)") for s in ops]
    rates = [s["samples_per_s"] for s in ops]
    colors = [(_LIMIT if s["name"] in limits else _OTHER) if s["in_path"] else _OFF for s in ops]
    ax.barh(names, rates, color=colors)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("max samples/s (log scale)")
    ax.set_title(f"fastload diagnose: {verdict['headline'][:90]}", fontsize=9, loc="left")
    for y, r in enumerate(rates):
        ax.text(r, y, f" {r:,.0f}", va="center", fontsize=8)
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def plot_bench(report: dict[str, Any], path: str | Path) -> Path:
    """Top: per-op throughput bars per epoch against the consumer; bottom: consumer wait per batch."""
    runs = report["runs"]
    fig, (bars, timeline) = _figure(2, 7.5)
    width = 0.8 / max(1, len(runs))
    names: list[str] = []
    for run in runs:
        for st in run.get("ops", {}):
            if st not in names:
                names.append(st)
    for k, run in enumerate(runs):
        vals = [run.get("ops", {}).get(n, {}).get("capacity_per_s") or 0.0 for n in names]
        xs = [i + k * width for i in range(len(names))]
        bars.bar(xs, vals, width=width, label=f"{run['loader']} epoch {run['epoch']} ({run['regime']})")
        if run.get("consumer_per_s"):
            bars.axhline(run["consumer_per_s"], color=_LIMIT, linestyle="--", linewidth=1)
    bars.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    bars.set_yscale("log")
    bars.set_ylabel("items/s (busy-time capacity)")
    bars.set_title("per-op throughput; dashed: the simulated step's demand", fontsize=9, loc="left")
    bars.legend(fontsize=7)
    for run in runs:
        waits = run.get("wait_ms_per_batch") or []
        timeline.plot(range(len(waits)), waits, label=f"{run['loader']} epoch {run['epoch']}", linewidth=1)
    timeline.set_xlabel("batch")
    timeline.set_ylabel("consumer wait (ms)")
    timeline.set_title("time the training loop waited for each batch", fontsize=9, loc="left")
    timeline.legend(fontsize=7)
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out

"""Area 8: one DDP rank dies (torchrun, 2 processes, gloo on CPU); the other must not hang."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faults import FAULTS
from helpers import PYTHON, child_env, make_files

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("ddp_die_script.py")
BOUND_S = 90  # torchrun start (two torch imports on 2 cores) + the 30 s collective timeout + slack


@pytest.mark.parametrize("variant", [pytest.param("short", id="short"), pytest.param("full", id="full", marks=pytest.mark.slow)])
def test_surviving_rank_fails_clearly_within_a_bounded_wait(tmp_path: Path, variant: str, record: Callable[..., None]) -> None:
    trials = FAULTS["ddp-rank-dies"].trials_full if variant == "full" else FAULTS["ddp-rank-dies"].trials_short
    make_files(tmp_path / "data", 64, 2000)
    rows = []
    for trial in range(trials):
        out = tmp_path / f"out{trial}"
        out.mkdir()
        args = [str(SCRIPT), str(tmp_path / "data"), str(tmp_path / "cache"), str(out)]
        agent = trial % 2 == 0
        t0 = time.monotonic()
        if agent:
            cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "--max-restarts=0", *args]
            proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=BOUND_S)
            log = proc.stdout + proc.stderr
            assert proc.returncode != 0, log[-3000:]
            # torchrun names the dead rank and its signal.
            assert "local_rank: 1" in log and ("Signal 9 (SIGKILL)" in log or "exitcode  : -9" in log), log[-3000:]
        else:
            # No agent to stop the survivor: gloo itself must notice the dead peer.
            codes, rank0_log = _launch_without_agent(args)
            assert codes[1] == -9, codes  # rank 1 was killed
            # Rank 0 fails by itself: a Python exception from the collective (exit 1), or
            # gloo's own abort from its I/O thread (SIGABRT) with the reason on stderr.
            assert codes[0] in (1, -6), (codes, rank0_log[-3000:])
            if codes[0] == -6:
                assert re.search(r"Connection (closed|reset) by peer|Read error|IoException", rank0_log), rank0_log[-3000:]
        took = time.monotonic() - t0
        if not agent and codes[0] == -6:
            # Aborted from gloo's thread: no report, but the reason, within the bound.
            reason = re.findall(r"(?m)^.*(?:Connection|Read error|IoException).*$", rank0_log)[-1]
            assert took < BOUND_S
            rows.append({"agent": agent, "ended": "gloo abort", "error": _reason(reason), "after_s": None, "wall_s": round(took, 1)})
            continue
        survivor = json.loads((out / "rank0.json").read_text())
        if not agent:
            assert survivor["ended"] == "exception", survivor
        assert survivor["steps"] >= 3
        if survivor["ended"] == "exception":
            # gloo saw the peer's socket close: a clear error, not a wait for the timeout.
            text = survivor["message"].lower()
            assert any(s in text for s in ("connection closed by peer", "connection reset", "broken pipe", "timed out", "timeout")), survivor
        else:
            assert survivor["ended"].startswith("terminated by the torchrun agent"), survivor
        assert survivor["after_s"] < 35, survivor  # bounded by the 30 s collective timeout at worst
        rows.append({"agent": agent, "ended": survivor["ended"], "error": _reason(survivor.get("message", "")),
                     "after_s": survivor["after_s"], "wall_s": round(took, 1)})  # fmt: skip
    record(
        "ddp-rank-dies", trials,
        "pass: " + "; ".join(
            ("torchrun: " if r["agent"] else "no agent: ")
            + (f"rank 0 raised {r['error']!r}" if r["ended"] == "exception"
               else f"rank 0 aborted in gloo: {r['error']!r}" if r["ended"] == "gloo abort"
               else "rank 0 was stopped by torchrun")
            + (f" {r['after_s']:.1f} s after its last step" if r["after_s"] is not None else f" (SIGABRT; run ended after {r['wall_s']:.0f} s)")
            + ("; torchrun exited non-zero naming rank 1 (SIGKILL)" if r["agent"] else "")
            for r in rows
        ),
        rows=rows,
    )  # fmt: skip


def _reason(message: str) -> str:
    """The gist of gloo's message (it starts with a source path and a peer address)."""
    found = re.search(r"Connection (?:reset|closed) by peer|Broken pipe|[Tt]imed? ?out", message)
    return found.group(0) if found else message[:80]


def _launch_without_agent(args: list[str]) -> tuple[list[int], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([PYTHON, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=BOUND_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs[0]

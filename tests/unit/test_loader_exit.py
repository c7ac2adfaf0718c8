"""A loader iterator still alive at interpreter exit ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import fastload
loader = fastload.DataLoader(list(range(10)), batch_size=2, read_ahead=1)
it = iter(loader)
next(it)
plain = iter(fastload.DataLoader(list(range(10)), batch_size=2))
next(plain)
"""


def test_live_iterators_say_nothing_at_interpreter_exit() -> None:
    # Module globals are None by the time the iterators' __del__ runs: it printed
    # "TypeError: isinstance() arg 2 must be a type" to stderr.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""

"""The cache index on an SQLite older than RETURNING (3.35): Debian bullseye has 3.34,
Ubuntu 20.04 3.31, RHEL 8 3.26, and every cold read failed there (issue 32).

The index's own tests run in a child Python whose sqlite3 module loads SQLite 3.28.0
(older than all three but RHEL 8's floor, index.SQLITE_FLOOR) through LD_LIBRARY_PATH:
scripts/build-old-sqlite builds it, and scripts/install-test-deps runs that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # a child pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "build" / "old-sqlite"
VERSION = "3.28.0"
TESTS = ["tests/unit/test_cache_index.py", "tests/unit/test_cache_migrate.py", "tests/unit/test_cache.py"]


def test_the_index_tests_pass_on_sqlite_3_28() -> None:
    if not (LIB / "libsqlite3.so.0").exists():
        reason = f"SQLite {VERSION} is not built; run scripts/build-old-sqlite (scripts/install-test-deps does)"
        if os.environ.get("FASTLOAD_REQUIRE_SERVERS") == "1":
            pytest.fail(f"{reason} (FASTLOAD_REQUIRE_SERVERS=1, so this fails instead of skipping)")
        pytest.skip(reason)
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(LIB), os.environ.get("LD_LIBRARY_PATH")]))}
    env.pop("PYTEST_ADDOPTS", None)
    probe = "import sqlite3; c = sqlite3.connect(':memory:'); c.execute('CREATE TABLE t (k)')\n" \
            "try: c.execute('INSERT INTO t VALUES (1) RETURNING k')\n" \
            "except sqlite3.OperationalError: print(sqlite3.sqlite_version, 'no RETURNING')"  # fmt: skip
    seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert seen.stdout.split() == [VERSION, "no", "RETURNING"], seen.stdout + seen.stderr  # the old library is the one loaded
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " skipped" not in done.stdout and " failed" not in done.stdout, tail

"""A cache folder that cannot be created or opened: each cause is named with its own fix.

Every such failure used to end in "fix: free space there" (issue 24, item 4).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastload.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _info(capsys: pytest.CaptureFixture[str], cache_dir: Path) -> str:
    assert main(["info", "--cache-dir", str(cache_dir)]) == 1
    err = capsys.readouterr().err
    assert "free space" not in err and "full" not in err, err
    return err


def test_a_cache_dir_that_is_a_file_is_named_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cache").write_text("not a folder")
    err = _info(capsys, tmp_path / "cache")
    assert f"cache dir {tmp_path / 'cache'} exists as a file, not a directory; fix: move that file away" in err, err


def test_a_cache_dir_under_a_file_names_that_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("a file")
    err = _info(capsys, tmp_path / "notes.txt" / "sub" / "cache")
    assert f"{tmp_path / 'notes.txt'} is a file, not a directory; fix: give a path under a folder" in err, err


@pytest.fixture()
def locked() -> Iterator[Path]:
    """A folder this test's user (or, as root, the user ``nobody``) may read but not write."""
    with tempfile.TemporaryDirectory(dir="/tmp") as top:  # pytest's tmp_path is 0700: nobody cannot reach it
        os.chmod(top, 0o755)
        folder = Path(top) / "locked"
        folder.mkdir()
        os.chmod(folder, 0o555)
        try:
            yield folder
        finally:
            os.chmod(folder, 0o755)


# Run as a user without write access: root drops to ``nobody`` once fastload is imported, every
# module the command needs included: the interpreter's files and the checkout (a clean clone
# under a 0700 mktemp folder, as CI's) may sit where nobody cannot read them.
_AS_USER = """
import os, sys
import fastload.cli, fastload.read.reader, fastload.cache, fastload.diagnose.cli
if os.geteuid() == 0:
    import pwd
    user = pwd.getpwnam("nobody")
    os.setgroups([]); os.setgid(user.pw_gid); os.setuid(user.pw_uid)
sys.exit(fastload.cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["new", "existing"])
def test_a_folder_this_user_cannot_write_says_permission_denied_for_whom(locked: Path, where: str) -> None:
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("nobody")
        except (ImportError, KeyError):
            pytest.skip("no user 'nobody' to drop to")
    cache_dir = locked / "cache" if where == "new" else locked
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", _AS_USER, "info", "--cache-dir", str(cache_dir)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    user = "nobody" if os.geteuid() == 0 else __import__("pwd").getpwuid(os.geteuid()).pw_name
    assert f"permission denied on {cache_dir}" in done.stderr and f"for user {user}" in done.stderr, done.stderr
    assert f"fix: give {user} write access to it" in done.stderr, done.stderr
    assert "free space" not in done.stderr and "full" not in done.stderr, done.stderr

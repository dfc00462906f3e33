"""Hostile input to recently added paths that read from disk or a store: the private
temporary folders of the Lightning transfers in a shared TMPDIR, ranged reads of objects."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from ckptfmt.engine import commit
from ckptfmt.engine.ckptdir import CheckpointDir


def _dead_pid() -> int:
    return int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
def test_a_dead_processs_folder_of_another_user_is_left(tmp_path: pathlib.Path) -> None:
    """A folder in the shared temporary folder named as a dead process's private folder but
    owned by another user was made by no process of ours: even a process that could remove
    it (root) leaves it and everything in it."""
    from ckptfmt.integrations.lightning import workdirs

    name = f".ckptfmt-upload{commit.TEMP_MARKER}{commit.host_token()}.{_dead_pid()}.0.0123abcd"
    theirs = tmp_path / name
    theirs.mkdir()
    (theirs / "their-file").write_bytes(b"y")
    os.chown(theirs, 65534, 65534)
    ours = tmp_path / name.replace("0123abcd", "4567cdef")
    ours.mkdir()
    with CheckpointDir.open(tmp_path) as d:
        assert workdirs.remove_abandoned(d) == [ours.name]
    assert (theirs / "their-file").read_bytes() == b"y"

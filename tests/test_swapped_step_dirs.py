"""A run directory's step swapped for a link while the manager works in it: another process
exchanges the newest complete step directory with a symbolic link to a directory outside the
run (renameat2 RENAME_EXCHANGE, in a loop) while incremental saves read that step's state
file as their base.  Nothing outside the run is ever opened: the base is opened beneath the
step directory being written, by its reference path, without following a link."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import platform
import shutil
import struct
import time
import warnings

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64", reason="renameat2 by syscall number"
)

SYS_RENAMEAT2 = 316  # Linux x86_64
RENAME_EXCHANGE = 2
AT_FDCWD = -100
IN_OPEN, IN_ACCESS = 0x20, 0x01


def _exchange_until(a: str, b: str, stop: float) -> None:
    """Swap the entries `a` and `b` (a directory and a link) back and forth until `stop`."""
    libc = ctypes.CDLL(None, use_errno=True)
    while time.time() < stop:
        libc.syscall(SYS_RENAMEAT2, AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE)


def _opened(data: bytes) -> list[str]:
    """The names in a batch of inotify events."""
    out, off = [], 0
    while off + 16 <= len(data):
        _, _, _, n = struct.unpack_from("iIII", data, off)
        out.append(data[off + 16 : off + 16 + n].rstrip(b"\0").decode())
        off += 16 + n
    return out


def test_an_incremental_base_swapped_for_a_link_is_never_read_through_it(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    m = ckptfmt.CheckpointManager(run, incremental=True)
    frozen = torch.arange(1 << 16, dtype=torch.float32)
    m.save(1, {"frozen": frozen, "step": 1})
    m.save(2, {"frozen": frozen, "step": 2})
    step2 = run / "step-000000002"
    shutil.copytree(step2, outside)  # a readable copy: following the link would succeed
    link = tmp_path / "swap"
    os.symlink(outside, link)
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert watch >= 0 and libc.inotify_add_watch(watch, str(outside).encode(), IN_OPEN | IN_ACCESS) >= 0
    seen: list[str] = []
    swapper = multiprocessing.get_context("fork").Process(
        target=_exchange_until, args=(str(step2), str(link), time.time() + 60)
    )
    swapper.start()
    try:
        saved = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and saved < 10:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    m.save(3, {"frozen": frozen, "step": 3})  # its base: step 2, newest
                    m.remove(3)
                    saved += 1
                except (CheckpointError, OSError):
                    pass  # a step found swapped is refused: what matters is what was opened
            try:
                seen += _opened(os.read(watch, 65536))
            except BlockingIOError:
                pass
            if seen:
                break
    finally:
        swapper.kill()
        swapper.join()
        os.close(watch)
    if os.path.islink(step2):  # left swapped: put the step back
        os.rename(step2, tmp_path / "gone")
        os.rename(link, step2)
    assert seen == [], f"opened outside the run: {seen}"
    assert saved > 0
    assert sorted(os.listdir(outside)) == sorted(os.listdir(step2))
    assert torch.equal(m.load(2)["frozen"], frozen)

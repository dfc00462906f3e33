"""Names of other processes' temporaries: nothing a foreign name says may stop our own saves.

A temp file's name carries its owner (spec section 10), a temporary step directory's its
creator's pid (section 13.4).  A pid outside 1..2**31-1 (0, or more digits than a pid_t
holds) names no process, so its owner is gone: the file is abandoned like any other whose
owner died, and a save goes on.  Absurd start times likewise only say "not that process".
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptfmt
from ckptfmt.engine import commit
from ckptfmt.runs.manager import CheckpointManager
from ckptfmt.runs.steps import step_dirname

ABSURD_PIDS = ["0", "2147483648", "4294967296", "9999999999"]
#: longer than any pid: only the temporary step directories' names allow so many digits
HUGE_PID = "9" * 200


def _temp_file(directory, owner: str, target: str = "x.ckpt") -> str:
    path = os.path.join(directory, f".{target}{commit.TEMP_MARKER}{owner}.0badcafe")
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    return path


@pytest.mark.parametrize("pid", ABSURD_PIDS)
@pytest.mark.parametrize("start", ["0", "1", "99999999999999999999"])
def test_a_temp_file_of_an_absurd_pid_here_is_abandoned_and_saves_go_on(tmp_path, pid, start):
    temp = _temp_file(tmp_path, f"{commit.host_token()}.{pid}.{start}")
    assert commit.parse_temp_name(os.path.basename(temp)) is not None  # it has the form of step 1
    ckptfmt.save({"t": torch.ones(3)}, tmp_path / "a.ckpt")
    assert ckptfmt.load(tmp_path / "a.ckpt")["t"].tolist() == [1.0, 1.0, 1.0]
    assert not os.path.exists(temp)  # no process has that pid: its owner is gone


@pytest.mark.parametrize("pid", ABSURD_PIDS)
def test_a_temp_file_of_an_absurd_pid_elsewhere_goes_only_once_old(tmp_path, pid):
    other = "00000000deadbeef" if commit.host_token() != "00000000deadbeef" else "00000000feedface"
    temp = _temp_file(tmp_path, f"{other}.{pid}.0")
    ckptfmt.save({"t": torch.ones(3)}, tmp_path / "a.ckpt")
    assert os.path.exists(temp)  # another host's: only its age can tell
    os.utime(temp, (1.0, 1.0))
    ckptfmt.save({"t": torch.zeros(3)}, tmp_path / "a.ckpt")
    assert not os.path.exists(temp)


def test_this_hosts_live_pid_with_an_absurd_start_is_not_that_process(tmp_path):
    temp = _temp_file(tmp_path, f"{commit.host_token()}.{os.getppid()}.99999999999999999999")
    ckptfmt.save({"t": torch.ones(1)}, tmp_path / "a.ckpt")
    assert not os.path.exists(temp)


@pytest.mark.parametrize("pid", [*ABSURD_PIDS, HUGE_PID])
def test_a_temporary_step_directory_of_an_absurd_pid_does_not_stop_saves(tmp_path, pid):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.ones(2)})
    leftover = tmp_path / f".{step_dirname(2)}.ckptfmt-tmp.{pid}.0badcafe"
    leftover.mkdir()
    mgr.save(3, {"w": torch.full((2,), 3.0)})
    mgr.save(4, {"w": torch.full((2,), 4.0)})
    assert mgr.latest().step == 4
    assert mgr.load()["w"].tolist() == [4.0, 4.0]
    assert not leftover.exists()  # unlocked, and no process has that pid: abandoned

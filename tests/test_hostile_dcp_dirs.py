"""Hostile DCP checkpoint directories: a sharded save or load never touches anything outside
the checkpoint directory (issue 20, spec/FORMAT.md 13.1 and 13.6).

* a save opens its directory once and writes, unlinks and lists beneath that descriptor: a
  directory swapped for a link during the save (a manager's step directory included) never
  leads the save into the link's target;
* a manager's sharded step is opened beneath its run directory without following a link, and
  the step's record, rank files and chunks are read beneath that descriptor;
* a rank file that reads chunks from a file its commit record does not name is refused by
  load, consolidate, verify and ls alike.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.cli import main as cli
from ckptfmt.dcp import check as dcp_check
from ckptfmt.dcp import storage
from ckptfmt.dcp.api import save_within
from ckptfmt.engine.ckptdir import CheckpointDir, LinkError
from ckptfmt.errors import CheckpointError, CorruptError
from ckptfmt.files import incremental, multifile
from ckptfmt.runs import sharded

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _victim(root: Path) -> tuple[Path, dict[str, bytes]]:
    """A directory outside the checkpoint holding files a save must never write or delete."""
    victim = root / "victim"
    victim.mkdir()
    files = {"COMMIT": b"victim's commit", "rank-00007.ckpt": b"victim's rank file"}
    for name, data in files.items():
        (victim / name).write_bytes(data)
    return victim, files


def _unchanged(victim: Path, files: dict[str, bytes]) -> None:
    assert sorted(os.listdir(victim)) == sorted(files)
    for name, data in files.items():
        assert (victim / name).read_bytes() == data


# -- saving (F7) ------------------------------------------------------------------------------------


def test_a_save_keeps_writing_beneath_the_directory_it_opened(tmp_path: Path, monkeypatch: Any) -> None:
    """The directory is swapped for a link to another after the save opened it (between planning
    and writing): the rank file, the commit record and the clean-up stay in the opened directory."""
    victim, files = _victim(tmp_path)
    ck = tmp_path / "ck"
    write_data = storage.Writer.write_data

    def swapping(self: storage.Writer, plan: Any, planner: Any) -> Any:
        os.rename(ck, tmp_path / "ck.away")
        os.symlink(victim, ck)
        return write_data(self, plan, planner)

    monkeypatch.setattr(storage.Writer, "write_data", swapping)
    cdcp.save({"w": torch.arange(8.0)}, str(ck))
    _unchanged(victim, files)
    away = tmp_path / "ck.away"
    assert sorted(os.listdir(away)) == ["COMMIT", "rank-00000.ckpt"]
    back = {"w": torch.zeros(8)}
    cdcp.load(back, str(away))
    assert torch.equal(back["w"], torch.arange(8.0))


def test_a_save_within_a_held_directory_never_follows_its_path(tmp_path: Path) -> None:
    """A manager's step: the save writes beneath the descriptor it is given (rank 0's held step
    directory), whatever the path now names; other ranks open the step beneath the run
    directory and refuse a link there."""
    victim, files = _victim(tmp_path)
    step = tmp_path / "run" / "step-000000001"
    step.mkdir(parents=True)
    with CheckpointDir.open(step) as held:
        os.rename(step, str(step) + ".held")
        os.symlink(victim, step)
        save_within({"w": torch.ones(4)}, str(step), step=1, within=held, step_dir=True)
    _unchanged(victim, files)
    assert multifile.check_complete(str(step) + ".held").step == 1
    with pytest.raises(CheckpointError, match="symbolic link"):
        save_within({"w": torch.ones(4)}, str(step), step=1, step_dir=True)
    _unchanged(victim, files)


MANAGER_SAVE = textwrap.dedent(
    """
    import gc, os, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    import ckptfmt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    run, victim, store = sys.argv[1:4]
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    made = ckptfmt.CheckpointManager._make_step_dir
    def swapped(self, step, *args):
        path, fd = made(self, step, *args)
        os.rename(path, path + ".held")
        os.symlink(victim, path)
        return path, fd
    ckptfmt.CheckpointManager._make_step_dir = swapped
    m = ckptfmt.CheckpointManager(run)
    try:
        m.save(1, {"w": distribute_tensor(torch.ones(4), mesh, [Replicate()])})
    except ckptfmt.CheckpointError as e:
        print("refused:", e)
    print("held:", sorted(os.listdir(os.path.join(run, "step-000000001.held"))))
    gc.collect()  # free what holds the groups (FSDP modules are cycles) before they go
    dist.destroy_process_group()
    """
)


def test_a_sharded_manager_save_writes_beneath_the_step_directory_it_holds(tmp_path: Path) -> None:
    """World size 1 with a DTensor: the manager saves through DCP.  Its step directory is
    swapped for a link right after it was made and locked: the save writes into the directory
    it holds, never into (or deletes from) the link's target."""
    victim, files = _victim(tmp_path)
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-c", MANAGER_SAVE, str(run), str(victim), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    _unchanged(victim, files)
    assert "held: ['.ckptfmt-folder', 'COMMIT', 'rank-00000.ckpt']" in p.stdout, p.stdout + p.stderr


# -- loading a manager's sharded step (F6) ----------------------------------------------------------


def _dcp_run(tmp_path: Path) -> tuple[Path, Path, ckptfmt.CheckpointManager]:
    """A run whose step 2 is a DCP step, and a DCP checkpoint of step 2 outside the run."""
    run = tmp_path / "run"
    m = ckptfmt.CheckpointManager(str(run))
    m.save(1, {"w": torch.ones(2)})
    cdcp.save({"state": {"w": torch.tensor([1.0])}, "rng": {}}, str(run / "step-000000002"), step=2)
    outside = tmp_path / "outside" / "step-000000002"
    cdcp.save({"state": {"w": torch.tensor([42.0])}, "rng": {}}, str(outside), step=2)
    return run, outside, ckptfmt.CheckpointManager(str(run))


def test_a_sharded_step_swapped_for_a_link_after_the_manager_checked_it_is_never_read(tmp_path: Path) -> None:
    run, outside, m = _dcp_run(tmp_path)
    info = m.latest()
    assert info is not None and (info.step, info.layout) == (2, "dcp")
    assert torch.equal(sharded.load_step(info)["w"], torch.tensor([1.0]))
    step = run / "step-000000002"
    os.rename(step, str(step) + ".away")
    os.symlink(outside, step)
    with pytest.raises(LinkError):
        sharded.load_step(info)
    state = {"w": torch.zeros(1)}
    with pytest.raises(LinkError):
        sharded.load_step_into(info, state, False)
    assert torch.equal(state["w"], torch.zeros(1))


def test_a_sharded_step_whose_record_is_another_steps_is_refused(tmp_path: Path) -> None:
    run, _, m = _dcp_run(tmp_path)
    info = m.latest()
    assert info is not None
    cdcp.save({"state": {"w": torch.tensor([3.0])}, "rng": {}}, str(run / "step-000000002"), step=3)
    with pytest.raises(CorruptError, match="not step 2"):
        sharded.load_step(info)


# -- chunks from a file the record does not name (F10) ----------------------------------------------


def test_a_rank_file_reading_chunks_from_an_unnamed_file_is_refused_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    cdcp.save({"w": torch.arange(8.0)}, str(ck))
    rank = ck / "rank-00000.ckpt"
    secret = tmp_path / "secret.ckpt"
    incremental.save({0: torch.full((8,), 42.0)}, str(secret))
    incremental.save({0: torch.full((8,), 42.0)}, str(rank), base=str(secret))  # chunks in ../secret.ckpt
    record = multifile.read_commit(str(ck))
    files = tuple(
        multifile.describe_part(str(rank), p.name) if p.name == rank.name else p for p in record.files
    )
    multifile.write_commit(str(ck), dataclasses.replace(record, files=files))

    with pytest.raises(CorruptError, match="does not name"):
        cdcp.load({"w": torch.zeros(8)}, str(ck))
    with pytest.raises(CorruptError, match="does not name"):
        cdcp.consolidate(str(ck), str(tmp_path / "out.ckpt"))
    assert not (tmp_path / "out.ckpt").exists()
    problems = dcp_check.verify_directory(str(ck))
    assert problems and "does not name" in str(problems[0])
    info = cdcp.describe(str(ck))
    assert not info["complete"] and "does not name" in info["problem"]
    assert [f["status"] for f in info["files"]] == ["damaged"]
    assert cli(["verify", str(ck)]) == 1
    capsys.readouterr()

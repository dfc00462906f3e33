"""Folders and files another tool left where ckptfmt cleans up: a CheckpointManager run
directory, Lightning's ``dirpath``, the temporary folder.  ckptfmt deletes only what it can
prove it wrote (a valid commit record, its mark ``.ckptfmt-folder``, its own temporary
names); whatever else is there survives every save, rotation and clean-up unchanged."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import tempfile
import warnings
from typing import Any

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.engine.ckptdir import CheckpointDir
from ckptfmt.runs.steps import step_dirname


def _tiny(value: int) -> dict[str, Any]:
    return {"w": torch.full((3,), float(value)), "n": value}


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _foreign(where: pathlib.Path) -> dict[str, bytes]:
    """A folder another tool made, with a file and a subfolder; its contents."""
    (where / "sub").mkdir(parents=True)
    (where / "notes.txt").write_bytes(b"not ckptfmt's\n")
    (where / "sub" / "state.ckpt").write_bytes(b"another tool's bytes")
    return _tree(where)


# -- the CheckpointManager's run directory --------------------------------------------------------


def test_manager_never_deletes_a_step_folder_it_did_not_make(tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(run, keep_last=1)
    mgr.save(1, _tiny(1))
    foreign = _foreign(run / step_dirname(2))
    (run / step_dirname(3)).mkdir()  # empty: removing it loses nothing
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mgr.save(4, _tiny(4))
        mgr.save(5, _tiny(5))
        assert mgr.latest().step == 5
    assert sorted(os.listdir(run)) == [step_dirname(2), step_dirname(5)]
    assert _tree(run / step_dirname(2)) == foreign
    assert any("ckptfmt did not make this folder" in str(w.message) for w in said)


def test_manager_refuses_a_save_whose_step_folder_is_not_its_own(tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(run)
    mgr.save(1, _tiny(1))
    foreign = _foreign(run / step_dirname(2))
    with pytest.raises(ckptfmt.UnsupportedError, match="ckptfmt did not make"):
        mgr.save(2, _tiny(2))
    assert _tree(run / step_dirname(2)) == foreign


def test_manager_still_removes_its_own_cut_short_folders(tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(run)
    mgr.save(1, _tiny(1))
    mgr.save(2, _tiny(2))
    os.unlink(run / step_dirname(2) / "COMMIT")  # as a save killed before its commit record
    assert (run / step_dirname(2) / ".ckptfmt-folder").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)
        mgr.save(3, _tiny(3))
    assert sorted(os.listdir(run)) == [step_dirname(1), step_dirname(3)]


# -- Lightning's dirpath --------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs ckptfmt[lightning]")
def test_lightning_dirpath_keeps_what_another_tool_left(tmp_path: pathlib.Path) -> None:
    import lightning.pytorch as pl
    from test_lightning import _fit_net

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    dirpath = tmp_path / "ckpts"
    foreign = _foreign(dirpath / "old-run")
    torch.save({"state_dict": {}}, dirpath / "epoch=0-step=1.ckpt")  # an earlier run's, untracked
    (dirpath / "notes.txt").write_bytes(b"mine\n")
    before = _tree(dirpath)
    _fit_net(pl, CkptfmtCheckpointIO(blocking=False), str(dirpath), epochs=3)
    after = _tree(dirpath)
    assert {k: after.get(k) for k in before} == before
    assert _tree(dirpath / "old-run") == foreign


# -- the temporary folder -------------------------------------------------------------------------


def test_temporary_folder_clean_up_touches_only_its_own_names(tmp_path: pathlib.Path) -> None:
    from ckptfmt.integrations.lightning import workdirs

    for name in ("ckptfmt-upload", "ckptfmt-download.1234", ".ckptfmt-upload.tmp", "pytest-of-someone"):
        _foreign(tmp_path / name)
    before = _tree(tmp_path)
    with CheckpointDir.open(tmp_path) as d:
        assert workdirs.remove_abandoned(d) == []
    assert _tree(tmp_path) == before
    assert os.path.isdir(tempfile.gettempdir())

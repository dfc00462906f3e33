"""CkptfmtTrainer's end of training with save_total_limit=1 and load_best_model_at_end, when
the best checkpoint folder is no longer complete (a file of it damaged after its save): the
Trainer keeps only the best folder, and ckptfmt removes its own folders that are not complete,
so keeping "the best" alone would leave the run no checkpoint at all.  The newest complete
folder must be kept then."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_trainer_rules import _folders, _trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from ckptfmt.integrations.transformers import CkptfmtTrainer, latest_checkpoint  # noqa: E402


class _DamageTheBest(TrainerCallback):
    """Cut the best folder's optimizer file in half at the last step (before its save)."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.best: str | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.last:
            self.best = state.best_model_checkpoint
            assert self.best is not None
            path = os.path.join(self.best, "optimizer.ckpt")
            os.truncate(path, os.path.getsize(path) // 2)


def test_a_damaged_best_folder_does_not_cost_the_newest_complete_one(tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    damage = _DamageTheBest(last=6)
    # the highest eval loss is the best: step 1's, so the best is never the newest folder
    trainer = _trainer(
        CkptfmtTrainer, out, save_total_limit=1, load_best_model_at_end=True, greater_is_better=True
    )
    trainer.add_callback(damage)
    trainer.train()
    assert damage.best == os.path.join(out, "checkpoint-1")
    newest = latest_checkpoint(out, warn=False)
    assert newest == os.path.join(out, "checkpoint-6"), _folders(out)


def test_a_complete_best_folder_is_the_only_one_left(tmp_path: Any) -> None:
    """The Trainer's rule otherwise: with save_total_limit=1 only the best folder stays."""
    out = str(tmp_path / "run")
    trainer = _trainer(
        CkptfmtTrainer, out, save_total_limit=1, load_best_model_at_end=True, greater_is_better=True
    )
    trainer.train()
    assert _folders(out) == ["checkpoint-1"]
    assert latest_checkpoint(out, warn=False) == os.path.join(out, "checkpoint-1")


def test_a_folder_being_saved_is_busy_from_its_creation_until_its_commit_thread_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-blocking save's folder is never counted by another commit thread's rotation: it is
    busy from the moment the folder has its name (before the Trainer writes into it) and while
    its commit thread is made but not yet started.  Busy is checked at both instants."""
    from ckptfmt.integrations.transformers import trainer as trainer_module

    out = str(tmp_path / "run")
    t = _trainer(CkptfmtTrainer, out, max_steps=3, save_steps=1, ckptfmt={"ckptfmt_blocking": False})
    made, started = trainer_module.fresh_folder, trainer_module.threading.Thread.start
    seen: list[tuple[str, str, bool]] = []

    def fresh_folder(run_dir: str, name: str) -> Any:
        folder = made(run_dir, name)
        seen.append(("named", name, os.path.join(run_dir, name) in t._ckptfmt_busy()))
        return folder

    def start(thread: Any) -> None:
        if thread.name.startswith("ckptfmt-commit-"):
            name = thread.name[len("ckptfmt-commit-") :]
            seen.append(("thread", name, os.path.join(out, name) in t._ckptfmt_busy()))
        started(thread)

    monkeypatch.setattr(trainer_module, "fresh_folder", fresh_folder)
    monkeypatch.setattr(trainer_module.threading.Thread, "start", start)
    t.train()
    t.wait_for_checkpoints()
    assert [s[:2] for s in seen if s[0] == "named"] == [("named", f"checkpoint-{i}") for i in (1, 2, 3)]
    assert len([s for s in seen if s[0] == "thread"]) == 3
    assert all(busy for _, _, busy in seen), seen
    assert _folders(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]

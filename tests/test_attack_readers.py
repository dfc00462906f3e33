"""Attacks on the readers added last: DCP saves against a base (the base step's record and rank
files), the archive tier's copy markers on a store, the Trainer folders' mark, and the JSON
sidecars read back.  Each defect found was first a strict xfail naming it, and lost its marker
with its fix; the cases that held from the start are here too, where they are cheap."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from cli_runner import run_cli

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.errors import CheckpointError, CorruptError, LimitError
from ckptfmt.files import incremental, multifile
from ckptfmt.runs.objectnames import COPY_MARKER
from ckptfmt.runs.objectrun import ObjectRun
from ckptfmt.storage import listing

FROZEN = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: chunks a save against a base refers to


def _state(n: int, frozen: torch.Tensor = FROZEN) -> dict[str, object]:
    return {"frozen": frozen.clone(), "lora": torch.full((100,), float(n)), "n": n}


def _loaded(path: str) -> dict[str, object]:
    target: dict[str, object] = {"frozen": torch.zeros(1 << 18), "lora": torch.zeros(100), "n": 0}
    cdcp.load(target, path)
    return target


def _assert_loads(path: str, n: int, frozen: torch.Tensor = FROZEN) -> None:
    got = _loaded(path)
    assert torch.equal(got["frozen"], frozen)  # type: ignore[arg-type]
    assert torch.equal(got["lora"], torch.full((100,), float(n)))  # type: ignore[arg-type]
    assert got["n"] == n


# -- 1. DCP saves against a base -----------------------------------------------------------------


def test_a_save_against_its_own_directory_is_refused_before_the_base_is_touched(tmp_path):
    """base= the directory being saved (or a link to it) cannot be honoured: the coordinator
    withdraws the directory's record (prepare_global_plan) before any rank reads it as the base
    (_base_file).  It must be refused before anything is touched, and the checkpoint there stay
    one; today the save fails with "no commit record" and says "earlier checkpoints are
    untouched" while the base's record is gone."""
    d1 = tmp_path / "d1"
    cdcp.save(_state(1), str(d1), incremental=True)
    alias = tmp_path / "alias"
    alias.symlink_to(d1, target_is_directory=True)
    for base in (d1, alias):
        with pytest.raises((ValueError, CheckpointError)):
            cdcp.save(_state(2), str(d1), base=str(base))
        multifile.check_complete(str(d1))  # still a checkpoint ...
        _assert_loads(str(d1), 1)  # ... and the one saved first


def test_a_base_saved_again_during_the_save_fails_the_save_not_the_load(tmp_path, monkeypatch):
    """Another job saves the base directory again after this save indexed the base's chunks (the
    window between ContentIndex and the rank's commit).  The new rank file refers to the old base
    file (its file id); the rank then describes whatever the reference path holds now (the new
    base file) and the coordinator writes that into the record.  The save returns, COMMIT is
    there, and every load and ``ckptfmt verify`` fails.  The save must fail instead (or write
    every chunk); it must not commit a step that cannot be read."""
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    cdcp.save(_state(1), str(d1), incremental=True)
    indexed = incremental.ContentIndex._add_base

    def index_then_resave(self, target, base):
        indexed(self, target, base)
        # base is saved afresh (other bytes) by another job once this save has read it
        cdcp.save(_state(9, FROZEN + 1), str(d1), incremental=True)

    monkeypatch.setattr(incremental.ContentIndex, "_add_base", index_then_resave)
    try:
        cdcp.save(_state(2), str(d2), base=str(d1))
    except CheckpointError:  # refused (what a fix may do): then no record may be left
        assert not (d2 / "COMMIT").exists()
        return
    _assert_loads(str(d2), 2)
    assert run_cli("verify", d2).returncode == 0


def test_a_base_rank_file_swapped_for_a_link_fails_the_save_naming_it(tmp_path):
    """Holds: a base rank file that is a symbolic link (to a good ckptfmt file elsewhere) is
    never followed; the save fails with a LinkError naming it, and writes no record."""
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    cdcp.save(_state(1), str(d1), incremental=True)
    (d1 / "rank-00000.ckpt").rename(tmp_path / "elsewhere.ckpt")
    (d1 / "rank-00000.ckpt").symlink_to(tmp_path / "elsewhere.ckpt")
    with pytest.raises(CorruptError, match="d1/rank-00000.ckpt: a symbolic link"):
        cdcp.save(_state(2), str(d2), base=str(d1))
    assert not (d2 / "COMMIT").exists()


def test_an_encrypted_base_read_with_another_key_fails_the_save(tmp_path):
    """Holds: the base is read with the save's key; one encrypted under another key is a
    DecryptionError naming the base's rank file, and no record is written."""
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    cdcp.save(_state(1), str(d1), incremental=True, encrypt_with=bytes(range(32)))
    with pytest.raises(ckptfmt.DecryptionError, match="d1/rank-00000.ckpt"):
        cdcp.save(_state(2), str(d2), base=str(d1), encrypt_with=bytes(range(1, 33)))
    assert not (d2 / "COMMIT").exists()


def test_a_base_whose_own_references_were_saved_over_is_not_referred_through(tmp_path):
    """Holds: d1 was saved against d0, then d0 was saved again (other bytes): d1's references no
    longer hold what it recorded.  A save against d1 refers to none of those chunks (they are
    written), and the new step loads the right values and verifies."""
    d0, d1, d2 = tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"
    cdcp.save(_state(0), str(d0), incremental=True)
    cdcp.save(_state(1), str(d1), base=str(d0))
    assert [p.name for p in multifile.read_commit(str(d1)).references] == ["../d0/rank-00000.ckpt"]
    cdcp.save(_state(5, FROZEN + 3), str(d0), incremental=True)
    cdcp.save(_state(2), str(d2), base=str(d1))
    assert multifile.check_complete(str(d2)).references == ()
    _assert_loads(str(d2), 2)
    assert run_cli("verify", d2).returncode == 0


def test_a_base_that_is_not_a_dcp_checkpoint_is_not_silently_ignored(tmp_path):
    """A base given that no rank file can be saved against (a CheckpointManager step: layout
    "state", its one file state.ckpt) cannot be honoured: Writer._base_file finds no file of the
    rank's name and the save writes every chunk without a word.  incremental.save warns for a base
    it cannot refer to (CheckpointWarning); an option that cannot be honoured is never silently
    ignored."""
    m = ckptfmt.CheckpointManager(tmp_path / "run", incremental=True)
    m.save(1, {"frozen": FROZEN.clone(), "n": 1})
    step = m.latest().path
    assert multifile.read_commit(step).layout == "state"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            cdcp.save({"frozen": FROZEN.clone(), "n": 2}, str(tmp_path / "d2"), base=step)
        except CheckpointError:
            return  # refused: also honest
    assert any(issubclass(w.category, ckptfmt.CheckpointWarning) for w in said), [
        str(w.message) for w in said
    ]


# -- 2. the archive tier's copy markers ----------------------------------------------------------


def _dead_marker() -> str:
    """A copy marker of a process of this host that has ended (its writer provably gone)."""
    from ckptfmt.engine import commit

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return f"{COPY_MARKER}{commit.host_token()}.{gone.pid}.0.0badcafe"


def test_removing_an_interrupted_copy_leaves_another_programs_objects(s3_bucket):
    """Spec 13.7: a prefix is shared with other writers; only objects whose names ckptfmt writes
    in a checkpoint's prefix are deleted, anything else there is left (delete_step and cleanup
    keep to it).  An archive copy that died leaves its marker and a partial state.ckpt in
    step-5; an evaluation job wrote its results beneath the same step prefix.  An archive pass
    removes the interrupted copy once the prefix's objects are older than its bound (here 0;
    younger, they may be a live saver's): state.ckpt and the marker, never the evaluation's
    objects."""
    bucket, options = s3_bucket
    from s3_server import s3_client

    c = s3_client(options["endpoint_url"])
    dead = _dead_marker()
    ours = [f"step-000000005/{dead}", "step-000000005/state.ckpt"]
    theirs = ["step-000000005/eval/metrics.json", "step-000000005/notes.txt", "step-000000005/COMMIT.bak"]
    for key in ours + theirs:
        c.put_object(Bucket=bucket, Key=f"run/{key}", Body=b"x")
    run = ObjectRun(f"s3://{bucket}/run", options)
    run.remove_interrupted_copies(older_than=datetime.timedelta(0))
    left = set(listing.objects(run.url, options))
    assert not left & set(ours)
    assert left == set(theirs)


def test_a_step_saved_again_after_a_rollback_is_never_taken_for_its_older_archived_copy(tmp_path, s3_bucket):
    """The documented way back to an earlier step (ValueError of a save that is not newer: "remove
    the later ones first"): remove(4) locally, then save 3, 4, 5 again.  The archive still holds
    the first save of step 4 (archive_keep_every=2).  The archiver decides by step number
    (Archiver.keeps_locally, _next): the new step 4 is "held", so it is neither copied nor kept
    locally, keep_last=1 deletes it at step 5, and ``load(step=4)`` reads the first timeline's
    step 4 from the archive, silently.  The new step 4 must reach the archive, or stay on local
    disk with a failure saying the archive holds another save of it (put_step's own check)."""
    bucket, options = s3_bucket

    def state(step: int, timeline: int) -> dict[str, object]:
        return {"w": torch.full((1000,), float(10 * step + timeline)), "step": step}

    m = ckptfmt.CheckpointManager(
        tmp_path / "run",
        archive=f"s3://{bucket}/run",
        storage_options=options,
        keep_last=1,
        archive_keep_last=1,
        archive_keep_every=2,
    )
    for step in (1, 2, 3, 4):
        m.save(step, state(step, 0))
    m.wait()
    assert [c.step for c in ObjectRun(f"s3://{bucket}/run", options).checkpoints()] == [2, 4]
    for c in m.checkpoints():  # back to step 2: the later ones go first
        if c.step > 2:
            m.remove(c.step)
    for step in (3, 4, 5):
        m.save(step, state(step, 1))
    m.wait()
    assert m.load(step=4)["w"][0].item() == 41.0  # the second save of step 4, not the first (40)


def test_a_removed_step_is_not_resumed_from_the_archive(tmp_path, s3_bucket):
    """remove(step) is how a run goes back to an earlier step (the ValueError of a save that is
    not newer says so).  In a tiered run it deletes the local step only; the archive still holds
    it and, being newer than the local tier's newest, latest() and load() return it: the step
    removed is the one resumed.  remove must remove (or retire) the archived copy too, or refuse
    saying that the archive holds it."""
    bucket, options = s3_bucket
    m = ckptfmt.CheckpointManager(
        tmp_path / "run", archive=f"s3://{bucket}/run", storage_options=options, keep_last=2
    )
    for step in (1, 2, 3, 4):
        m.save(step, {"w": torch.full((10,), float(step)), "step": step})
    m.wait()
    try:
        m.remove(4)
    except CheckpointError:
        return  # refused, saying why: honest
    assert m.latest().step == 3
    assert m.load()["step"] == 3


def test_an_archive_pass_reads_each_commit_record_at_most_once(tmp_path, s3_faults):
    """A store whose listing names many commit records (junk ones here; an archive kept by
    archive_keep_every over a long run has as many real ones) must not make every save's
    archive pass read each of them again: statuses() is bounded (MAX_STATUS_RECORDS, spec
    13.7), and a record listed unchanged (create-only: same size, same time) is known from the
    last read, refused ones included.  Here: 15 junk records; the first save's pass reads each
    once, the second save's reads none of them again."""
    bucket, options = s3_faults.new_bucket(), s3_faults.storage_options()
    junk = 15
    c = s3_faults.client()
    for i in range(junk):
        c.put_object(Bucket=bucket, Key=f"run/step-{10**6 + i:09d}/COMMIT", Body=b"not a record")
    m = ckptfmt.CheckpointManager(
        tmp_path / "run", archive=f"s3://{bucket}/run", storage_options=options, keep_last=1
    )
    s3_faults.clear_counts()
    m.save(1, {"w": torch.zeros(10), "step": 1})
    m.wait()
    first = s3_faults.count("GET", "/COMMIT")
    s3_faults.clear_counts()
    m.save(2, {"w": torch.ones(10), "step": 2})
    m.wait()
    second = s3_faults.count("GET", "/COMMIT")
    assert [c.step for c in ObjectRun(f"s3://{bucket}/run", options).checkpoints()] == [1, 2]
    assert first >= junk and second <= 8, f"GETs of commit records: {first}, then {second}"


# -- 3. the Trainer's checkpoint-N folders ---------------------------------------------------------


def _scored_trainer(out: str, max_steps: int, score: float, limit: int | None = None) -> Any:
    """A CkptfmtTrainer saving and evaluating every 2 steps, keeping the best model by a fixed
    `score` (the same at every evaluation: a later run never beats an earlier one's)."""
    from trainer_helpers import Tokens, tiny_gpt2
    from transformers import TrainingArguments

    from ckptfmt.integrations.transformers import CkptfmtTrainer

    args = TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="score",
        greater_is_better=True,
        save_total_limit=limit,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=1,
        dataloader_num_workers=0,
    )
    tokens = Tokens(n=8, length=8, vocab=32, seed=5)
    return CkptfmtTrainer(
        model=tiny_gpt2(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=1),
        args=args,
        train_dataset=tokens,
        eval_dataset=tokens,
        compute_metrics=lambda _: {"score": score},
    )


def test_a_link_named_like_the_mark_proves_nothing(tmp_path):
    """Holds: a folder whose ``.ckptfmt-folder`` is a symbolic link (to a real mark elsewhere) is
    not ckptfmt's: rotation and clean-up leave it, its files and the link's target unchanged."""
    from ckptfmt.engine.marks import MARK_NAME
    from ckptfmt.runs.steps import step_dirname

    run = tmp_path / "run"
    m = ckptfmt.CheckpointManager(run, keep_last=1)
    m.save(1, {"w": torch.zeros(3), "step": 1})
    mark = tmp_path / "elsewhere" / MARK_NAME
    mark.parent.mkdir()
    mark.write_text(json.dumps({"writer": "ckptfmt"}) + "\n")
    folder = run / step_dirname(2)
    folder.mkdir()
    (folder / "notes.txt").write_bytes(b"a person's notes\n")
    (folder / MARK_NAME).symlink_to(mark)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)  # "did not make this folder"
        for step in (3, 4):
            m.save(step, {"w": torch.zeros(3), "step": step})
    assert sorted(os.listdir(folder)) == [MARK_NAME, "notes.txt"]
    assert (folder / MARK_NAME).is_symlink() and mark.read_text().startswith("{")
    assert [c.step for c in m.checkpoints()] == [4]


def test_an_empty_file_named_like_the_mark_proves_nothing(tmp_path):
    """The mark is "the proof that a folder without a valid commit record is ckptfmt's to
    delete" (engine/marks.py), and ckptfmt writes it as JSON naming its writer.  is_marked looks
    only at the entry's type: a regular file of that name, even empty, makes a folder of a
    person's files ckptfmt's, and the CheckpointManager's clean-up (as the Trainer's rotation,
    through the same marks) deletes it whole.  At least the content ckptfmt writes (bounded,
    JSON with a known writer) should be required."""
    from ckptfmt.engine.marks import MARK_NAME
    from ckptfmt.runs.steps import step_dirname

    run = tmp_path / "run"
    m = ckptfmt.CheckpointManager(run, keep_last=1)
    m.save(1, {"w": torch.zeros(3), "step": 1})
    folder = run / step_dirname(2)
    folder.mkdir()
    (folder / "notes.txt").write_bytes(b"a person's notes\n")
    (folder / MARK_NAME).write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)
        for step in (3, 4):
            m.save(step, {"w": torch.zeros(3), "step": step})
    assert (folder / "notes.txt").read_bytes() == b"a person's notes\n"


def test_a_best_checkpoint_in_another_run_never_empties_this_run(tmp_path):
    """Fine-tuning goes on from another run's folder: its trainer state names that run's
    checkpoint-2 as the best (best_metric 1.0, which this run never beats).  At the end of
    training with save_total_limit=1, writing.keep_only_best keeps the folder of this run named
    like the best one (there is none) and deletes every other: this run is left with no
    checkpoint at all.  (The stock Trainer does the same: no folder of this run is samefile with
    the other run's.)  rotate() always keeps the newest complete folder; keep_only_best must too,
    and keep nothing by name when the best is not this run's."""
    pytest.importorskip("transformers")
    first, second = tmp_path / "first", tmp_path / "second"
    _scored_trainer(str(first), 2, 1.0).train()
    trainer = _scored_trainer(str(second), 4, 0.5, limit=1)
    trainer.train(resume_from_checkpoint=str(first / "checkpoint-2"))
    assert trainer.state.best_model_checkpoint == str(first / "checkpoint-2")  # the other run's, kept
    assert "checkpoint-4" in os.listdir(second)  # this run's final checkpoint survives


# -- 4. the JSON sidecars read back ---------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 200_000 + b"]" * 200_000,  # nesting deeper than the decoder's recursion
        b'{"a":' * 200_000 + b"1" + b"}" * 200_000,
        b'{"a": ' + b"9" * 100_000 + b"}",  # an integer past int_max_str_digits
        b'{"a": "\xff"}',  # not UTF-8
        b"[1, 2]",  # JSON, not an object
    ],
    ids=["deep-array", "deep-object", "huge-int", "not-utf8", "not-an-object"],
)
def test_hostile_training_args_json_is_a_corrupt_error(tmp_path, raw):
    """Holds: load_training_args turns every hostile training_args.json into a CorruptError
    naming the folder, at once (no RecursionError, ValueError or UnicodeDecodeError escapes)."""
    from ckptfmt.integrations.transformers import load_training_args

    (tmp_path / "training_args.json").write_bytes(raw)
    with pytest.raises(CorruptError, match="training_args.json"):
        load_training_args(str(tmp_path))


def test_training_args_json_is_read_bounded_and_never_through_a_fifo(tmp_path):
    """Holds: a file past the bound is a LimitError before it is decoded; a FIFO in its place is
    refused without waiting for a writer."""
    from ckptfmt.integrations.transformers import load_training_args
    from ckptfmt.integrations.transformers.names import MAX_JSON_BYTES

    path = tmp_path / "training_args.json"
    with open(path, "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk written
    with pytest.raises(LimitError, match="training_args.json"):
        load_training_args(str(tmp_path))
    os.unlink(path)
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_training_args(str(tmp_path))

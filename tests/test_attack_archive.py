"""Attacks on the archive copy (runs/archivecopy.py, runs/archiver.py) and the cleanup of a run
on a store (runs/objectrun.py), through the fault proxy in front of a real local S3 server:
a copy cut at every one of its requests and then finished by a new archiver, two archivers
copying one step at once, a record that names what is not its run's.  Each must leave every
step whole, nothing another writer's record names deleted, and nothing stray once a copy
completes."""

from __future__ import annotations

import datetime
import threading
import time
import warnings

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointWarning
from ckptfmt.runs import archivecopy
from ckptfmt.runs.archiver import Archiver
from ckptfmt.runs.objectnames import copy_marker
from ckptfmt.runs.objectrun import ObjectRun


def _local_run(tmp_path, steps: int = 1) -> ckptfmt.CheckpointManager:
    m = ckptfmt.CheckpointManager(tmp_path / "local", keep_last=10)
    for step in range(1, steps + 1):
        m.save(step, {"w": torch.full((5000,), float(step)), "step": step})
    return m


def _archiver(run: ObjectRun, local: ckptfmt.CheckpointManager) -> Archiver:
    return Archiver(run, keep_last=None, keep_every=None, local_steps=local.checkpoints)


def _pass(archiver: Archiver) -> None:
    """One archive pass, waited for; its failures are warnings (the archiver's way)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        archiver.kick()
        archiver.wait(timeout=120)


def _step_keys(run: ObjectRun, step: int) -> set[str]:
    return {name for name in run.listing().get(step, {})}


def _assert_whole_and_clean(run: ObjectRun, step: int, value: float) -> None:
    """Step `step` complete in `run`, verified, holding `value`; its prefix holding exactly its
    record's files and the record (no stray copy, no marker)."""
    infos = {c.step: c for c in run.checkpoints()}
    assert step in infos, run.statuses()
    record = run.record(step)
    assert _step_keys(run, step) == {p.name for p in record.files} | {"COMMIT"}
    assert run.verify_step(infos[step]).ok
    state = ckptfmt.load(infos[step].files[0], storage_options=run.options)
    assert torch.equal(state["state"]["w"], torch.full((5000,), value))


def _wait_until(condition, failure: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


class _OnThread:
    """`action()` run on a thread of its own; join() raises what it raised."""

    def __init__(self, action) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(action,))
        self.thread.start()

    def _run(self, action) -> None:
        try:
            action()
        except BaseException as e:
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error


def _incremental_steps(tmp_path, s3_faults):
    """(a run on a fresh bucket behind the proxy, local steps 1 and 2): step 2 reads the frozen
    tensor's chunks from step 1's state.ckpt."""
    local = ckptfmt.CheckpointManager(tmp_path / "local", keep_last=10, incremental=True)
    for step in (1, 2):
        local.save(step, {"frozen": torch.arange(1 << 16, dtype=torch.float32), "step": step})
    first, second = local.checkpoints()
    assert second.references
    return ObjectRun(f"s3://{s3_faults.new_bucket()}/run", s3_faults.storage_options()), first, second


def _put_leftover(s3_faults, run: ObjectRun, first) -> None:
    """Step 1's prefix in `run` given a leftover state.ckpt: the very file local step 2 refers to
    (what a dead copy of step 1 left)."""
    with open(f"{first.path}/state.ckpt", "rb") as f:
        s3_faults.client().put_object(
            Bucket=run.url.bucket, Key="run/step-000000001/state.ckpt", Body=f.read()
        )


def _assert_step_2_loads(run: ObjectRun) -> None:
    statuses = {s.step: s for s in run.statuses()}
    assert statuses[2].info is not None, statuses[2]
    assert ckptfmt.load(statuses[2].info.files[0], storage_options=run.options)["state"]["step"] == 2


def _copy_with_record_held(
    run: ObjectRun, local_step: str, s3_faults, meanwhile, step: int = 1
) -> list[BaseException]:
    """Copy step `step` (local directory `local_step`) into `run` on a thread, its commit
    record's PUT held at the proxy while `meanwhile()` runs; the copy's errors."""
    record = f"/step-{step:09d}/COMMIT"
    held = s3_faults.hold("PUT", record)
    copy = _OnThread(lambda: archivecopy.put_step(run, step, local_step, claim=copy_marker()))
    try:  # every file is up
        _wait_until(lambda: s3_faults.count("PUT", record), "the copy never reached its commit record")
        meanwhile()
    finally:
        held.set()
        copy.thread.join(60)
    assert copy.done()
    return [] if copy.error is None else [copy.error]


@pytest.mark.parametrize("answered", [False, True], ids=["lost-request", "lost-answer"])
def test_a_copy_cut_at_any_request_is_finished_whole_by_the_next_archiver(tmp_path, s3_faults, answered):
    """The first archiver's copy fails at its n-th request (n = 1, 2, ...: the connection reset
    before the request reaches the store, or after the store carried it out); a second
    archiver (the next process) then archives the step whole, and leaves nothing else."""
    local = _local_run(tmp_path)
    options = s3_faults.storage_options() | {"max_attempts": 1}
    n = 0
    while True:
        n += 1
        bucket = s3_faults.new_bucket()
        run = ObjectRun(f"s3://{bucket}/run", options)
        s3_faults.clear_rules()
        s3_faults.reset_on(None, f"/{bucket}", nth=n, answered=answered)
        _pass(_archiver(run, local))
        fired = s3_faults.pending_rules() == 0
        s3_faults.clear_rules()
        _pass(_archiver(run, local))
        _assert_whole_and_clean(run, 1, 1.0)
        if not fired:  # the copy made fewer than n requests: every one was cut once
            break
    assert n > 5  # a copy is a marker, a listing, uploads, their checks, a record, ...


def test_two_archivers_copying_one_step_at_once_leave_one_whole_copy(tmp_path, s3_faults):
    """Archiver A's commit record is held while archiver B copies the same step whole (under
    names of its own) and commits; A's record then finds B's there: A withdraws what it
    uploaded, B's files stay, and the next pass leaves the prefix holding B's copy alone."""
    local = _local_run(tmp_path)
    options = s3_faults.storage_options()
    bucket = s3_faults.new_bucket()
    run = ObjectRun(f"s3://{bucket}/run", options)
    info = local.checkpoints()[-1]
    failed = _copy_with_record_held(  # A, while B copies and commits
        run, info.path, s3_faults, lambda: archivecopy.put_step(run, 1, info.path, claim=copy_marker() + ".b")
    )
    record = run.record(1)
    # A's create-only record was refused: B's is the step's; A withdrew nothing B's record names
    assert [type(e).__name__ for e in failed] == ["ObjectExistsError"], failed
    _pass(_archiver(run, local))  # the next pass removes the markers of copies that ended
    _assert_whole_and_clean(run, 1, 1.0)
    assert run.record(1) == record


def test_a_copy_under_names_of_its_own_reads_the_later_records_again_for_its_sweep(tmp_path, s3_faults):
    """Step 1's prefix holds a leftover state.ckpt: the copy writes under names of its own,
    reading what later steps' records refer to in the step (a listing of the run) to see
    which leftover it may use; once committed, its sweep reads them again after its marker
    is in (a copy may have adopted the leftover since and be gone), and removes the leftover."""
    local = _local_run(tmp_path)
    bucket = s3_faults.new_bucket()
    run = ObjectRun(f"s3://{bucket}/run", s3_faults.storage_options())
    s3_faults.client().put_object(Bucket=bucket, Key="run/step-000000001/state.ckpt", Body=b"a dead copy's")
    s3_faults.clear_counts()
    archivecopy.put_step(run, 1, local.checkpoints()[-1].path, claim=copy_marker())
    assert s3_faults.count("GET", "prefix=run%2F&") == 2
    _assert_whole_and_clean(run, 1, 1.0)


@pytest.mark.parametrize("target", [2, 1], ids=["a-later-step", "its-own-step"])
def test_a_record_referring_to_a_step_not_before_its_own_is_damaged(s3_bucket, target):
    """References lead to earlier steps only (an incremental step's base was committed before
    it), which cleanup relies on (a step's objects are read only by later steps' records): a
    record of step 1 naming an object of step 2 (or of step 1 itself) is a CorruptError, its
    step damaged, never complete."""
    import dataclasses

    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    m = ckptfmt.CheckpointManager(url, incremental=True, storage_options=options)
    for step in (1, 2):
        m.save(step, {"w": torch.full((5000,), float(step)), "step": step})
    first, target_part = m.run.record(1), m.run.record(target).files[0]
    ref = dataclasses.replace(target_part, name=f"../step-00000000{target}/{target_part.name}")
    forward = dataclasses.replace(first, references=(ref,))
    m.run.retire_step(1)  # its record alone goes; its files stay
    m.run.step_place(1).write_record(forward)
    status = {s.step: s for s in ObjectRun(url, options).statuses()}[1]
    assert status.info is None and status.damaged and "not an earlier step" in status.problem, status
    with pytest.raises(ckptfmt.CorruptError, match=f"refers to step {target}, not an earlier step"):
        ObjectRun(url, options).record(1)


def test_a_cleaner_running_during_a_copy_deletes_nothing_of_it(tmp_path, s3_faults):
    """ObjectRun.cleanup (a store run's manager's) with a bound of 0 s runs while an archive
    copy's commit record is held: the copy's live marker keeps its files, so the record it
    then commits names objects that are there (the local tier drops a step once archived:
    a record naming deleted files would lose the step in both tiers)."""
    import datetime

    local = _local_run(tmp_path)
    bucket = s3_faults.new_bucket()
    run = ObjectRun(f"s3://{bucket}/run", s3_faults.storage_options())
    info = local.checkpoints()[-1]
    cleaner = ObjectRun(f"s3://{bucket}/run", s3_faults.storage_options())
    failed = _copy_with_record_held(run, info.path, s3_faults, lambda: cleaner.cleanup(datetime.timedelta(0)))
    assert not failed, failed
    _assert_whole_and_clean(run, 1, 1.0)


@pytest.mark.parametrize("sweeper", ["archive-pass", "step-1-copy"])
def test_an_object_a_copy_adopts_in_an_earlier_step_is_kept_while_the_copy_runs(tmp_path, s3_faults, sweeper):
    """Step 1's prefix holds a leftover state.ckpt (a dead copy's: the very file the local
    step 2 refers to).  Step 2's copy adopts it as its reference; while its record is held,
    step 1 is swept: by an archive pass removing what dead copies left beside step 1's
    record (archived under names of its own), or by step 1's own copy committing under names
    of its own.  The adopted object must stay, or step 2 commits a reference to nothing (and
    is then dropped locally as archived: lost in both tiers)."""
    run, first, second = _incremental_steps(tmp_path, s3_faults)
    bucket = run.url.bucket
    if sweeper == "archive-pass":
        s3_faults.client().put_object(Bucket=bucket, Key="run/step-000000001/junk.bin", Body=b"x")
        archivecopy.put_step(run, 1, first.path, claim=copy_marker())  # under names of its own
        assert [p.name for p in run.record(1).files] != ["state.ckpt"]
        _put_leftover(s3_faults, run, first)
        dead = f"run/step-000000001/{copy_marker()}"  # this process's, never claimed: dead
        s3_faults.client().put_object(Bucket=bucket, Key=dead, Body=b"")

        def meanwhile() -> None:
            run.remove_interrupted_copies()
    else:
        _put_leftover(s3_faults, run, first)

        def meanwhile() -> None:
            archivecopy.put_step(run, 1, first.path, claim=copy_marker())

    failed = _copy_with_record_held(run, second.path, s3_faults, meanwhile, step=2)
    assert not failed, failed
    _assert_step_2_loads(run)
    if sweeper == "archive-pass":  # another program's object in the prefix is never swept
        assert "junk.bin" in run.listing()[1]


def _foreign_marker() -> str:
    """A copy marker as an archiver on another host writes it (owned_suffix: its host token,
    pid, start time, 8 random hex digits): only its age can be asked of it here."""
    from ckptfmt.runs.objectnames import COPY_MARKER

    return f"{COPY_MARKER}{'f' * 16}.4242.77.0badcafe"


def test_another_hosts_sweep_marker_is_dead_past_the_sweeps_bound():
    """A sweep on another host killed mid-way leaves its marker: copies wait for it (and
    cleanups keep away) only while such a sweep could still delete (SWEEP_WAIT), not for
    STALE_AFTER as for a copy's marker (every copy referring to the step would wait)."""
    import datetime

    from ckptfmt.runs.objectnames import COPY_MARKER, SWEEP_MARKER, SWEEP_WAIT, marker_dead

    now = datetime.datetime.now(datetime.timezone.utc)
    suffix = _foreign_marker()[len(COPY_MARKER) :]
    young, old = (now - datetime.timedelta(seconds=SWEEP_WAIT + d) for d in (-60, 60))
    assert not marker_dead(SWEEP_MARKER + suffix, young, datetime.timedelta(0), now)
    assert marker_dead(SWEEP_MARKER + suffix, old, datetime.timedelta(0), now)
    assert not marker_dead(COPY_MARKER + suffix, old, datetime.timedelta(0), now)


def test_a_cleaner_with_a_short_bound_keeps_a_copy_under_way_on_another_host(s3_bucket):
    """Another host's archiver is copying step 1 (its marker and a file are up, its record yet
    to come), both older than the cleaner's bound of 0 s but far younger than STALE_AFTER:
    the caller's bound judges leftovers, never another host's marker, so cleanup keeps the
    step's files (deleting them would make that copy commit a record naming nothing)."""
    import datetime

    bucket, options = s3_bucket
    from s3_server import s3_client

    c = s3_client(options["endpoint_url"])
    for name in (_foreign_marker(), "state.ckpt"):
        c.put_object(Bucket=bucket, Key=f"run/step-000000001/{name}", Body=b"x")
    time.sleep(1.1)  # older than the bound by the store's clock, whatever its resolution
    ObjectRun(f"s3://{bucket}/run", options).cleanup(datetime.timedelta(0))
    assert _step_keys(ObjectRun(f"s3://{bucket}/run", options), 1) == {_foreign_marker(), "state.ckpt"}


@pytest.mark.parametrize("newcomer", [False, True], ids=["short-bound", "marker-came-since-listing"])
def test_dead_copies_markers_stay_until_what_they_left_is_swept(tmp_path, s3_bucket, newcomer):
    """Complete step 1 holds a leftover of an ended copy (state.<hex>.ckpt, which its record
    does not name) and a copy marker.  remove_interrupted_copies sweeps the leftover before it
    deletes the markers, or leaves both: a marker gone with the leftover still there would
    leave it unsweepable for ever.  short-bound: another host's fresh marker and a bound of
    0 s (live by STALE_AFTER, as the sweep judges it); marker-came-since-listing: a dead
    marker of this host in the listing gone by, and another host's live one put after it."""
    import datetime

    from ckptfmt.engine import commit
    from ckptfmt.runs.objectnames import COPY_MARKER

    bucket, options = s3_bucket
    from s3_server import s3_client

    c = s3_client(options["endpoint_url"])
    run = ObjectRun(f"s3://{bucket}/run", options)
    archivecopy.put_step(run, 1, _local_run(tmp_path).checkpoints()[-1].path, claim=copy_marker())
    leftover = "state.0123456789abcdef.ckpt"
    c.put_object(Bucket=bucket, Key=f"run/step-000000001/{leftover}", Body=b"x")
    if newcomer:
        dead = f"{COPY_MARKER}{commit.owner_token()}.0badcafe"  # this process's, never claimed
        c.put_object(Bucket=bucket, Key=f"run/step-000000001/{dead}", Body=b"")
        found = run.listing()
        c.put_object(Bucket=bucket, Key=f"run/step-000000001/{_foreign_marker()}", Body=b"")
        run.remove_interrupted_copies(found=found)
        markers = {dead, _foreign_marker()}
    else:
        c.put_object(Bucket=bucket, Key=f"run/step-000000001/{_foreign_marker()}", Body=b"")
        time.sleep(1.1)  # older than the bound by the store's clock
        run.remove_interrupted_copies(datetime.timedelta(0))
        markers = {_foreign_marker()}
    assert _step_keys(run, 1) == {p.name for p in run.record(1).files} | {"COMMIT", leftover} | markers


def test_a_copy_waits_out_a_sweep_stalled_before_its_delete(tmp_path, s3_faults):
    """Step 1's prefix holds a leftover state.ckpt (the very file local step 2 refers to).
    Step 1's copy commits under names of its own and sweeps; its DELETE of the leftover is
    held: the sweep stalled between its last listing and its DELETE.  Step 2's copy, whose
    marker that listing did not show, finds the sweep's marker and waits for its end (it
    lists step 1's prefix again and again) before it looks for the object; the DELETE
    lands, the copy uploads the object again and commits.  Step 2 must end complete and
    loadable (else a reference to nothing, and the local step dropped as archived: lost in
    both tiers), however long the sweep stalls."""
    run, first, second = _incremental_steps(tmp_path, s3_faults)
    _put_leftover(s3_faults, run, first)
    leftover = "/step-000000001/state.ckpt"
    delete_held = s3_faults.hold("DELETE", leftover)
    sweeper = _OnThread(lambda: archivecopy.put_step(run, 1, first.path, claim=copy_marker()))
    try:
        _wait_until(lambda: s3_faults.count("DELETE", leftover), "step 1's sweep never deleted the leftover")
        s3_faults.clear_counts()
        copier = _OnThread(lambda: archivecopy.put_step(run, 2, second.path, claim=copy_marker()))
        _wait_until(  # step 2's copy done, or waiting for the sweep (listing its prefix again)
            lambda: copier.done() or s3_faults.count("GET", "prefix=run%2Fstep-000000001%2F") >= 2,
            "step 2's copy neither finished nor waited",
        )
    finally:
        delete_held.set()
        sweeper.join()
    copier.join()
    _assert_step_2_loads(run)
    assert s3_faults.count("GET", "prefix=run%2Fstep-000000001%2F") >= 2  # it waited


def test_a_sweep_deletes_nothing_where_a_copy_put_its_marker_before_the_sweeps_last_listing(
    tmp_path, s3_faults
):
    """Step 1 is committed (under names of its own) beside a leftover state.ckpt, the very file
    local step 2 refers to.  A sweep of step 1 lists its prefix (no live marker) and its PUT
    of its own marker is held; meanwhile step 2's copy puts its marker into step 1's prefix,
    finds no sweep there and adopts the leftover, its record held.  The sweep lists the
    prefix again once its marker is in: a live copy's marker, so nothing is deleted (no
    DELETE at all, not only an object uploaded again afterwards), and its marker goes."""
    run, first, second = _incremental_steps(tmp_path, s3_faults)
    s3_faults.client().put_object(Bucket=run.url.bucket, Key="run/step-000000001/junk.bin", Body=b"x")
    archivecopy.put_step(run, 1, first.path, claim=copy_marker())  # under names of its own
    _put_leftover(s3_faults, run, first)
    marker = "/step-000000001/SWEEPING."
    held = s3_faults.hold("PUT", marker)
    s3_faults.clear_counts()
    record = run.record(1)
    swept: list[bool] = []
    sweeper = _OnThread(lambda: swept.append(run.sweep_step(1, record)))
    try:
        _wait_until(lambda: s3_faults.count("PUT", marker), "the sweep never put its marker")

        def sweep_goes_on() -> None:
            held.set()
            sweeper.join()

        failed = _copy_with_record_held(run, second.path, s3_faults, sweep_goes_on, step=2)
    finally:
        held.set()
        sweeper.join()
    assert not failed, failed
    assert swept == [False]
    assert s3_faults.count("DELETE", "/step-000000001/state.ckpt") == 0
    assert not [n for n in _step_keys(run, 1) if n.startswith("SWEEPING.")]
    _assert_step_2_loads(run)


def test_a_sweep_reads_the_later_records_after_its_marker_not_before(tmp_path, s3_faults):
    """A copies step 1 beside a leftover state.ckpt (names of its own, later records read at
    its preparation); its sweep's marker PUT is held.  Meanwhile B copies step 2, adopting the
    leftover in step 1 and committing; a cleaner (remove_interrupted_copies) sweeps step 1
    (keeping the leftover) and deletes B's dead marker.  A's sweep then lists no copy marker:
    it must read the later records again (step 2's now refers to the leftover), not go by
    its read from before, and keep the leftover."""
    run, first, second = _incremental_steps(tmp_path, s3_faults)
    _put_leftover(s3_faults, run, first)
    marker = "/step-000000001/SWEEPING."
    held = s3_faults.hold("PUT", marker)
    a = _OnThread(lambda: archivecopy.put_step(run, 1, first.path, claim=copy_marker()))
    try:
        _wait_until(lambda: s3_faults.count("PUT", marker), "A's sweep never put its marker")
        archivecopy.put_step(run, 2, second.path, claim=copy_marker() + ".b")
        run.remove_interrupted_copies()
        assert "state.ckpt" in _step_keys(run, 1) and not any("ARCHIVING." in n for n in _step_keys(run, 1))
    finally:
        held.set()
        a.join()
    _assert_step_2_loads(run)


def _committed_beside_leftovers(tmp_path, s3_faults) -> ObjectRun:
    """A run (behind the proxy) whose step 1 is committed under names of its own (a state.ckpt
    was there) beside two leftovers of dead copies, state.000...1.ckpt and state.000...2.ckpt."""
    local = _local_run(tmp_path)
    run = ObjectRun(f"s3://{s3_faults.new_bucket()}/run", s3_faults.storage_options())
    s3_faults.client().put_object(Bucket=run.url.bucket, Key="run/step-000000001/state.ckpt", Body=b"x")
    archivecopy.put_step(run, 1, local.checkpoints()[-1].path, claim=copy_marker())  # names of its own
    for name in ("state.0000000000000001.ckpt", "state.0000000000000002.ckpt"):
        s3_faults.client().put_object(Bucket=run.url.bucket, Key=f"run/step-000000001/{name}", Body=b"x")
    return run


def _sweep_cut_short(tmp_path, s3_faults, monkeypatch) -> tuple[ObjectRun, list[bool]]:
    """Step 1 committed under names of its own beside two leftovers of dead copies, then swept;
    the sweep's first DELETE is held while its clock (objectrun's monotonic) moves on to within
    one DELETE's deadline of SWEEP_DELETES_WITHIN.  (The run, what sweep_step returned.)"""
    import types

    from ckptfmt.runs import objectnames, objectrun
    from ckptfmt.storage.client import deadline

    run = _committed_beside_leftovers(tmp_path, s3_faults)
    skew = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + skew[0], sleep=time.sleep)
    monkeypatch.setattr(objectrun, "time", clock)
    s3_faults.clear_counts()
    held = s3_faults.hold("DELETE", "/step-000000001/state.000")
    swept: list[bool] = []
    sweeper = _OnThread(lambda: swept.append(run.sweep_step(1, run.record(1))))
    try:
        _wait_until(lambda: s3_faults.count("DELETE", "/step-000000001/state.000"), "the sweep never deleted")
        delete_deadline = deadline(objectnames.sweep_options(run.options))
        skew[0] = objectnames.SWEEP_DELETES_WITHIN - delete_deadline + 1
    finally:
        held.set()
        sweeper.join()
    monkeypatch.setattr(objectrun, "time", time)
    return run, swept


def test_a_sweep_sends_no_delete_that_could_end_past_its_bound(tmp_path, s3_faults, monkeypatch):
    """The second DELETE of a sweep whose clock moved on while its first was held could end
    after a copy that found the sweep's marker stops waiting for it (SWEEP_WAIT): it is never
    sent, and the sweep says it did not finish."""
    _run, swept = _sweep_cut_short(tmp_path, s3_faults, monkeypatch)
    assert s3_faults.count("DELETE", "/step-000000001/state.000") == 1
    assert swept == [False]


def test_a_sweep_cut_short_leaves_its_marker_for_a_cleaner_to_sweep_the_step_again(
    tmp_path, s3_faults, monkeypatch
):
    """A sweep whose time ran out with a leftover still there leaves its marker (dead once the
    sweep is over): the next archive pass's remove_interrupted_copies visits the step, sweeps
    the leftover and the marker, leaving exactly the step's record and files.  Without the
    marker nothing would ever bring a cleaner back to the step."""
    run, swept = _sweep_cut_short(tmp_path, s3_faults, monkeypatch)
    assert swept == [False]
    assert [n for n in _step_keys(run, 1) if n.startswith("SWEEPING.")]
    run.remove_interrupted_copies()
    _assert_whole_and_clean(run, 1, 1.0)


def test_a_sweep_whose_delete_raises_a_limit_error_keeps_its_marker(tmp_path, s3_faults, monkeypatch):
    """A sweep's first DELETE is answered with a refusal whose body is above what ckptfmt reads
    of an answer (a LimitError, made here by lowering that bound while the DELETE is held): the
    sweep was cut short once its marker was in, so it keeps the marker (dead once it is over),
    and the next cleanup sweeps the step again, leaving exactly its record and files."""
    from ckptfmt.storage import client

    run = _committed_beside_leftovers(tmp_path, s3_faults)
    record = run.record(1)
    leftover = "/step-000000001/state.000"
    held = s3_faults.hold("DELETE", leftover)
    s3_faults.fail_next("DELETE", leftover, status=503)  # an answer with a body, unlike a 204
    sweeper = _OnThread(lambda: run.sweep_step(1, record))
    try:
        _wait_until(lambda: s3_faults.count("DELETE", leftover), "the sweep never deleted")
        monkeypatch.setattr(client, "MAX_LISTING_BODY", 16)  # the refusal's body is above it
    finally:
        held.set()
        sweeper.thread.join(60)
    monkeypatch.undo()
    assert isinstance(sweeper.error, ckptfmt.LimitError) and "above the limit" in str(sweeper.error)
    assert [n for n in _step_keys(run, 1) if n.startswith("SWEEPING.")]
    run.remove_interrupted_copies()
    _assert_whole_and_clean(run, 1, 1.0)


def _clock_ahead(monkeypatch, minutes: float) -> None:
    """This host's wall clock, as ckptfmt's runs on a store read it (objectnames.host_now),
    `minutes` ahead of the store's (a host whose clock is off)."""
    import datetime

    from ckptfmt.runs import objectnames

    real = objectnames.host_now
    monkeypatch.setattr(objectnames, "host_now", lambda: real() + datetime.timedelta(minutes=minutes))


def _foreign_sweep_marker() -> str:
    from ckptfmt.runs.objectnames import COPY_MARKER, SWEEP_MARKER

    return SWEEP_MARKER + _foreign_marker()[len(COPY_MARKER) :]


def _archived_beside_a_sweep(tmp_path, s3_faults):
    """(a run whose step 1 is archived and holds another host's sweep marker just put, local
    step 2, which refers to step 1's state.ckpt)."""
    run, first, second = _incremental_steps(tmp_path, s3_faults)
    archivecopy.put_step(run, 1, first.path, claim=copy_marker())
    s3_faults.client().put_object(
        Bucket=run.url.bucket, Key=f"run/step-000000001/{_foreign_sweep_marker()}", Body=b""
    )
    return run, second


@pytest.mark.parametrize("minutes", [16, 25 * 60], ids=["16-minutes", "25-hours"])
@pytest.mark.parametrize("date_ahead", [False, True], ids=["date", "date-ahead"])
def test_a_copy_on_a_host_whose_clock_is_ahead_waits_for_another_hosts_live_sweep(
    tmp_path, s3_faults, monkeypatch, date_ahead, minutes
):
    """Step 1 is archived; a sweep on another host has just put its marker there.  Step 2's copy
    runs on a host whose clock is 16 minutes (past SWEEP_WAIT), or 25 hours (past STALE_AFTER),
    ahead of the store's: the sweep's marker is aged by the store's clock, so the copy waits
    for it (lists step 1's prefix again and again, until its wait, made 2 s here, ends) rather
    than take it for a dead one and look for the object the sweep may be deleting.
    date-ahead: behind a gateway whose Date is as far ahead of the clock stamping
    Last-Modified (by that Date the marker is past SWEEP_WAIT): the copy ages it by the time
    its own marker's Last-Modified proves."""
    from ckptfmt.runs import objectrun

    run, second = _archived_beside_a_sweep(tmp_path, s3_faults)
    _clock_ahead(monkeypatch, minutes)
    if date_ahead:
        _date_ahead(monkeypatch, minutes)
    monkeypatch.setattr(objectrun, "SWEEP_WAIT", 2.0)
    s3_faults.clear_counts()
    archivecopy.put_step(run, 2, second.path, claim=copy_marker())
    assert s3_faults.count("GET", "prefix=run%2Fstep-000000001%2F") >= 2  # it waited
    _assert_step_2_loads(run)


def _date_ahead(monkeypatch, minutes: float) -> None:
    """Every listing's Date `minutes` ahead of the clock stamping the store's Last-Modified (a
    gateway or proxy in front of the store that sets its own Date, on a clock of its own)."""
    import datetime

    from ckptfmt.storage import listing

    real = listing.http_date

    def ahead(value: object) -> datetime.datetime | None:
        date = real(value)
        return None if date is None else date + datetime.timedelta(minutes=minutes)

    monkeypatch.setattr(listing, "http_date", ahead)


def test_a_date_from_another_clock_makes_no_live_sweep_marker_dead_for_a_copy():
    """A sweep's marker written 250 s ago by the clock stamping Last-Modified (the sweep may
    still be deleting); this host's clock 960 s ahead of that one, the listing's Date 700 s
    ahead of it.  By the Date alone the marker is 950 s old, dead (past SWEEP_WAIT), and by
    this host's clock older still: the copy would adopt an object the sweep then deletes.  By
    the time the copy's own marker proves (its Last-Modified, put 2 s ago, moved on by this
    process's monotonic clock) it is about 252 s old: live."""
    import datetime

    from ckptfmt.runs.objectnames import (
        StoreStamp,
        has_live_marker,
        is_sweep_marker,
        proven_store_time,
    )
    from ckptfmt.storage.listing import Listed

    store = datetime.datetime(2026, 12, 7, 8, 0, tzinfo=datetime.timezone.utc)  # the stamping clock now
    host_now, date = (store + datetime.timedelta(seconds=s) for s in (960, 700))
    sweep, copy = _foreign_sweep_marker(), "ARCHIVING.mine"
    listed = {
        sweep: Listed(0, store - datetime.timedelta(seconds=250), '"s"'),
        copy: Listed(0, store - datetime.timedelta(seconds=2), '"c"'),
    }
    for unproven in (date, host_now):
        assert not has_live_marker(listed, datetime.timedelta(0), unproven, is_sweep_marker)
    stamp = StoreStamp(copy, time.monotonic())
    own = stamp.now(listed, host_now)
    proven = proven_store_time(date, own, host_now)
    assert proven is not None and proven < store + datetime.timedelta(seconds=60)
    assert has_live_marker(listed, datetime.timedelta(0), proven, is_sweep_marker)
    assert stamp.now({}, host_now) is not None  # kept from the listing that showed it
    assert StoreStamp(copy, time.monotonic()).now({}, host_now) is None  # never shown: nothing proven
    assert proven_store_time(date, None, host_now) is None
    assert proven_store_time(None, own, host_now) == own  # no Date: the proven time alone
    earlier = store - datetime.timedelta(seconds=30)  # a Date behind the stamps: markers look younger
    assert proven_store_time(earlier, own, host_now) == earlier


def test_a_copys_wait_for_a_killed_sweep_moves_on_without_a_date(tmp_path, s3_faults, monkeypatch):
    """A sweep on another host was killed in step 1; the store sends no Date.  Step 2's copy
    ages the sweep's marker by the time its own marker proves, moved on by this process's
    monotonic clock: past SWEEP_WAIT (made 2 s here) the marker is dead and the copy goes on,
    well before its wait (made 60 s here) ends, not held the whole wait by a store time
    stuck at the newest Last-Modified listed."""
    from ckptfmt.runs import objectnames, objectrun

    run, second = _archived_beside_a_sweep(tmp_path, s3_faults)
    s3_faults.drop_header("GET", "prefix=run%2Fstep-000000001%2F", "date")
    monkeypatch.setattr(objectnames, "SWEEP_WAIT", 2.0)
    monkeypatch.setattr(objectrun, "SWEEP_WAIT", 60.0)
    began = time.monotonic()
    archivecopy.put_step(run, 2, second.path, claim=copy_marker())
    assert time.monotonic() - began < 40  # 60 s and more where it waited the whole wait
    _assert_step_2_loads(run)


@pytest.mark.parametrize("minutes", [16, 25 * 60], ids=["16-minutes", "25-hours"])
@pytest.mark.parametrize("dated", ["date", "no-date", "date-ahead"])
def test_a_cleaner_on_a_host_whose_clock_is_ahead_keeps_another_hosts_live_sweep_marker(
    tmp_path, s3_faults, monkeypatch, dated, minutes
):
    """A sweep on another host has just put its marker into complete step 1; an archive pass's
    remove_interrupted_copies runs on a host whose clock is 16 minutes (past SWEEP_WAIT), or 25
    hours (past STALE_AFTER), ahead of the store's: the marker is aged by the store's clock as
    a marker of the cleaner's own proves it, so it is live and stays (a copy coming next must
    find it and wait for that sweep).  no-date: the store sends no Date; date-ahead: a
    gateway's Date as far ahead of the clock stamping Last-Modified as this host's clock."""
    run, first, _second = _incremental_steps(tmp_path, s3_faults)
    archivecopy.put_step(run, 1, first.path, claim=copy_marker())
    marker = _foreign_sweep_marker()
    s3_faults.client().put_object(Bucket=run.url.bucket, Key=f"run/step-000000001/{marker}", Body=b"")
    _clock_ahead(monkeypatch, minutes)
    if dated == "no-date":
        s3_faults.drop_header("GET", "prefix=run%2F", "date")
        assert run.listing().date is None
    if dated == "date-ahead":
        _date_ahead(monkeypatch, minutes)
    run.remove_interrupted_copies()
    assert marker in _step_keys(run, 1)


def test_a_killed_sweeps_marker_in_an_idle_run_ages_by_the_stores_clock(tmp_path, store, monkeypatch):
    """A sweep on another host was killed in complete step 1, beside a dead copy's leftover, and
    the run then stayed idle: the sweep's marker is the run's newest object.  Past SWEEP_WAIT
    (made 2 s here) by the store's clock, the Date of the listing's answer, the marker is dead:
    the next cleanup sweeps the leftover and then the marker, not only after STALE_AFTER (24 h)
    as when the newest time listed stood for the store's clock.  Each store sends that Date."""
    from ckptfmt.runs import objectnames
    from ckptfmt.storage.upload import upload_bytes

    base, options = store
    url = f"{base}/run"
    ckptfmt.CheckpointManager(url, storage_options=options).save(1, {"w": torch.full((5000,), 1.0)})
    upload_bytes(b"x", f"{url}/step-000000001/state.0123456789abcdef.ckpt", options)
    upload_bytes(b"x", f"{url}/step-000000001/{_foreign_sweep_marker()}", options)  # the newest
    monkeypatch.setattr(objectnames, "SWEEP_WAIT", 2.0)
    time.sleep(3.5)  # past SWEEP_WAIT by the store's clock, whose Date counts whole seconds
    run = ObjectRun(url, options)
    assert run.listing().date is not None
    run.remove_interrupted_copies()
    assert _step_keys(run, 1) == {p.name for p in run.record(1).files} | {"COMMIT"}


def test_a_store_time_that_is_absurd_makes_no_live_sweep_marker_dead():
    """The store's time by which markers are aged (proven_store_time): a Date that does not
    parse is none; one more than STORE_AHEAD_AT_MOST ahead of this host's clock is not
    believed, the proven time standing; a Last-Modified of ckptfmt's own marker that far
    ahead (forged) is taken as STORE_AHEAD_AT_MOST ahead at most; a marker just written stays
    live by each."""
    import datetime

    from ckptfmt.runs.objectnames import STORE_AHEAD_AT_MOST, StoreStamp, marker_dead, proven_store_time
    from ckptfmt.storage.listing import Listed, http_date

    now = datetime.datetime.now(datetime.timezone.utc)
    marker = Listed(0, now - datetime.timedelta(seconds=1), '"m"')
    for junk in ("garbage", "Mon, 07 Dec 2026 99:19:24 GMT", "Mon, 99 Jan 99999 00:00:00 GMT", 7, "x" * 65):
        assert http_date(junk) is None
    far = http_date("Fri, 31 Dec 9999 23:59:59 GMT")
    assert far is not None and far.year == 9999
    ahead = now + datetime.timedelta(seconds=STORE_AHEAD_AT_MOST + 60)
    own = StoreStamp("ARCHIVING.mine", time.monotonic()).now({"ARCHIVING.mine": marker}, now)
    for date in (None, far, ahead):
        assert proven_store_time(date, own, now) == own  # the proven time stands
    assert proven_store_time(now - datetime.timedelta(seconds=5), own, now) < own  # earlier: taken
    for forged in (far, ahead):
        stamp = StoreStamp("ARCHIVING.mine", time.monotonic())
        at = stamp.now({"ARCHIVING.mine": Listed(0, forged, '"x"')}, now)
        assert at is not None and at <= now + datetime.timedelta(seconds=STORE_AHEAD_AT_MOST + 5)
        assert not marker_dead(_foreign_sweep_marker(), marker.modified, datetime.timedelta(0), at)
        assert not marker_dead(_foreign_marker(), marker.modified, datetime.timedelta(0), at)


def test_a_sweeps_deletes_have_a_deadline_that_leaves_it_time_to_delete(monkeypatch):
    """A user's deadline longer than SWEEP_DELETE_DEADLINE (the default 300 s, or a day) would
    leave a sweep no DELETE that ends within SWEEP_DELETES_WITHIN: its DELETEs take the shorter
    one; a shorter deadline of the user's is kept."""
    from ckptfmt.runs.objectnames import (
        STORE_AHEAD_AT_MOST,
        SWEEP_DELETE_DEADLINE,
        SWEEP_DELETES_WITHIN,
        SWEEP_WAIT,
        sweep_options,
    )
    from ckptfmt.storage.client import DEADLINE_VARIABLE, deadline

    monkeypatch.delenv(DEADLINE_VARIABLE, raising=False)
    assert SWEEP_DELETE_DEADLINE < SWEEP_DELETES_WITHIN
    assert SWEEP_DELETES_WITHIN + STORE_AHEAD_AT_MOST < SWEEP_WAIT  # a live marker never looks dead
    for given in ({}, {"deadline": 86400}):
        assert deadline(sweep_options(given)) == SWEEP_DELETE_DEADLINE
    assert sweep_options({"deadline": 5, "max_attempts": 2}) == {"deadline": 5, "max_attempts": 2}


def test_a_clock_reading_whose_put_answer_is_lost_leaves_no_marker(tmp_path, s3_faults):
    """A cleaner reads the store's clock by putting a marker of its own into a step; where the
    PUT's answer is lost after the store wrote the object and the retry is refused, the reading
    fails and its marker is deleted all the same (other hosts would take it for a live copy's
    for a day and skip sweeping that step)."""
    from ckptfmt.runs import storeclock

    run, first, _second = _incremental_steps(tmp_path, s3_faults)
    archivecopy.put_step(run, 1, first.path, claim=copy_marker())
    before = _step_keys(run, 1)
    s3_faults.clear_counts()
    s3_faults.reset_on("PUT", "ARCHIVING.", answered=True)
    s3_faults.fail_next("PUT", "ARCHIVING.", status=403, code="AccessDenied")
    with pytest.raises(ckptfmt.CheckpointError):
        storeclock.read_stamp(run.step_url(1), run.options)
    assert s3_faults.count("PUT", "ARCHIVING.") == 2
    assert _step_keys(run, 1) == before


def test_a_cleanup_on_a_host_whose_clock_is_ahead_keeps_another_hosts_live_save(store, monkeypatch):
    """A saver on another host is uploading step 2 (its state object is up, its record yet to
    come); a save of step 3 on a host whose clock is 25 hours ahead of the store's cleans the
    run up first.  By this host's clock the step's newest object is older than STALE_AFTER; by
    the store's time, which a marker of the cleaner's own proves, it is seconds old: the step
    stays whole.  A leftover that is old by the store's time still goes (a bound of 1 s), and
    the cleaner's reading of the clock leaves nothing behind."""
    from ckptfmt.storage.upload import upload_bytes

    base, options = store
    url = f"{base}/run"
    ckptfmt.CheckpointManager(url, storage_options=options).save(1, {"w": torch.full((5000,), 1.0)})
    upload_bytes(b"a live save's state", f"{url}/step-000000002/state.ckpt", options)
    _clock_ahead(monkeypatch, 25 * 60)
    ckptfmt.CheckpointManager(url, storage_options=options).save(3, {"w": torch.full((5000,), 3.0)})
    run = ObjectRun(url, options)
    assert _step_keys(run, 2) == {"state.ckpt"}
    time.sleep(2.1)  # older than the bound below by the store's clock, whatever its resolution
    run.cleanup(datetime.timedelta(seconds=1))
    assert set(run.listing()) == {1, 3}


def test_a_cleaner_on_a_host_whose_clock_is_ahead_keeps_another_hosts_live_copy(store, monkeypatch):
    """Another host's archiver is copying step 2 (its copy marker and a file are up, its record
    yet to come); the cleaner's clock is 25 hours ahead of the store's, so by it the marker is
    past STALE_AFTER.  Neither cleanup (a bound of 0 s) nor remove_interrupted_copies (an
    archive pass) takes it for a dead copy's: both age it by the store's time, proven, and the
    step stays whole."""
    from ckptfmt.storage.upload import upload_bytes

    base, options = store
    url = f"{base}/run"
    ckptfmt.CheckpointManager(url, storage_options=options).save(1, {"w": torch.full((5000,), 1.0)})
    for name in (_foreign_marker(), "state.ckpt"):
        upload_bytes(b"x", f"{url}/step-000000002/{name}", options)
    _clock_ahead(monkeypatch, 25 * 60)
    run = ObjectRun(url, options)
    time.sleep(1.1)  # older than the cleanup's bound by the store's clock, whatever its resolution
    run.cleanup(datetime.timedelta(0))
    assert run.remove_interrupted_copies() == []
    assert _step_keys(run, 2) == {_foreign_marker(), "state.ckpt"}


def test_a_sweep_on_a_host_whose_clock_is_ahead_keeps_what_a_live_copy_uploads(
    tmp_path, s3_faults, monkeypatch
):
    """Step 1 is complete; another host's archiver has its copy marker in step 1's prefix and an
    object of its own name there (one its later step may refer to).  A sweep of step 1 on a
    host whose clock is 25 hours ahead of the store's must not take that copy for a dead one:
    it ages the marker by the store's time its own sweep marker proves, and deletes nothing."""
    run, first, _second = _incremental_steps(tmp_path, s3_faults)
    archivecopy.put_step(run, 1, first.path, claim=copy_marker())
    client = s3_faults.client()
    for name in (_foreign_marker(), "state.0123456789abcdef.ckpt"):
        client.put_object(Bucket=run.url.bucket, Key=f"run/step-000000001/{name}", Body=b"x")
    before = _step_keys(run, 1)
    _clock_ahead(monkeypatch, 25 * 60)
    assert run.sweep_step(1, run.record(1)) is False
    assert _step_keys(run, 1) == before


def test_a_dead_copys_prefix_keeps_a_plain_savers_young_objects(s3_bucket):
    """A copy of this process died in step 1 (its marker dead), and a plain saver on another
    host is writing into that step now: remove_interrupted_copies deletes nothing there
    while those objects are younger than its bound by the store's time; once they are older,
    the prefix goes (spec 13.7)."""
    from ckptfmt.storage.upload import upload_bytes

    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    upload_bytes(b"a copy's", f"{url}/step-000000001/{copy_marker()}", options)
    upload_bytes(b"a saver's", f"{url}/step-000000001/state.0123456789abcdef.ckpt", options)
    run = ObjectRun(url, options)
    assert run.remove_interrupted_copies() == []
    assert "state.0123456789abcdef.ckpt" in run.listing()[1]
    assert run.remove_interrupted_copies(older_than=datetime.timedelta(0)) == [1]
    assert run.listing() == {}


def test_a_clock_reading_leaves_a_concurrent_sweep_of_the_newest_step_its_work(s3_bucket, monkeypatch):
    """A cleaner reads the store's clock by a marker of its own beneath the run's CLOCK/,
    never in a step's prefix: another host's sweep of the newest step during the reading
    sees no live copy there and deletes what a losing save left; nothing of the reading
    stays."""
    from ckptfmt.runs import storeclock
    from ckptfmt.runs.storeclock import StoreClock
    from ckptfmt.storage import listing
    from ckptfmt.storage.upload import upload_bytes

    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    ckptfmt.CheckpointManager(url, storage_options=options).save(1, {"w": torch.ones(10)})
    run = ObjectRun(url, options)
    upload_bytes(b"loser", f"{url}/step-000000001/state.0123456789abcdef.ckpt", options)
    swept, put = [], []
    real = storeclock.upload_bytes

    def put_then_another_host_sweeps(data, target, opts):
        real(data, target, opts)
        put.append(target)
        swept.append(ObjectRun(url, options).sweep_step(1, run.record(1)))

    monkeypatch.setattr(storeclock, "upload_bytes", put_then_another_host_sweeps)
    assert StoreClock(run.url, options).proven_time() is not None
    assert swept == [True] and len(put) == 1 and put[0].startswith(f"{url}/CLOCK/ARCHIVING."), put
    assert "state.0123456789abcdef.ckpt" not in run.listing()[1]
    assert [k for k in listing.objects(run.url, options) if not k.startswith("step-")] == []


def test_cleanup_removes_what_a_dead_clock_reading_left(s3_bucket):
    """A reading of the store's clock whose process died leaves its marker beneath CLOCK/:
    a later cleanup (or archive pass) deletes it as a dead copy's marker (here this process's, not in use);
    the run's listing of steps never shows it."""
    from ckptfmt.storage import listing
    from ckptfmt.storage.upload import upload_bytes

    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    ckptfmt.CheckpointManager(url, storage_options=options).save(1, {"w": torch.ones(10)})
    upload_bytes(b"a reading", f"{url}/CLOCK/{copy_marker()}", options)
    run = ObjectRun(url, options)
    found = run.listing()
    assert sorted(found) == [1] and len(found.readings) == 1
    run.cleanup(found=found)
    assert [k for k in listing.objects(run.url, options) if k.startswith("CLOCK/")] == []
    upload_bytes(b"a reading", f"{url}/CLOCK/{copy_marker()}", options)  # an archive pass's too
    assert run.remove_interrupted_copies() == []
    assert [k for k in listing.objects(run.url, options) if k.startswith("CLOCK/")] == []


def test_cleanup_asks_no_head_of_a_retired_step_a_record_reads(tmp_path, s3_faults):
    """An incremental run's retired step (its record deleted, its objects read by a later
    record) looks stale to every cleanup: it is skipped by the listed record's references
    before any HEAD."""
    bucket = s3_faults.new_bucket()
    url = f"s3://{bucket}/run"
    m = ckptfmt.CheckpointManager(url, incremental=True, storage_options=s3_faults.storage_options())
    for step in (1, 2):
        m.save(step, {"frozen": torch.arange(1 << 14, dtype=torch.float32), "step": step})
    m.run.retire_step(1)
    run = ObjectRun(url, s3_faults.storage_options())
    s3_faults.clear_counts()
    run.cleanup(older_than=datetime.timedelta(0))
    assert s3_faults.count("HEAD") == 0, s3_faults.requests()
    assert 1 in run.listing()  # kept for step 2

"""The archive tier across restarts and while it lags or is down (a real moto S3 server, through
the fault proxy where a fault is needed): what still needs archiving comes from the two tiers,
not from a process's memory; a lagging archive gets the newest step next; an interrupted copy
is removed by the next archiver; the archive never holds more than its rules; an archive that
cannot be read does not stop a resume from the local tier."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointWarning, StorageError
from ckptfmt.runs.objectnames import COPY_MARKER
from ckptfmt.runs.objectrun import ObjectRun
from ckptfmt.storage import listing


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def _manager(run_dir, bucket, options, **kw):
    return ckptfmt.CheckpointManager(run_dir, archive=f"s3://{bucket}/run", storage_options=options, **kw)


def _local(m) -> list[int]:
    return [c.step for c in m.checkpoints()]


def _archived(bucket, options) -> list[int]:
    return [c.step for c in ObjectRun(f"s3://{bucket}/run", options).checkpoints()]


def _keys(bucket, options) -> set[str]:
    return set(listing.objects(ObjectRun(f"s3://{bucket}/run", options).url, options))


def test_steps_left_unarchived_by_a_dead_process_are_archived_by_the_next(tmp_path, s3_faults):
    """Issue 38 item 1: the steps a process could not archive are known to the next process
    from the tiers themselves: kept on local disk until archived (or superseded), and a step
    archive_keep_every keeps is archived, never skipped."""
    options = s3_faults.storage_options() | {"max_attempts": 1}
    bucket = s3_faults.new_bucket()
    rules = dict(keep_last=1, archive_keep_last=1, archive_keep_every=2)
    s3_faults.fail_next("PUT", "", status=503, code="SlowDown", count=10**6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # the failed copies
        first = _manager(tmp_path / "run", bucket, options, **rules)
        for step in range(1, 6):
            first.save(step, _state(step))
        first.wait()
        assert _local(first) == [1, 2, 3, 4, 5]
        # a new process while the archive still fails: it must not drop what was never archived
        second = _manager(tmp_path / "run", bucket, options, **rules)
        second.save(6, _state(6))
        second.wait()
        assert _local(second) == [1, 2, 3, 4, 5, 6]
    s3_faults.clear_rules()
    third = _manager(tmp_path / "run", bucket, options, **rules)  # starts archiving by itself
    third.wait()
    assert third.archive_failures() == {}
    # 2 and 4 are kept by archive_keep_every; 6 is the newest; 1, 3 and 5 are superseded by 6
    assert _archived(bucket, options) == [2, 4, 6]
    assert _local(third) == [6]


def test_a_lagging_archive_gets_the_newest_step_next(tmp_path, s3_faults, caplog):
    """Issue 38 item 3: while one copy runs, the steps saved meanwhile wait; the next copy is
    the newest of them (the others, kept by no rule, are skipped), and the lag is reported by
    the manager and in each save's log line."""
    options = s3_faults.storage_options()
    bucket = s3_faults.new_bucket()
    m = _manager(tmp_path / "run", bucket, options, keep_last=1, archive_keep_last=2)
    s3_faults.delay("PUT", "/state.ckpt", seconds=1.5, count=1)  # the first copy is slow
    caplog.set_level(logging.INFO, logger="ckptfmt")
    m.save(1, _state(1))
    deadline = time.monotonic() + 30
    while s3_faults.count("PUT", "/step-000000001/state.ckpt") == 0:  # step 1's copy is under way
        assert time.monotonic() < deadline, "step 1 was never copied"
        time.sleep(0.01)
    for step in range(2, 7):
        m.save(step, _state(step))
    lag = m.archive_lag
    assert lag is not None and lag.steps >= 5 and lag.seconds > 0, lag
    assert any(
        "archive lag:" in r.getMessage() and "step 6 committed" in r.getMessage() for r in caplog.records
    )
    assert _local(m) == [1, 2, 3, 4, 5, 6]  # none archived yet: all kept
    m.wait()
    assert _archived(bucket, options) == [1, 6]
    assert s3_faults.count("PUT", "/state.ckpt") == 2  # steps 2-5 were never copied
    assert _local(m) == [6]
    lag = m.archive_lag
    assert lag is not None and (lag.steps, lag.seconds, lag.archived) == (0, 0.0, 6)


_KILLED_MID_COPY = textwrap.dedent(
    """
    import sys, torch, ckptfmt
    run_dir, url, endpoint = sys.argv[1:4]
    options = {"endpoint_url": endpoint, "aws_access_key_id": "k", "aws_secret_access_key": "s",
               "region": "us-east-1"}
    m = ckptfmt.CheckpointManager(run_dir, archive=url, storage_options=options)
    m.save(1, {"w": torch.ones(1000)})
    m.wait()
    """
)


def test_a_copy_killed_midway_is_removed_by_the_next_archiver(tmp_path, s3_faults):
    """Issue 38 item 2: a process SIGKILLed while its copy of a step waits for the commit
    record's upload leaves objects without a commit record; the next archiver (here on a new
    node) removes them, and leaves alone what it cannot prove abandoned."""
    options = s3_faults.storage_options()
    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    c.put_object(Bucket=bucket, Key="run/step-000000007/state.ckpt", Body=b"someone else's")  # no marker
    s3_faults.delay("PUT", "/step-000000001/COMMIT", seconds=60)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _KILLED_MID_COPY,
            str(tmp_path / "old"),
            f"s3://{bucket}/run",
            s3_faults.endpoint_url,
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while s3_faults.count("PUT", "/step-000000001/COMMIT") == 0:
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the copy never reached its commit record"
            )
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    s3_faults.clear_rules()
    left = _keys(bucket, options)
    assert "step-000000001/state.ckpt" in left and "step-000000001/COMMIT" not in left
    assert any(k.startswith("step-000000001/" + COPY_MARKER) for k in left)
    m = _manager(tmp_path / "new-node", bucket, options, archive_keep_last=1)
    m.save(2, _state(2))
    m.wait()
    # the killed copy's objects are young: a plain saver on another host may be writing into
    # that step, so they stay until older than the bound (24 hours) by the store's time
    assert "step-000000001/state.ckpt" in _keys(bucket, options)
    assert ObjectRun(f"s3://{bucket}/run", options).remove_interrupted_copies(datetime.timedelta(0)) == [1]
    assert _keys(bucket, options) == {
        "step-000000002/state.ckpt",
        "step-000000002/COMMIT",
        "step-000000007/state.ckpt",  # not provably an abandoned copy of ours: left
    }


def test_the_archive_never_holds_more_than_its_rules(tmp_path, s3_faults):
    """Issue 38 item 4: the step the archive's rules drop goes before the new step's commit
    record, so no listing ever shows more complete steps than archive_keep_last."""
    options = s3_faults.storage_options()
    bucket = s3_faults.new_bucket()
    m = _manager(tmp_path / "run", bucket, options, archive_keep_last=2)
    for step in (1, 2):
        m.save(step, _state(step))
        m.wait()
    s3_faults.delay("DELETE", "/step-000000001/COMMIT", seconds=1.0)  # rotation is slow
    seen: list[list[int]] = []
    stop = threading.Event()

    def watch() -> None:
        direct = ObjectRun(f"s3://{bucket}/run", options)
        while not stop.is_set():
            seen.append([c.step for c in direct.checkpoints()])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        m.save(3, _state(3))
        m.wait()
    finally:
        stop.set()
        watcher.join()
    assert _archived(bucket, options) == [2, 3]
    assert seen and max(len(s) for s in seen) <= 2, [s for s in seen if len(s) > 2][:3]


@pytest.mark.parametrize("fault", ["503", "stall"])
def test_an_archive_outage_does_not_stop_a_resume(tmp_path, s3_faults, fault):
    """Issue 37 item 6: with the archive failing every request, latest()/load()/load_into()
    resume from the local tier with a warning, saves go on, and the steps are archived once
    it is back."""
    options = s3_faults.storage_options() | {"max_attempts": 1, "request_timeout": 1, "read_timeout": 1}
    bucket = s3_faults.new_bucket()
    m = _manager(tmp_path / "run", bucket, options, keep_last=1, archive_keep_last=1)
    m.save(1, _state(1))
    m.wait()
    if fault == "503":
        s3_faults.fail_next(None, "", status=503, code="SlowDown", count=10**6)
    else:
        s3_faults.delay(None, "", seconds=5)
    m2 = _manager(tmp_path / "run", bucket, options, keep_last=1, archive_keep_last=1)  # a restart
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert m2.latest().step == 1
        assert m2.load()["step"] == 1
        target = {"w": torch.zeros(1000), "step": 0}
        assert m2.load_into(target).step == 1 and target["step"] == 1
        m2.save(2, _state(2))
        m2.wait()
    assert any("could not be checked" in str(w.message) for w in caught)
    assert _local(m2) == [1, 2] or _local(m2) == [2]
    s3_faults.clear_rules()
    m2.save(3, _state(3))
    m2.wait()
    assert _archived(bucket, options) == [3]
    assert _local(m2) == [3]


def test_an_archive_known_to_hold_a_newer_step_is_not_bypassed(tmp_path, s3_faults):
    """Issue 37 item 6, decided: when this process saw the archive hold a step newer than the
    local tier's newest and the archive then cannot be read, resuming from the older local
    step would fork the run: a StorageError naming both steps."""
    options = s3_faults.storage_options() | {"max_attempts": 1}
    bucket = s3_faults.new_bucket()
    old = _manager(tmp_path / "old", bucket, options)
    for step in (1, 2, 3):
        old.save(step, _state(step))
    old.wait()
    stale = _manager(tmp_path / "stale", bucket, options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        stale.save(1, _state(1))  # the same step 1 as the archive's is another save of it
        stale.wait()
    assert stale.latest().step == 3  # the archive, listed: newer than this disk
    s3_faults.fail_next(None, "", status=503, code="SlowDown", count=10**6)
    with pytest.raises(StorageError, match="seen holding step 3, newer than the local tier's newest \\(1\\)"):
        stale.latest()
    with pytest.raises(StorageError, match="seen holding step 3"):
        stale.load()


def test_only_markers_of_ended_writers_make_a_prefix_removable(tmp_path, s3_bucket):
    """Issue 38 item 2, the proof rule (spec 13.7): a prefix goes only when all its copy markers
    are dead (a process of this host that has ended) and no step refers to its objects; a live
    or foreign writer's fresh marker, and a prefix without a marker, are left alone."""
    bucket, options = s3_bucket
    from s3_server import s3_client

    from ckptfmt.engine import commit

    m = _manager(tmp_path / "run", bucket, options)
    m.save(1, _state(1))
    m.wait()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process of this host that has ended
    dead = f"{COPY_MARKER}{commit.host_token()}.{gone.pid}.0.0badcafe"
    live = f"{COPY_MARKER}{commit.host_token()}.{os.getppid()}.0.0badcafe"
    foreign = f"{COPY_MARKER}{'f' * 16}.{gone.pid}.0.0badcafe"
    c = s3_client(options["endpoint_url"])
    for key in (
        f"step-000000005/{dead}",  # an interrupted copy: removed
        "step-000000005/state.ckpt",
        f"step-000000006/{dead}",  # a dead and a live writer: left
        f"step-000000006/{live}",
        "step-000000006/state.ckpt",
        f"step-000000007/{foreign}",  # another host's, written just now: left
        "step-000000007/state.ckpt",
        "step-000000008/state.ckpt",  # no marker: not provably ours
        f"step-000000001/{dead}",  # a complete step: only the marker goes
    ):
        c.put_object(Bucket=bucket, Key=f"run/{key}", Body=b"x")
    # step 5's objects are young (a plain saver elsewhere may be writing there): kept until
    # older than the bound by the store's time; here a bound of 0
    assert ObjectRun(f"s3://{bucket}/run", options).remove_interrupted_copies() == []
    assert "step-000000005/state.ckpt" in _keys(bucket, options)
    removed = ObjectRun(f"s3://{bucket}/run", options).remove_interrupted_copies(datetime.timedelta(0))
    assert removed == [5]
    assert {k for k in _keys(bucket, options) if not k.startswith("step-000000001/")} == {
        f"step-000000006/{dead}",
        f"step-000000006/{live}",
        "step-000000006/state.ckpt",
        f"step-000000007/{foreign}",
        "step-000000007/state.ckpt",
        "step-000000008/state.ckpt",
    }
    assert {k for k in _keys(bucket, options) if k.startswith("step-000000001/")} == {
        "step-000000001/state.ckpt",
        "step-000000001/COMMIT",
    }
    assert _archived(bucket, options) == [1]


def test_a_step_saved_again_is_never_taken_for_the_archives_older_save(tmp_path, s3_bucket):
    """A local step deleted by hand and saved again under its number is another save than the
    archive's step of that number: it is not copied over it, stays on local disk whatever the
    local rules say (reported in archive_failures), and load(step) reads it, not the old copy."""
    import shutil

    bucket, options = s3_bucket
    m = _manager(tmp_path / "run", bucket, options, keep_last=1)
    for step in (1, 2, 3, 4):
        m.save(step, _state(step))
    m.wait()
    assert _archived(bucket, options) == [1, 2, 3, 4] and _local(m) == [4]
    shutil.rmtree(tmp_path / "run" / "step-000000004")
    again = {"w": torch.full((1000,), 44.0), "step": 4}
    with pytest.warns(CheckpointWarning, match="archive holds another save of step 4"):
        m.save(4, again)
        m.wait()
        m.save(5, _state(5))
        m.wait()
    assert _archived(bucket, options) == [1, 2, 3, 4, 5]
    assert _local(m) == [4, 5]  # keep_last=1, but the new step 4 is nowhere else
    assert 4 in m.archive_failures()
    assert m.load(step=4)["w"][0].item() == 44.0
    m.remove(4)  # both tiers: the way back
    assert 4 not in _archived(bucket, options) and _local(m) == [5]


def _until(done, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_archive_wait_past_its_deadline_says_what_the_archive_is_doing(tmp_path, s3_faults):
    """Archiver.wait's deadline error says what the live archive thread is doing: listing (or
    rotating) the archive while its pass lists it, copying the step named while it copies."""
    options = s3_faults.storage_options()
    bucket = s3_faults.new_bucket()
    m = _manager(tmp_path / "run", bucket, options)
    m.wait()  # the archiver's first pass, made when the manager opens
    s3_faults.clear_counts()
    s3_faults.delay("GET", "list-type", seconds=3, count=1)  # the next pass's listing of the archive
    s3_faults.delay("PUT", "/step-000000001/", seconds=3, count=1)  # then step 1's copy
    m.save(1, _state(1))
    _until(lambda: s3_faults.count("GET", "list-type") > 0, "the archive was never listed")
    with pytest.raises(StorageError, match=r"still listing or rotating the archive \(no step being copied\)"):
        m._archiver.wait(0.2)
    _until(lambda: s3_faults.count("PUT", "/step-000000001/") > 0, "step 1 was never copied")
    with pytest.raises(StorageError, match=r"still copying step 1 after the wait's deadline of 0.2 s") as e:
        m._archiver.wait(0.2)
    assert f"s3://{bucket}/run" in str(e.value)
    m.wait()
    assert _archived(bucket, options) == [1]


def test_an_archive_thread_that_ended_without_its_pass_is_not_waited_for(tmp_path, s3_bucket):
    """A thread that ended without marking the archiver idle (what a fork leaves the child: the
    parent's archive thread, not running there) is said to have ended, at once rather than at
    the deadline, and the next save's pass archives what it left."""
    bucket, options = s3_bucket
    m = _manager(tmp_path / "run", bucket, options)
    m.save(1, _state(1))
    m.wait()
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    m._archiver._thread = ended
    began = time.monotonic()
    with pytest.raises(StorageError, match="the archive thread ended without finishing its pass"):
        m._archiver.wait(30)
    assert time.monotonic() - began < 15
    m.save(2, _state(2))
    m.wait()
    assert _archived(bucket, options) == [1, 2]


def _plant_cut_short_copy(bucket: str, options: dict[str, str], step_dir, names: list[str]) -> None:
    """What an archive copy cut short on another node leaves in its step's prefix: its copy
    marker (another host's: not judged dead before a day) and the files `names` of local step
    `step_dir`, uploaded, without a commit record."""
    from s3_server import s3_client

    client = s3_client(options["endpoint_url"])
    key = f"run/{step_dir.name}"
    client.put_object(Bucket=bucket, Key=f"{key}/{COPY_MARKER}0123456789abcdef.42.77.0badcafe", Body=b"x")
    for name in names:
        client.put_object(Bucket=bucket, Key=f"{key}/{name}", Body=(step_dir / name).read_bytes())


def test_an_incremental_step_archived_over_a_cut_short_copy_is_read_by_later_steps(tmp_path, s3_bucket):
    """Step 1 of an incremental run is archived where a copy cut short on another node left
    its state file: the copy writes step 1's under a name of its own (state.<h>.ckpt) and its
    record names that.  Step 2, saved against step 1, reads chunks of step 1's state file by
    the name its own index gives it (../step-000000001/state.ckpt): the archive holds that
    object for it, and a fresh node loads both steps bit-exactly from the archive."""
    from ckptfmt.files.names import STATE_NAME_RE

    bucket, options = s3_bucket
    run_dir = tmp_path / "run"
    frozen = torch.arange(1 << 16, dtype=torch.float32)

    def state(step: int) -> dict[str, object]:
        return {"frozen": frozen.clone(), "w": torch.full((1000,), float(step)), "step": step}

    ckptfmt.CheckpointManager(run_dir, incremental=True).save(1, state(1))
    _plant_cut_short_copy(bucket, options, run_dir / "step-000000001", ["state.ckpt"])
    m = _manager(run_dir, bucket, options, incremental=True)
    m._archiver.kick()
    m._archiver.wait(60)
    m.save(2, state(2))
    m.wait()
    m._archiver.wait(60)
    assert not m.archive_failures()
    assert _archived(bucket, options) == [1, 2]
    archive = ObjectRun(f"s3://{bucket}/run", options)
    first, second = archive.record(1), archive.record(2)
    assert [STATE_NAME_RE.fullmatch(p.name) is not None for p in first.files] == [True]
    assert first.files[0].name != "state.ckpt"  # the copy's own name
    assert [r.name for r in second.references] == ["../step-000000001/state.ckpt"]
    reader = ckptfmt.CheckpointManager(f"s3://{bucket}/run", storage_options=options)
    for step in (1, 2):
        report = reader.verify(step)
        assert report.ok, report.problems
        got = reader.load(step)
        assert torch.equal(got["frozen"], frozen) and torch.equal(got["w"], state(step)["w"])


def test_a_step_archived_after_a_later_step_that_reads_it_is_not_uploaded_twice(tmp_path, s3_bucket):
    """A lagging archive copies the newest step first: step 2 of an incremental run goes up
    with step 1's state file, which it reads chunks of, in step 1's prefix.  Step 1 copied
    afterwards finds that object there, named by step 2's committed record (kept by every
    cleanup): it is the very file, so step 1's record names it instead of a second copy of it
    under a name of its own, and both steps load bit-exactly."""
    from ckptfmt.runs.archivecopy import put_step

    bucket, options = s3_bucket
    run_dir = tmp_path / "run"
    frozen = torch.arange(1 << 16, dtype=torch.float32)
    local = ckptfmt.CheckpointManager(run_dir, incremental=True)
    for step in (1, 2):
        local.save(step, {"frozen": frozen.clone(), "w": torch.full((1000,), float(step)), "step": step})
    archive = ObjectRun(f"s3://{bucket}/run", options)
    put_step(archive, 2, str(run_dir / "step-000000002"))
    put_step(archive, 1, str(run_dir / "step-000000001"))
    assert [p.name for p in archive.record(1).files] == ["state.ckpt"]
    assert {n for n in archive.listing()[1] if n.endswith(".ckpt")} == {"state.ckpt"}
    reader = ckptfmt.CheckpointManager(f"s3://{bucket}/run", storage_options=options)
    for step in (1, 2):
        assert reader.verify(step).ok
        got = reader.load(step)
        assert torch.equal(got["frozen"], frozen) and torch.equal(got["w"], torch.full((1000,), float(step)))

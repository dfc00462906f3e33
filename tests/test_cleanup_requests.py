"""The requests a store run's cleanups make, counted at the fault proxy: what the caller or an
earlier step of the cleanup has read is not asked again, and what a verdict does not need is
not asked at all (each store's emulator, through tests/store_faults.py)."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
from s3_faults import hit

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.engine import commit
from ckptfmt.errors import CheckpointWarning
from ckptfmt.files import multifile
from ckptfmt.runs import archivecopy, storeclock
from ckptfmt.runs.archiver import Archiver
from ckptfmt.runs.objectnames import COPY_MARKER
from ckptfmt.runs.objectrun import ObjectRun
from ckptfmt.runs.steps import step_dirname

NOW = datetime.timedelta(0)  # a bound of 0: everything written before the cleaner's clock reading


def _run_of_retired_steps(faults, steps: int) -> tuple[str, CheckpointManager]:
    """An incremental run keeping its last step, which reads a frozen tensor from each earlier
    step (each saved with one more): every earlier step retired, its record gone, kept for
    the newest step's reads."""
    url = f"{faults.new_root()}/run"
    m = CheckpointManager(url, incremental=True, keep_last=1, storage_options=faults.options)
    state: dict[str, object] = {}
    for step in range(1, steps + 1):
        state[f"frozen{step}"] = torch.full((1 << 16,), float(step))
        m.save(step, dict(state, step=step))
    assert [c.step for c in m.checkpoints()] == [steps]
    assert len(m.latest().references) == steps - 1
    return url, m


def test_a_cleanup_heads_no_retired_step_older_than_the_stale_one(store_faults):
    """A crashed save's step past an incremental run's retired ones: only later steps can read
    a step's objects (a record referring to a step not before its own is damaged), so the
    cleanup asks whether a listing hid a record (a HEAD) of the stale step alone, not of every
    retired step (it asked 5 here: each retired step's and the stale one's twice)."""
    f = store_faults
    url, _ = _run_of_retired_steps(f, 4)
    f.put_raw(f"{url}/{step_dirname(5)}/state.ckpt", b"a crashed save's")
    f.clear_counts()
    ObjectRun(url, f.options).cleanup(NOW)
    assert f.count(*f.op("head", "COMMIT")) == 1, f.requests()
    assert f.count(*f.op("head", f"{step_dirname(5)}/COMMIT")) == 1
    left = f.keys(url)
    assert not any(k.startswith(step_dirname(5)) for k in left)
    assert {f"{step_dirname(s)}/state.ckpt" for s in (1, 2, 3, 4)} <= left


def test_a_cleanup_reads_no_record_again_that_a_damaged_step_showed(store_faults):
    """A step the listing shows damaged (a file its record names is missing): its record, read
    for its status, says what it refers to; the cleanup keeps those objects without a second
    GET of it."""
    f = store_faults
    url, m = _run_of_retired_steps(f, 3)
    f.put_raw(f"{url}/{step_dirname(4)}/state.ckpt", b"a crashed save's")
    f.hide_listed(f"run/{step_dirname(3)}/state.ckpt")  # step 3 damaged: step 1 and 2 unreferenced
    run = ObjectRun(url, f.options)
    found = run.listing()
    statuses = run.statuses(found)
    assert [s.step for s in statuses if s.damaged] == [3]
    f.clear_counts()
    run.cleanup(NOW, found=found)
    f.clear_rules()
    assert f.count(*f.op("read", "COMMIT")) == 0, f.requests()
    left = f.keys(url)
    assert not any(k.startswith(step_dirname(4)) for k in left)
    assert {f"{step_dirname(s)}/state.ckpt" for s in (1, 2, 3)} <= left
    assert torch.equal(m.load(3)["frozen1"], torch.full((1 << 16,), 1.0))


def _listings_of_run(faults, run: str) -> int:
    """Listings of exactly the prefix `run` (not of a step's) since clear_counts."""
    want = f"prefix={faults.key(run + '/').replace('/', '%2F')}"
    method, listing = faults.op("list")
    return sum(1 for m, t in faults.requests() if m == method and hit(listing, t) and _ends(t, want))


def _ends(target: str, want: str) -> bool:
    at = target.find(want)
    return at >= 0 and target[at + len(want) : at + len(want) + 1] in ("", "&")


def _pass(archiver: Archiver) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        archiver.kick()
        archiver.wait(timeout=120)


def test_an_archive_pass_that_judged_every_marker_lists_the_archive_no_third_time(store_faults, tmp_path):
    """A dead copy's marker in a complete archive step is judged by the pass's first removal
    (the step swept, the marker deleted): nothing is left for a second removal after the copy
    (it listed the archive a third time)."""
    from ckptfmt.engine import commit
    from ckptfmt.runs.objectnames import COPY_MARKER

    f = store_faults
    url = f"{f.new_root()}/archive"
    run = ObjectRun(url, f.options)
    local = ckptfmt.CheckpointManager(tmp_path / "local", keep_last=10)
    local.save(1, {"w": torch.full((100,), 1.0)})
    archivecopy.put_step(run, 1, local.checkpoints()[-1].path)
    dead = f"{COPY_MARKER}{commit.owner_token()}.0badcafe"  # this process's, never claimed
    f.put_raw(f"{url}/{step_dirname(1)}/{dead}", b"")
    local.save(2, {"w": torch.full((100,), 2.0)})
    archiver = Archiver(run, keep_last=None, keep_every=None, local_steps=local.checkpoints)
    f.clear_counts()
    _pass(archiver)
    assert _listings_of_run(f, "archive") == 2, "\n".join(m + " " + t for m, t in f.requests())
    assert archiver.failures() == {}
    assert [c.step for c in run.checkpoints()] == [1, 2]
    assert dead not in f.keys(f"{url}/{step_dirname(1)}")


@pytest.mark.parametrize("kind", ["s3"])
def test_a_commits_cleanup_of_crashed_uploads_lists_only_the_record(kind, s3_faults):
    """The uploads a step's commit aborts are judged by its record's Last-Modified, asked of a
    listing of the record's key alone: a step of many rank files is not listed whole (it was,
    one page a thousand objects)."""
    from ckptfmt.runs.stepplace import StepPlace
    from ckptfmt.storage.urls import parse_url

    bucket = s3_faults.new_bucket()
    c = s3_faults.client()
    for i in range(3):
        c.put_object(
            Bucket=bucket, Key=f"run/{step_dirname(1)}/rank-{i:05d}.0123456789abcdef.ckpt", Body=b"x"
        )
    c.put_object(Bucket=bucket, Key=f"run/{step_dirname(1)}/COMMIT", Body=b"r")
    c.create_multipart_upload(Bucket=bucket, Key=f"run/{step_dirname(1)}/rank-00007.0123456789abcdef.ckpt")
    s3_faults.clear_counts()
    place = StepPlace(parse_url(f"s3://{bucket}/run/{step_dirname(1)}"), s3_faults.storage_options(), 1)
    place.remove_leftovers()
    lists = [t for m, t in s3_faults.requests() if m == "GET" and "list-type=2" in t]
    assert len(lists) == 1 and "COMMIT" in lists[0], s3_faults.requests()
    # moto says every upload began in 2010: a crashed saver's by the record's time, aborted
    assert s3_faults.count("DELETE", "uploadId=") == 1, s3_faults.requests()


def test_an_age_counts_the_stamps_rounding_against_a_real_bound_only():
    """A store that cuts a Last-Modified down to the whole second makes an object look up to a
    second older: a real bound (a day) is passed only by a second more, so that a step written
    a day ago less that second is not stale (it was); a bound of 0 still means "written
    before now", so a cleaner told to take everything takes what was written just now."""
    from ckptfmt.runs.objectnames import (
        COPY_MARKER,
        SWEEP_MARKER,
        SWEEP_WAIT,
        aged_past,
        marker_dead,
        stale,
    )
    from ckptfmt.storage.listing import Listed

    at = datetime.datetime(2026, 1, 2, 12, 0, 0, tzinfo=datetime.timezone.utc)
    day, half = datetime.timedelta(days=1), datetime.timedelta(milliseconds=500)
    step = {"state.ckpt": Listed(1, at - day - half, "v")}
    assert not stale(step, day, at)
    assert stale({"state.ckpt": Listed(1, at - day - 2 * half - half, "v")}, day, at)
    assert stale({"state.ckpt": Listed(1, at - datetime.timedelta(milliseconds=1), "v")}, NOW, at)
    assert not stale({"state.ckpt": Listed(1, at, "v")}, NOW, at)
    assert aged_past(at, at - datetime.timedelta(milliseconds=1), datetime.timedelta(seconds=-1))
    # another host's markers: a copy's past STALE_AFTER, a sweep's past SWEEP_WAIT, each by a second more
    foreign = "f" * 16 + ".1.0.0badcafe"
    assert not marker_dead(COPY_MARKER + foreign, at - day - half, NOW, at)
    assert marker_dead(COPY_MARKER + foreign, at - day - 3 * half, NOW, at)
    sweep = at - datetime.timedelta(seconds=SWEEP_WAIT) - half
    assert not marker_dead(SWEEP_MARKER + foreign, sweep, NOW, at)
    assert marker_dead(SWEEP_MARKER + foreign, sweep - 2 * half, NOW, at)


def test_a_rotation_heads_no_retired_step_older_than_those_it_drops(store_faults):
    """An incremental run keeping its last step: each save's rotation drops the step before,
    and only later steps can read a dropped step's objects, so no retired older step is asked
    whether a listing hid its record (every save asked each retired step's: a HEAD each)."""
    f = store_faults
    url, m = _run_of_retired_steps(f, 4)
    f.clear_counts()
    m.save(5, {"frozen1": torch.full((1 << 16,), 1.0), "step": 5})
    assert f.count(*f.op("head", "COMMIT")) == 0, f.requests()
    assert [c.step for c in m.checkpoints()] == [5]
    assert f"{step_dirname(1)}/state.ckpt" in f.keys(url)  # read by step 5


def test_removing_a_step_heads_no_retired_step_older_than_it(store_faults):
    """remove(step) asks whether a listing hid a record (a HEAD) only of steps after it."""
    f = store_faults
    url, m = _run_of_retired_steps(f, 4)
    m.save(5, {"frozen1": torch.full((1 << 16,), 1.0), "step": 5})
    f.clear_counts()
    m.remove(5)
    assert f.count(*f.op("head", "COMMIT")) == 0, f.requests()
    assert not any(k.startswith(step_dirname(5)) for k in f.keys(url))


def _misstated_record(run: ObjectRun, step: int):
    """`run`'s listing as a lying store gives it: step `step`'s record listed above the size
    limit, which makes the step damaged."""
    found = run.listing()
    entry = found[step][multifile.COMMIT_NAME]
    found[step][multifile.COMMIT_NAME] = entry._replace(size=multifile.MAX_RECORD_BYTES + 1)
    assert [s.step for s in run.statuses(found) if s.damaged] == [step]
    return found


def test_a_record_listed_past_its_size_limit_still_keeps_what_it_reads(store_faults):
    """Its references are read from the record as the store has it: a cleanup that took the
    misstated listing's word deleted the retired steps step 3 reads."""
    url, _ = _run_of_retired_steps(store_faults, 3)
    run = ObjectRun(url, store_faults.options)
    run.cleanup(NOW, found=_misstated_record(run, 3))
    left = store_faults.keys(url)
    assert {f"{step_dirname(s)}/state.ckpt" for s in (1, 2)} <= left, sorted(left)
    loaded = CheckpointManager(url, storage_options=store_faults.options).load(3)
    assert torch.equal(loaded["frozen1"], torch.full((1 << 16,), 1.0))


def test_a_record_listed_past_its_size_limit_keeps_a_dead_copys_prefix_it_reads(store_faults, monkeypatch):
    url, _ = _run_of_retired_steps(store_faults, 3)
    store_faults.put_raw(f"{url}/{step_dirname(1)}/{COPY_MARKER}{commit.owner_token()}.0badcafe", b"")
    monkeypatch.setattr(storeclock, "stale_objects", lambda *a, **k: True)  # a day old
    run = ObjectRun(url, store_faults.options)
    assert run.remove_interrupted_copies(found=_misstated_record(run, 3)) == []
    assert f"{step_dirname(1)}/state.ckpt" in store_faults.keys(url)


def test_what_an_archive_pass_first_rotation_drops_is_swept_in_that_pass(store_faults, monkeypatch):
    """A rotation an earlier process left unfinished, finished by the pass's first rotation,
    drops step 1: the dead copy marker left in it goes in the same pass, not the next one."""
    f = store_faults
    url = f"{f.new_root()}/archive"
    inc = CheckpointManager(url, incremental=True, storage_options=f.options)
    frozen = torch.full((1 << 16,), 7.0)
    inc.save(1, {"frozen": frozen})
    inc.save(2, {"frozen": frozen, "x": torch.ones(3)})
    CheckpointManager(url, storage_options=f.options).save(3, {"other": torch.full((1 << 16,), 3.0)})
    run = ObjectRun(url, f.options)
    run.retire_step(1)  # a rotation cut short: step 1's record gone, step 2 still reads it
    f.put_raw(f"{url}/{step_dirname(1)}/{COPY_MARKER}{commit.owner_token()}.0badcafe", b"")
    monkeypatch.setattr(storeclock, "stale_objects", lambda *a, **k: True)  # a day old
    archiver = Archiver(run, keep_last=1, keep_every=None, local_steps=lambda: [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        archiver.kick()
        archiver.wait(timeout=120)
    assert [c.step for c in run.checkpoints()] == [3]
    assert not {k for k in f.keys(url) if k.startswith(step_dirname(1))}


def test_a_damaged_steps_junk_record_is_read_again_once_not_by_every_cleanup(store_faults):
    """A record refused as listed is read once more by the store's size (a listing may misstate
    it), and that reading is kept while the listing shows the record unchanged."""
    f = store_faults
    url = f"{f.new_root()}/run"
    CheckpointManager(url, storage_options=f.options).save(1, {"w": torch.ones(10)})
    run = ObjectRun(url, f.options)
    f.put_raw(f"{url}/{step_dirname(3)}/state.ckpt", b"x" * 100)
    f.put_raw(f"{url}/{step_dirname(3)}/COMMIT", b"not a record")
    reads = []
    for _ in range(3):
        f.put_raw(f"{url}/{step_dirname(2)}/state.ckpt", b"a crashed save's")  # a stale commit-less step
        found = run.listing()
        assert [s.step for s in run.statuses(found) if s.damaged] == [3]
        f.clear_counts()
        run.cleanup(NOW, found=found)
        reads.append(f.count(*f.op("read", "COMMIT")))
    assert reads[1:] == [0, 0], reads

"""CheckpointManager("s3://bucket/run"): a run on an object store (a real moto S3 server over
HTTP) with the local manager's guarantees: commit record last, latest() never incomplete,
rotation, resume, verify, non-blocking saves in order, failed saves leave nothing committed."""

from __future__ import annotations

import time

import pytest
import torch
from s3_faults import hit

import ckptfmt
from ckptfmt.errors import StorageError


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((5000,), float(step)), "step": step}


def test_a_run_on_the_store_saves_rotates_and_resumes(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/runs/a"
    m = ckptfmt.CheckpointManager(url, keep_last=2, storage_options=options)
    assert isinstance(m, ckptfmt.CheckpointManager) and repr(m) == f"CheckpointManager({url!r})"
    for step in (1, 2, 3, 4):
        m.save(step, _state(step), metrics={"loss": 1.0 / step})
    assert [c.step for c in m.checkpoints()] == [3, 4]
    info = m.latest()
    assert info is not None and info.step == 4 and info.metrics == {"loss": 0.25}
    assert m.load()["step"] == 4 and m.load(step=3)["step"] == 3
    target = {"w": torch.zeros(5000), "step": 0}
    assert m.load_into(target).step == 4 and torch.equal(target["w"], torch.full((5000,), 4.0))
    assert m.verify().ok
    with pytest.raises(ValueError, match="not after the newest"):
        m.save(4, _state(4))
    m.remove(3)
    assert [c.step for c in m.checkpoints()] == [4]


def test_non_blocking_saves_commit_in_order(s3_bucket):
    bucket, options = s3_bucket
    m = ckptfmt.CheckpointManager(f"s3://{bucket}/nb", blocking=False, storage_options=options)
    handles = [m.save(step, _state(step)) for step in (5, 6, 7)]
    m.wait()
    assert all(h is not None and h.done() for h in handles)
    assert [c.step for c in m.checkpoints()] == [5, 6, 7]
    assert m.load()["step"] == 7


def test_a_step_without_its_record_is_never_latest(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/inc"
    m = ckptfmt.CheckpointManager(url, storage_options=options)
    m.save(1, _state(1))
    ckptfmt.save({"state": _state(2)}, f"{url}/step-000000002/state.ckpt", storage_options=options)
    with pytest.warns(ckptfmt.CheckpointWarning, match="no commit record"):
        assert m.latest().step == 1
    m.save(3, _state(3))  # step 2 is left alone: it is younger than a crashed saver's leftovers
    assert [c.step for c in m.checkpoints()] == [1, 3]


def test_a_failed_commit_leaves_no_checkpoint(store_faults):
    options = store_faults.options | {"max_attempts": 1}
    m = ckptfmt.CheckpointManager(f"{store_faults.new_root()}/f", storage_options=options)
    m.save(1, _state(1))
    # a 503 (throttled) refuses the write; a 500 may come after it was done (below)
    store_faults.fail_next(*store_faults.op("write", "COMMIT"), status=503, count=3)
    with pytest.raises(StorageError, match="COMMIT"):
        m.save(2, _state(2))
    store_faults.clear_rules()
    assert [s.step for s in m.statuses()] == [1]  # the failed step's objects are gone
    assert m.load()["step"] == 1


def test_a_commit_answered_500_keeps_what_its_record_would_name(store_faults):
    # a store (or a proxy before it) may answer 500 after the write is done: the record may
    # be there, or land yet, so the state object it names stays
    options = store_faults.options | {"max_attempts": 1}
    url = f"{store_faults.new_root()}/f"
    m = ckptfmt.CheckpointManager(url, storage_options=options)
    m.save(1, _state(1))
    store_faults.fail_next(*store_faults.op("write", "COMMIT"), status=500, count=3)
    with pytest.raises(StorageError, match="COMMIT"):
        m.save(2, _state(2))
    store_faults.clear_rules()
    assert any(k.startswith("step-000000002/state") for k in store_faults.keys(url))
    assert m.load()["step"] == 1


def test_the_archive_of_a_tiered_run_is_a_run(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    local = ckptfmt.CheckpointManager(tmp_path / "r", archive=f"s3://{bucket}/t", storage_options=options)
    local.save(11, _state(11))
    local.wait()
    remote = ckptfmt.CheckpointManager(f"s3://{bucket}/t", storage_options=options)
    assert [c.step for c in remote.checkpoints()] == [11]
    assert remote.load()["step"] == 11
    assert remote.verify(11).ok


def test_refused_combinations(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/x"
    with pytest.raises(ValueError, match="archive"):
        ckptfmt.CheckpointManager(url, archive=f"s3://{bucket}/y", storage_options=options)
    with pytest.raises(ValueError, match="need archive="):
        ckptfmt.CheckpointManager("/tmp/ckptfmt-no-archive", storage_options=options)


def _run_of_three(faults) -> ckptfmt.CheckpointManager:
    url = f"{faults.new_root()}/run"
    m = ckptfmt.CheckpointManager(url, storage_options=faults.options)
    for step in (1, 2, 3):
        m.save(step, {"w": torch.full((100,), float(step))})
    return m


def _listings_of(faults, prefix: str) -> int:
    """Listings of exactly the run's prefix `prefix` seen since clear_counts."""
    want = f"prefix={prefix.replace('/', '%2F')}%2F&"
    method, listing = faults.op("list")
    return sum(1 for m, t in faults.requests() if m == method and hit(listing, t) and want in t)


def test_a_save_lists_the_run_once_and_rotation_once_more(store_faults, tmp_path):
    """A save on a store lists the run once for its preparation and the cleanup of stale steps
    (the same moment's listing serves both), and once more for the rotation after the commit
    (the run has changed since: the commit, maybe other writers), only where a rule may delete
    a step.  A tiered run's archive pass lists the archive once for its cleanup of interrupted
    copies, its listing and its first rotation, and once more for the rotation right before the
    copy's commit record.  (They listed 3 and 5 times.)"""
    root, options = store_faults.new_root(), store_faults.options
    for rules, per_save in (({}, 1), ({"keep_last": 2}, 2)):
        m = ckptfmt.CheckpointManager(f"{root}/r{per_save}", storage_options=options, **rules)
        for step in (1, 2):
            store_faults.clear_counts()
            m.save(step, _state(step))
            assert _listings_of(store_faults, f"r{per_save}") == per_save, (rules, store_faults.requests())
    tiered = ckptfmt.CheckpointManager(
        tmp_path / "run",
        keep_last=1,
        archive=f"{root}/archive",
        archive_keep_last=3,
        storage_options=options,
    )
    for step in (1, 2):
        store_faults.clear_counts()
        tiered.save(step, _state(step))
        tiered.wait()
        assert _listings_of(store_faults, "archive") == 2, store_faults.requests()
    assert [c.step for c in tiered.archive.checkpoints()] == [1, 2]
    assert [c.step for c in m.checkpoints()] == [1, 2]


def test_listing_a_run_reads_each_commit_record_with_one_get(store_faults):
    f = store_faults
    m = _run_of_three(f)
    m = ckptfmt.CheckpointManager(m.directory, storage_options=m.run.options)  # another process's
    f.clear_counts()
    assert [s.step for s in m.statuses() if s.info is not None] == [1, 2, 3]
    assert f.count(*f.op("read", "COMMIT")) == 3
    assert f.count(*f.op("head", "COMMIT")) == 0
    # listed again unchanged (records are create-only): known, not read again
    store_faults.clear_counts()
    assert [s.step for s in m.statuses() if s.info is not None] == [1, 2, 3]
    assert f.count(*f.op("read", "COMMIT")) == 0
    # a connection dropped in the middle of a record's body is tried again
    store_faults.clear_counts()
    f.reset_on(*f.op("read", "step-000000002/COMMIT"), download_bytes=100)
    assert m.run.record(2).step == 2
    assert f.count(*f.op("read", "step-000000002/COMMIT")) == 2


def test_a_trickling_commit_record_is_cut_off_at_the_request_deadline(store_faults):
    """A record's body that trickles in is bounded by request_timeout as a ranged GET is:
    tried again, then a StorageError naming the record and the option, in about attempts x
    timeout; a record that trickles once is read on the next try."""
    f = store_faults
    url = f"{f.new_root()}/run"
    options = f.options | {"request_timeout": 0.5, "max_attempts": 2}
    m = ckptfmt.CheckpointManager(url, storage_options=options)
    m.save(1, {"w": torch.ones(100)})
    f.trickle(*f.op("read", "step-000000001/COMMIT"), after_bytes=10, interval=0.2)
    started = time.monotonic()
    with pytest.raises(
        StorageError, match=r"did not arrive within 0.5 s \(storage option request_timeout\)"
    ) as e:
        m.run.record(1)
    assert time.monotonic() - started < 5
    assert e.value.path.endswith("/step-000000001/COMMIT")
    f.clear_rules()
    f.trickle(*f.op("read", "step-000000001/COMMIT"), after_bytes=10, interval=0.2, count=1)
    assert m.run.record(1).step == 1
    assert f.pending_rules() == 0


def test_an_oversized_commit_record_on_the_store_is_refused_before_it_is_read(store_faults, monkeypatch):
    from ckptfmt.files import multifile

    m = _run_of_three(store_faults)
    m = ckptfmt.CheckpointManager(m.directory, storage_options=m.run.options)  # reads afresh
    monkeypatch.setattr(multifile, "MAX_RECORD_BYTES", 100)
    store_faults.clear_counts()
    with pytest.raises(ckptfmt.LimitError, match="the commit record is .* bytes, above the limit 100") as e:
        m.run.record(2)  # its size unknown: the GET's answer says it
    assert e.value.path.endswith("/step-000000002/COMMIT")
    assert store_faults.count(*store_faults.op("read", "COMMIT")) == 1
    statuses = m.statuses()  # the listing's sizes: refused unread
    assert all(s.damaged and "exceeds the limit" in s.problem for s in statuses)


def test_a_step_past_the_records_read_is_not_removed(store_faults, monkeypatch):
    """remove(step) of a step older than the newest MAX_STATUS_RECORDS records: what the unread
    steps refer to is unknown, so it is refused (LimitError) and nothing is deleted."""
    from ckptfmt.runs import objectrun

    m = _run_of_three(store_faults)
    with monkeypatch.context() as patched:  # the store's environment stays
        patched.setattr(objectrun, "MAX_STATUS_RECORDS", 1)
        with pytest.raises(ckptfmt.LimitError, match="not removed"):
            m.remove(1)
    assert [c.step for c in m.checkpoints()] == [1, 2, 3]
    m.remove(1)
    assert [c.step for c in m.checkpoints()] == [2, 3]


def test_a_step_listing_an_object_without_a_time_is_never_stale():
    """objectnames.stale: an entry listed without a time could be a live saver's newest
    object: the prefix is not stale (the safe side), whatever the others' ages."""
    import datetime

    from ckptfmt.runs.objectnames import stale
    from ckptfmt.storage.listing import Listed

    now = datetime.datetime.now(datetime.timezone.utc)
    old = Listed(1, now - datetime.timedelta(days=3), "v1")
    hour = datetime.timedelta(hours=1)
    assert stale({"a.ckpt": old}, hour, now)
    assert not stale({"a.ckpt": old, "b.ckpt": Listed(1, None, "v2")}, hour, now)
    assert not stale({}, hour, now) and not stale({"a.ckpt": old}, hour, None)

"""Tiered runs: a local CheckpointManager whose committed steps are copied to an object-store
archive (a real moto S3 server over HTTP), each tier with its own retention; a new node
resumes from the archive; a damaged local copy is read from the archive; an archive that
fails costs no step."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CheckpointWarning
from ckptfmt.runs.objectrun import ObjectRun
from ckptfmt.storage import listing


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def _manager(tmp_path, bucket, options, **kw):
    return ckptfmt.CheckpointManager(
        tmp_path / "run", archive=f"s3://{bucket}/run", storage_options=options, **kw
    )


def test_each_tier_keeps_by_its_own_rules(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    m = _manager(tmp_path, bucket, options, keep_last=1, archive_keep_last=3)
    for step in range(1, 6):
        m.save(step, _state(step))
        m.wait()  # an archive that keeps up (one that lags may skip steps no rule keeps)
    assert [c.step for c in m.checkpoints()] == [5]
    assert [c.step for c in m.archive.checkpoints()] == [3, 4, 5]
    assert m.archive_failures() == {}
    assert (
        ckptfmt.load(f"s3://{bucket}/run/step-000000004/state.ckpt", storage_options=options)["state"]["step"]
        == 4
    )


def test_a_new_node_resumes_from_the_archive(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    m = _manager(tmp_path, bucket, options, keep_last=2, blocking=False)
    for step in (10, 20, 30):
        m.save(step, _state(step))
    m.wait()
    fresh = _manager(tmp_path / "new-node", bucket, options)
    assert fresh.checkpoints() == []  # nothing on this node's disk
    latest = fresh.latest()
    assert latest is not None and latest.step == 30 and latest.path.startswith("s3://")
    assert fresh.load()["step"] == 30
    target = {"w": torch.zeros(1000), "step": 0}
    report = fresh.load_into(target)
    assert report.step == 30 and torch.equal(target["w"], torch.full((1000,), 30.0)) and target["step"] == 30
    assert fresh.load(step=20)["step"] == 20


def test_a_damaged_local_copy_is_read_from_the_archive(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    m = _manager(tmp_path, bucket, options)
    m.save(1, _state(1))
    m.wait()
    state_file = tmp_path / "run" / "step-000000001" / "state.ckpt"
    data = bytearray(state_file.read_bytes())
    data[100] ^= 0x40  # inside the first chunk: the record still names the file
    state_file.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match="reading the archived copy"):
        assert m.load()["step"] == 1
    with pytest.warns(CheckpointWarning, match="reading the archived copy"):
        assert m.load(step=1)["step"] == 1


def test_an_archive_that_fails_costs_no_step(tmp_path, s3_faults):
    options = s3_faults.storage_options() | {"max_attempts": 1}
    bucket = s3_faults.new_bucket()
    m = _manager(tmp_path, bucket, options, keep_last=1)
    s3_faults.fail_next("PUT", "", status=503, code="SlowDown", count=1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            m.save(step, _state(step))  # saves never wait for, nor fail with, the archive
        m.wait()
    assert any("archiving step" in str(w.message) for w in caught)
    assert 3 in m.archive_failures()  # each pass tries the newest step first, and stops at a failure
    assert [c.step for c in m.checkpoints()] == [1, 2, 3]  # kept locally until archived
    s3_faults.clear_rules()
    m.save(4, _state(4))
    m.wait()
    assert m.archive_failures() == {}
    assert [c.step for c in m.archive.checkpoints()] == [1, 2, 3, 4]
    assert [c.step for c in m.checkpoints()] == [4]


def test_the_archive_reads_as_a_run(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    m = _manager(tmp_path, bucket, options)
    m.save(7, _state(7), metrics={"loss": 0.5})
    m.wait()
    run = ObjectRun(f"s3://{bucket}/run", options)
    (info,) = run.checkpoints()
    assert info.step == 7 and info.metrics == {"loss": 0.5} and info.size > 4000
    report = run.verify_step(info)
    assert report.ok and report.chunks >= 1 and report.bytes_checked > 4000


def test_hostile_and_partial_archive_contents(tmp_path, s3_bucket):
    """Keys that are not steps are ignored, a commit-less step is incomplete, a record for
    another step or a missing file makes the step damaged, and none of them is loaded."""
    bucket, options = s3_bucket
    m = _manager(tmp_path, bucket, options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    m.wait()
    from s3_server import s3_client

    c = s3_client(options["endpoint_url"])
    commit1 = c.get_object(Bucket=bucket, Key="run/step-000000001/COMMIT")["Body"].read()
    c.put_object(Bucket=bucket, Key="run/step-000000003/COMMIT", Body=commit1)  # step 1's record
    c.put_object(Bucket=bucket, Key="run/step-000000003/state.ckpt", Body=b"x")
    c.put_object(Bucket=bucket, Key="run/step-000000004/state.ckpt", Body=b"half")  # no record
    c.put_object(Bucket=bucket, Key="run/../evil/COMMIT", Body=b"x")
    c.put_object(Bucket=bucket, Key="run/step-x/COMMIT", Body=b"x")
    c.delete_object(Bucket=bucket, Key="run/step-000000002/state.ckpt")
    statuses = {s.step: s for s in m.archive.statuses()}
    assert set(statuses) == {1, 2, 3, 4}
    assert statuses[1].info is not None
    assert statuses[2].info is None and "missing" in statuses[2].problem
    assert statuses[3].info is None and "for step 1, not 3" in statuses[3].problem
    assert statuses[4].info is None and "no commit record" in statuses[4].problem
    fresh = _manager(tmp_path / "other", bucket, options)
    assert fresh.latest().step == 1
    assert fresh.load()["step"] == 1


def test_stale_uploads_and_commitless_steps_are_cleaned(s3_bucket):
    bucket, options = s3_bucket
    from s3_server import s3_client

    c = s3_client(options["endpoint_url"])
    c.create_multipart_upload(Bucket=bucket, Key="run/step-000000009/state.ckpt")
    c.put_object(Bucket=bucket, Key="run/step-000000009/state.ckpt", Body=b"x")  # a crashed save's
    c.put_object(Bucket=bucket, Key="run/step-000000009/notes.txt", Body=b"x")  # not ckptfmt's
    c.create_multipart_upload(Bucket=bucket, Key="elsewhere/x.ckpt")  # outside the run
    run = ObjectRun(f"s3://{bucket}/run", options)
    # moto reports every upload as begun in 2010: old enough for any limit
    run.cleanup(older_than=datetime.timedelta(hours=1))
    assert [u["Key"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == [
        "elsewhere/x.ckpt"
    ]
    written_now = {"step-000000009/state.ckpt", "step-000000009/notes.txt"}
    assert set(listing.objects(run.url, options)) == written_now
    run.cleanup(older_than=datetime.timedelta(seconds=-1))  # only what ckptfmt writes goes
    assert set(listing.objects(run.url, options)) == {"step-000000009/notes.txt"}

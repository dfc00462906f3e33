"""Attacks on runs kept on an object store by two writers of one prefix, on the real local S3
server: what a save deletes in a step once it has committed it must never be what another
step's checkpoint reads (spec 13.7)."""

from __future__ import annotations

import threading

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager

WEIGHTS = torch.arange(1 << 14, dtype=torch.float32)


def _state(step: int) -> dict[str, object]:
    return {"w": WEIGHTS.clone(), "step": step}


def _paused_before_commit(manager, step: int, state: dict[str, object]):
    """Start `manager`'s save of `step` on a thread; return once it has uploaded its state
    object and waits to commit: (the thread, its failures, the event that lets it commit)."""
    uploaded, go = threading.Event(), threading.Event()
    failure: list[BaseException] = []
    commit = manager._commit

    def commit_when_told(job):
        uploaded.set()
        assert go.wait(60)
        return commit(job)

    manager._commit = commit_when_told

    def save() -> None:
        try:
            manager.save(step, state)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=save, daemon=True)
    t.start()
    assert uploaded.wait(60)
    return t, failure, go


def _finish(t: threading.Thread, go: threading.Event) -> None:
    go.set()
    t.join(60)
    assert not t.is_alive()


def test_a_late_commit_never_sweeps_the_object_a_later_step_reads(s3_bucket):
    """Job a (incremental, keep_last=1) and job b save step 1 at once: b finds a's state object
    there, so writes one of its own name and waits to commit.  a commits step 1, saves step 2
    (which reads its chunks from a's step-1 object) and retires step 1 (its record deleted,
    the object kept for step 2).  b then commits step 1 (no record is there any more) and
    sweeps what its record does not name: it must leave a's object, which step 2 reads."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    a = CheckpointManager(url, storage_options=options, incremental=True, keep_last=1)
    b = CheckpointManager(url, storage_options=options)
    ta, fa, go_a = _paused_before_commit(a, 1, _state(1))
    tb, fb, go_b = _paused_before_commit(b, 1, _state(-1))
    _finish(ta, go_a)
    assert not fa, fa
    a._commit = type(a)._commit.__get__(a)
    a.save(2, _state(2))
    assert CheckpointManager(url, storage_options=options).checkpoints()[-1].references  # reads step 1
    _finish(tb, go_b)
    fresh = CheckpointManager(url, storage_options=options)
    assert fresh.verify(2).ok
    got = fresh.load(2)
    assert got["step"] == 2 and torch.equal(got["w"], WEIGHTS)


FULL = torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256)


def _dcp_jobs_race_for_step_1(rank: int, world: int, url: str, options: dict[str, str]) -> dict[str, object]:
    """On each of 2 ranks: job b readies step 1; job a (incremental, keep_last=1) saves and
    commits step 1, then step 2 (the same shards: it reads step 1's rank files), retiring
    step 1; then job b goes on with its save of step 1 from that preparation."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def state(step: int, sign: int) -> dict[str, object]:
        return {"w": distribute_tensor(FULL * sign, mesh, [Shard(0)]), "step": step}

    a = CheckpointManager(url, storage_options=options, incremental=True, keep_last=1)
    b = CheckpointManager(url, storage_options=options)
    prepared = b._prepare_step(1) if rank == 0 else []
    a.save(1, state(1, 1))
    a.save(2, state(2, 1))
    b._prepare_step = lambda step: prepared  # b's save goes on from its earlier preparation
    lost = None
    try:
        b.save(1, state(1, -1))
    except ckptfmt.CheckpointError as e:
        lost = str(e)
    dist.barrier()
    return {"lost": lost}


def test_a_late_dcp_commit_never_deletes_the_rank_files_a_later_step_reads(tmp_path, s3_bucket):
    """The race above with two jobs of 2 ranks each: job b's coordinator commits step 1 after
    job a retired it, and must leave a's rank files, which a's step 2 reads."""
    from helpers import run_ranks

    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    results = run_ranks(_dcp_jobs_race_for_step_1, 2, tmp_path, url, options)
    assert all("error" not in got for got in results), results
    reader = CheckpointManager(url, storage_options=options)
    assert reader.checkpoints()[-1].step == 2 and reader.checkpoints()[-1].references
    assert reader.verify(2).ok
    full = reader.load(2)
    assert torch.equal(full["w"], FULL) and full["step"] == 2


def test_a_copy_cut_short_on_another_host_does_not_stop_the_next_copy_of_the_step(tmp_path, s3_bucket):
    """An archive copy of step 5 died on another node (a restarted container: its copy marker
    cannot be judged dead before a day) after uploading the state object, before the record.
    The next process's copy of the same step finds that object, the very file it is copying
    (created only if absent, it is not uploaded again): it checks it as it checks its own
    upload and commits the step, instead of failing every pass for a day."""
    import warnings

    from s3_server import s3_client

    from ckptfmt.runs.objectrun import ObjectRun

    bucket, options = s3_bucket
    run_dir = tmp_path / "run"
    saved = _state(5)
    CheckpointManager(run_dir).save(5, saved)
    client = s3_client(options["endpoint_url"])
    step_key = "run/step-000000005"
    client.put_object(Bucket=bucket, Key=f"{step_key}/ARCHIVING.0123456789abcdef.42.77.0badcafe", Body=b"x")
    client.put_object(
        Bucket=bucket, Key=f"{step_key}/state.ckpt", Body=(run_dir / "step-000000005/state.ckpt").read_bytes()
    )
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ckptfmt.CheckpointWarning)
        m = CheckpointManager(run_dir, archive=f"s3://{bucket}/run", storage_options=options)
        m._archiver.kick()
        m._archiver.wait(60)
    assert not [str(w.message) for w in warned if issubclass(w.category, ckptfmt.CheckpointWarning)]
    assert [c.step for c in ObjectRun(f"s3://{bucket}/run", options).checkpoints()] == [5]
    got = CheckpointManager(f"s3://{bucket}/run", storage_options=options).load(5)
    assert got["step"] == 5 and torch.equal(got["w"], saved["w"])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the warning raised
def test_an_archive_pass_that_raises_leaves_the_archiver_idle(tmp_path, s3_bucket):
    """Under warnings turned into errors (a test suite's `-W error`), an archive copy's failure
    warning raises out of the archive thread.  The archiver must not stay busy with a thread
    that is gone: wait() returns at once (not after its hour) and the next save's pass
    archives the step once the store lets it."""
    import time
    import warnings

    from s3_server import s3_client

    from ckptfmt.runs.objectrun import ObjectRun

    bucket, options = s3_bucket
    client = s3_client(options["endpoint_url"])
    # another save's object where step 1's state object goes: the copy of step 1 fails
    client.put_object(Bucket=bucket, Key="run/step-000000001/state.ckpt", Body=b"not this save's")
    m = CheckpointManager(tmp_path / "run", archive=f"s3://{bucket}/run", storage_options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptfmt.CheckpointWarning)
        m.save(1, _state(1))
        began = time.monotonic()
        m._archiver.wait(30)
    assert time.monotonic() - began < 20
    client.delete_object(Bucket=bucket, Key="run/step-000000001/state.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)
        m.save(2, _state(2))
        m._archiver.wait(60)
    assert [c.step for c in ObjectRun(f"s3://{bucket}/run", options).checkpoints()][-1] == 2


_SAVER = """
import json, sys, torch
from ckptfmt import CheckpointManager
url, options, step = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
CheckpointManager(url, storage_options=options).save(step, {"w": torch.full((1000,), float(-step)), "step": -step})
"""


@pytest.mark.filterwarnings("ignore:skipping .*step-000000005:ckptfmt.CheckpointWarning")
@pytest.mark.parametrize("held", ["COMMIT", "sweep"])
def test_a_saver_killed_before_or_after_its_commit_costs_at_most_its_checkpoint(store_faults, held):
    """Step 5 holds a crashed save's state object, so the next save of it names its own.  That
    saver is SIGKILLed while the proxy holds its commit record's PUT (before the commit) or its
    first DELETE in the step (after the commit, before its sweep).  A restart finds either no
    step 5 (and saves it, deleting both leftovers once committed) or step 5 complete (and saves
    step 6); every committed step loads."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    f = store_faults
    url = f"{f.new_root()}/run"
    options = f.options
    f.put_raw(f"{url}/step-000000005/state.ckpt", b"a crashed save's")
    if held == "COMMIT":
        f.delay(*f.op("write", "step-000000005/COMMIT"), seconds=60.0, count=1)
    else:
        f.delay(*f.op("delete", "step-000000005/"), seconds=60.0, count=1)
    env = dict(os.environ, PYTHONPATH=os.getcwd())  # gs and az: their emulator's variables
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, url, json.dumps(options), "5"], env=env)
    try:
        deadline = time.monotonic() + 60
        while f.pending_rules() and time.monotonic() < deadline and saver.poll() is None:
            time.sleep(0.05)
        assert f.pending_rules() == 0 and saver.poll() is None
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.wait(30)
    f.clear_rules()
    restarted = CheckpointManager(url, storage_options=options)
    expected = {5: WEIGHTS, 6: WEIGHTS}
    killed = set() if held == "COMMIT" else {5}  # the killed saver's step 5 committed
    if killed:
        expected[5] = torch.full((1000,), -5.0)
    if held == "COMMIT":
        assert restarted.latest() is None
        restarted.save(5, _state(5))
        keys = f.keys(url)
        named = {f"step-000000005/{name.rsplit('/', 1)[1]}" for name in restarted.latest().files}
        assert keys == {"step-000000005/COMMIT"} | named, keys
    else:
        assert restarted.latest().step == 5
        assert restarted.load(5)["step"] == -5
        restarted.save(6, _state(6))
    fresh = CheckpointManager(url, storage_options=options)
    for c in fresh.checkpoints():
        assert fresh.verify(c.step).ok
        got = fresh.load(c.step)
        assert torch.equal(got["w"], expected[c.step]) and got["step"] == c.step * (
            -1 if c.step in killed else 1
        )


def test_a_base_deleted_before_the_commit_fails_the_save_as_a_checkpoint_error(s3_bucket):
    """Job a's incremental save of step 2 has uploaded its state object (reading chunks from
    step 1's) and waits to commit when another job removes step 1.  a's commit must fail as a
    CheckpointError naming the object its save reads from, not a bare FileNotFoundError, and
    leave no step 2."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    a = CheckpointManager(url, storage_options=options, incremental=True)
    a.save(1, _state(1))
    t, failure, go = _paused_before_commit(a, 2, _state(2))
    CheckpointManager(url, storage_options=options).remove(1)
    _finish(t, go)
    assert len(failure) == 1 and isinstance(failure[0], ckptfmt.CheckpointError), failure
    assert "step-000000001/state.ckpt" in str(failure[0])
    assert CheckpointManager(url, storage_options=options).checkpoints() == []


def _dcp_base_removed_before_the_record(rank: int, world: int, url: str, options: dict[str, str]) -> dict:
    """On each of 2 ranks: an incremental job saves step 1, then step 2 against it; another
    job deletes step 1 once every rank file of step 2 is written, before the coordinator
    writes step 2's record."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptfmt.dcp import storage
    from ckptfmt.runs.objectrun import ObjectRun

    mesh = init_device_mesh("cpu", (world,))
    a = CheckpointManager(url, storage_options=options, incremental=True)
    a.save(1, {"w": distribute_tensor(FULL, mesh, [Shard(0)]), "step": 1})
    finish = storage.Writer._finish

    def another_job_deletes_step_1_first(self, metadata, results):
        ObjectRun(url, options).delete_step(1)
        return finish(self, metadata, results)

    storage.Writer._finish = another_job_deletes_step_1_first  # runs on the coordinator only
    lost = None
    try:
        a.save(2, {"w": distribute_tensor(FULL, mesh, [Shard(0)]), "step": 2})
    except Exception as e:
        lost = f"{type(e).__module__}.{type(e).__name__}: {e}"
    dist.barrier()
    return {"lost": lost}


def test_a_dcp_step_is_never_committed_naming_a_base_that_is_gone(tmp_path, s3_bucket):
    """The coordinator of a save of 2 ranks on a store checks the objects of earlier steps its
    record will name before writing it: a base another job deleted meanwhile fails the save
    (a CheckpointError naming it) instead of committing a step that cannot be loaded."""
    from helpers import run_ranks

    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    results = run_ranks(_dcp_base_removed_before_the_record, 2, tmp_path, url, options)
    assert all("error" not in got for got in results), results
    assert all(
        "ckptfmt.errors." in (got["lost"] or "") and "step-000000001/rank-" in got["lost"] for got in results
    ), results
    reader = CheckpointManager(url, storage_options=options)
    assert [s.step for s in reader.statuses() if s.damaged] == [], reader.statuses()

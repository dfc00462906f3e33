"""Two writers of one step of a run on a store (a restarted job while the old one still runs,
two jobs pointed at one prefix), on each store's emulator (S3, GCS, Azure) behind the fault
proxy, which holds a request where a test needs it: whichever commits first keeps a checkpoint that loads bit-exactly,
whatever the other does.  A step's state object is created only if absent, a save commits
only the version it uploaded, and a failed save deletes only that version."""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch
from s3_faults import hit

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.files.names import STATE_NAME_RE

SMALL = torch.arange(1000, dtype=torch.float32)  # one PUT
LARGE = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: a multipart upload


def _state(step: int, weights: torch.Tensor) -> dict[str, object]:
    return {"w": weights * step, "step": step}


def _keys(client, bucket: str, prefix: str) -> set[str]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :] for o in listed}


#: stores whose emulator checks a delete's condition (fake-gcs-server ignores ifGenerationMatch
#: on a DELETE, which GCS honours: tests/gcs_server.py)
CONDITIONAL_DELETES = pytest.mark.parametrize("store_faults", ["s3", "az"], indirect=True)


def _assert_only_the_committed_step(faults, url: str) -> None:
    """The run `url` holds step 5's record and the one state object it names, nothing else
    (what other saves left there is deleted once the step is committed)."""
    keys = faults.keys(f"{url}/step-000000005/")
    record = CheckpointManager(url, storage_options=faults.options).run.record(5)
    assert keys == {"COMMIT", record.files[0].name}, keys
    assert STATE_NAME_RE.fullmatch(record.files[0].name)
    assert faults.keys(url) == {f"step-000000005/{k}" for k in keys}


def _check_loads(url: str, options: dict, expected: dict[str, object]) -> None:
    fresh = CheckpointManager(url, storage_options=options)
    assert fresh.verify(5).ok
    got = fresh.load(5)
    assert got["step"] == expected["step"] and torch.equal(got["w"], expected["w"])


def _saving(manager, state: dict[str, object]) -> tuple[threading.Thread, list]:
    """`manager`'s save of step 5, started on a thread: (the thread, the list its failure goes into)."""
    failure: list[BaseException] = []

    def save() -> None:
        try:
            manager.save(5, state)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=save, daemon=True)
    t.start()
    return t, failure


def _save_while_held(
    faults, manager, state: dict[str, object], rules_left: int = 0
) -> tuple[threading.Thread, list]:
    """Start `manager`'s save of step 5 on a thread and return once the proxy holds the
    request its rule is waiting for (`rules_left`: the rules set that are to stay unused):
    (the thread, the list its failure goes into)."""
    t, failure = _saving(manager, state)
    deadline = time.monotonic() + 30
    while faults.pending_rules() > rules_left and time.monotonic() < deadline:
        time.sleep(0.02)
    assert faults.pending_rules() == rules_left
    return t, failure


def _save_paused_before_commit(
    manager, state: dict[str, object]
) -> tuple[threading.Thread, list, threading.Event]:
    """Start `manager`'s save of step 5 on a thread and return once its state object is
    uploaded and it waits to commit: (the thread, the list its failure goes into, the event
    that lets it commit)."""
    uploaded, go = threading.Event(), threading.Event()
    commit = manager._commit

    def commit_when_told(job):
        uploaded.set()
        assert go.wait(60)
        return commit(job)

    manager._commit = commit_when_told
    t, failure = _saving(manager, state)
    assert uploaded.wait(60)
    return t, failure, go


@pytest.mark.parametrize(
    "store_faults, weights",
    # not gs with an upload in parts: fake-gcs-server does not check the condition of the
    # compose that ends it, which GCS checks (tests/gcs_server.py); gs's single put is checked
    [("s3", SMALL), ("s3", LARGE), ("gs", SMALL), ("az", SMALL), ("az", LARGE)],
    ids=["s3-put", "s3-multipart", "gs-put", "az-put", "az-multipart"],
    indirect=["store_faults"],
)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_the_losers_state_upload_never_replaces_the_winners(store_faults, weights, blocking):
    """The loser prepared the step before the winner saved it, and uploads its state object
    after the winner's commit: its upload is refused (created only if absent), the winner's
    object stays the one its record names."""
    options = store_faults.options
    url = f"{store_faults.new_root()}/run"
    winner = CheckpointManager(url, storage_options=options)
    loser = CheckpointManager(url, storage_options=options, blocking=blocking)
    won = _state(5, weights)
    prepare = loser._prepare_step

    def prepare_then_lose(step: int):
        statuses = prepare(step)  # the step is new: nothing of it is there yet
        winner.save(step, won)  # the other job saves and commits it meanwhile
        return statuses

    loser._prepare_step = prepare_then_lose
    with pytest.raises(ckptfmt.CheckpointError) as caught:
        handle = loser.save(5, _state(-5, weights))
        if handle is not None:
            handle.wait()
    _check_loads(url, options, won)
    assert isinstance(caught.value, ckptfmt.StorageError) and isinstance(caught.value, FileExistsError)
    assert "exists already" in str(caught.value)


@CONDITIONAL_DELETES
def test_a_failed_saves_cleanup_never_deletes_the_next_writers_object(store_faults):
    """A save whose commit failed deletes the state object it uploaded; its DELETE is held
    while another writer deletes that leftover, saves the step and commits it.  The held
    DELETE then reaches the store: it names the failed save's version, so the committed
    object of the same name stays."""
    f = store_faults
    url = f"{f.new_root()}/run"
    options = f.options
    failing = CheckpointManager(url, storage_options={**options, "max_attempts": 1})
    # a refusal (a 500 may come after the write was done: the save would keep its object)
    f.fail_next(*f.op("write", "step-000000005/COMMIT"), status=503, count=1)
    f.delay(*f.op("delete", "step-000000005/state.ckpt"), seconds=6.0, count=1)
    # until the failed save's DELETE of its state object is being held
    t, failure = _save_while_held(f, failing, _state(-5, SMALL))
    won = _state(5, SMALL)
    CheckpointManager(url, storage_options=options).save(5, won)
    f.release()  # the held DELETE reaches the store now, after the next writer's commit
    t.join(30)
    assert not t.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], ckptfmt.StorageError)
    # the held one did reach the store, after the next writer's (of the leftover it listed)
    assert f.count(*f.op("delete", "step-000000005/state.ckpt")) == 2
    _assert_only_the_committed_step(f, url)
    _check_loads(url, options, won)


def test_a_leftover_is_deleted_only_once_the_step_is_committed(store_faults):
    """A crashed save (or a live one: the store cannot tell) left step 5's state object.  A
    restarted job's save of step 5 writes a state object of its own beside it, commits, and
    only then deletes the leftover, by the version it listed: no DELETE in the step comes
    before its commit record, and the step holds its record and state object alone."""
    f = store_faults
    url = f"{f.new_root()}/run"
    options = f.options
    f.put_raw(f"{url}/step-000000005/state.ckpt", b"a crashed save's")
    f.clear_counts()
    won = _state(5, SMALL)
    CheckpointManager(url, storage_options=options).save(5, won)
    write, _ = f.op("write")
    step = f.key("step-000000005/")
    # (the sweep's own marker, put and deleted around its last listing, is not the step's)
    sent = [(m, t) for m, t in f.requests() if step in t and m in (write, "DELETE") and "SWEEPING." not in t]
    committed = sent.index(next(r for r in sent if hit(f.op("write", "/COMMIT")[1], r[1])))
    assert [m for m, _ in sent[:committed]] == [write], sent  # the state object of its own
    assert sent[committed + 1 :] and all(m == "DELETE" for m, _ in sent[committed + 1 :]), sent
    _assert_only_the_committed_step(f, url)
    _check_loads(url, options, won)


def test_a_save_never_deletes_the_state_object_a_live_writer_commits_meanwhile(store_faults):
    """A live job has uploaded step 5's state object and is about to commit it when another
    job (restarted while the live one still runs) begins its save of step 5 and finds the
    step without a commit record.  The proxy holds the second job's first deletion or state
    upload in the step while the live job commits: the live job's checkpoint loads
    bit-exactly afterwards, the second job's save of the step fails.  (A save's preparation
    used to delete the "leftover" by the version it listed, the live job's committed one.)"""
    f = store_faults
    url = f"{f.new_root()}/run"
    options = f.options
    won = _state(5, SMALL)
    live = CheckpointManager(url, storage_options=options)
    # the live job's state object is there, its record not yet
    live_thread, live_failure, go = _save_paused_before_commit(live, won)
    f.delay(*f.op("delete", "step-000000005/"), seconds=5.0, count=1)
    f.delay(*f.op("write", "step-000000005/state"), seconds=5.0, count=1)
    second = CheckpointManager(url, storage_options=options)
    t, failure = _save_while_held(f, second, _state(-5, SMALL), rules_left=1)
    go.set()  # the live job commits while the second job's request is held
    live_thread.join(30)
    f.clear_rules()  # then the held request goes on, and nothing more is held
    f.release()
    t.join(30)
    assert not live_thread.is_alive() and not t.is_alive()
    assert not live_failure, live_failure
    assert len(failure) == 1 and isinstance(failure[0], ckptfmt.CheckpointError), failure
    _check_loads(url, options, won)


def test_a_save_whose_object_the_winner_deleted_fails_naming_the_other_writer(store_faults):
    """Job a has uploaded step 5's state object and waits to commit it; job b saves step 5 (a
    state object of its own name beside a's), commits, and deletes a's object, which no record
    can name any more.  Job a's commit then fails as a CheckpointError that says so, and b's
    step loads bit-exactly, its record and state object alone in the step."""
    options = store_faults.options
    url = f"{store_faults.new_root()}/run"
    t, failure, go = _save_paused_before_commit(
        CheckpointManager(url, storage_options=options), _state(-5, SMALL)
    )
    won = _state(5, SMALL)
    CheckpointManager(url, storage_options=options).save(5, won)
    go.set()
    t.join(30)
    assert not t.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], ckptfmt.CheckpointError), failure
    assert "another writer" in str(failure[0])
    _check_loads(url, options, won)
    record = CheckpointManager(url, storage_options=options).run.record(5)
    keys = store_faults.keys(f"{url}/step-000000005/")
    assert keys == {"COMMIT", record.files[0].name} and record.files[0].name != "state.ckpt"


FULL = torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256)


def _two_jobs_race_for_step_5(rank: int, world: int, url: str, options: dict[str, str]) -> dict[str, object]:
    """On each of 2 ranks: job b readies step 5 (it is empty), job a saves and commits it, then
    job b goes on with its save from that preparation."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def state(sign: int) -> dict[str, object]:
        return {"w": distribute_tensor(FULL * sign, mesh, [Shard(0)]), "step": 5 * sign}

    a = CheckpointManager(url, storage_options=options)
    b = CheckpointManager(url, storage_options=options)
    prepared = b._prepare_step(5) if rank == 0 else []
    a.save(5, state(1))
    b._prepare_step = lambda step: prepared  # b's save goes on from its earlier preparation
    lost = None
    try:
        b.save(5, state(-1))
    except ckptfmt.CheckpointError as e:
        lost = str(e)
    dist.barrier()
    return {"lost": lost}


def test_two_jobs_of_two_ranks_never_replace_each_others_step(tmp_path, s3_bucket):
    """Two jobs of 2 ranks each save step 5 of one run on a store; the second readied the step
    before the first committed it.  Its ranks write rank files of its own names and its record
    loses (created only if absent): the first job's step loads bit-exactly, and the second's
    rank files are gone from it.  (Its coordinator used to withdraw the first job's record and
    its ranks wrote over the first job's rank files, then committed its own step.)"""
    from helpers import run_ranks
    from s3_server import s3_client

    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    results = run_ranks(_two_jobs_race_for_step_5, 2, tmp_path, url, options)
    assert all("error" not in got for got in results), results
    reader = CheckpointManager(url, storage_options=options)
    assert reader.verify(5).ok
    full = reader.load(5)
    assert torch.equal(full["w"], FULL) and full["step"] == 5
    assert all(got["lost"] is not None for got in results), results
    named = {p.name for p in reader.run.record(5).files}
    assert _keys(s3_client(options["endpoint_url"]), bucket, "run/step-000000005/") == named | {"COMMIT"}


def test_two_archivers_of_one_step_never_replace_each_others_objects(tmp_path, s3_bucket):
    """Two jobs archive their own step 5 to one archive.  The second's copy runs while the
    first's is about to upload its commit record (its files uploaded and verified): it finds
    the step's prefix holding objects and writes its state file under a name of its own,
    then stops before its record (its job has not committed): that object is deleted (by its
    version), the first's step loads bit-exactly from the archive, and a later copy of the
    second's step 5 is refused.  (The second's upload used to replace the first's state
    object, which the first's record then named by the old file id: a damaged step.)"""
    from ckptfmt.runs.archivecopy import put_step
    from ckptfmt.runs.objectnames import copy_marker
    from ckptfmt.runs.objectrun import ObjectRun

    bucket, options = s3_bucket
    saved = {}
    for job, sign in (("a", 1), ("b", -1)):
        saved[job] = _state(5 * sign, SMALL)
        CheckpointManager(str(tmp_path / job)).save(5, saved[job])
    archive = ObjectRun(f"s3://{bucket}/archive", options)
    second: list[BaseException] = []

    def b_stops_before_its_record(record) -> None:
        raise RuntimeError("job b has not committed yet")

    def b_copies_meanwhile(record) -> None:
        try:
            put_step(
                archive,
                5,
                str(tmp_path / "b" / "step-000000005"),
                claim=copy_marker(),
                before_commit=b_stops_before_its_record,
            )
        except Exception as e:
            second.append(e)

    put_step(
        archive,
        5,
        str(tmp_path / "a" / "step-000000005"),
        claim=copy_marker(),
        before_commit=b_copies_meanwhile,
    )
    reader = CheckpointManager(f"s3://{bucket}/archive", storage_options=options)
    assert reader.verify(5).ok
    got = reader.load(5)
    assert got["step"] == 5 and torch.equal(got["w"], saved["a"]["w"])
    assert [str(e) for e in second] == ["job b has not committed yet"]
    files = lambda: {n for n in archive.listing()[5] if STATE_NAME_RE.fullmatch(n) or n == "COMMIT"}  # noqa: E731
    assert files() == {"state.ckpt", "COMMIT"}  # b's own object withdrawn (its marker stays)
    with pytest.raises(ckptfmt.CheckpointError, match="holds another save of step 5"):
        put_step(archive, 5, str(tmp_path / "b" / "step-000000005"), claim=copy_marker())
    assert files() == {"state.ckpt", "COMMIT"}


def test_removing_an_interrupted_copy_never_deletes_what_another_archiver_kept(tmp_path, s3_bucket) -> None:
    """An archiver copying step 5 dies before its commit record, leaving its copy marker and
    the state file.  Another archiver's pass lists the archive and finds that leftover; before
    it removes it, a third archiver copies the same step 5: it finds the very file it would
    upload there and keeps it (created only if absent), then commits.  The removal deletes
    nothing: the listed versions are deleted only in a prefix no writer has come to since,
    and step 5 loads bit-exactly.  (It used to delete by name the state file the new
    commit record names.)"""
    from ckptfmt.runs.archivecopy import put_step
    from ckptfmt.runs.objectnames import copy_marker
    from ckptfmt.runs.objectrun import ObjectRun

    bucket, options = s3_bucket
    saved = _state(5, SMALL)
    CheckpointManager(str(tmp_path / "local")).save(5, saved)
    local = str(tmp_path / "local" / "step-000000005")
    url = f"s3://{bucket}/archive"

    def dies(record) -> None:
        raise RuntimeError("the first archiver dies before its commit record")

    with pytest.raises(RuntimeError):  # its marker is unclaimed once put_step ends: a dead copy's
        put_step(ObjectRun(url, options), 5, local, claim=copy_marker(), before_commit=dies)
    found = ObjectRun(url, options).listing()  # the remover's pass lists the archive first
    assert "state.ckpt" in found[5] and "COMMIT" not in found[5]
    removed: list[int] = []

    def remover_runs_now(record) -> None:  # this copy's files are up, its record not yet
        # its objects just written: old enough by a bound of 0 (a plain saver's age rule, spec 13.7)
        removed.extend(ObjectRun(url, options).remove_interrupted_copies(NOW_OLD, found=found))

    put_step(ObjectRun(url, options), 5, local, claim=copy_marker(), before_commit=remover_runs_now)
    reader = CheckpointManager(url, storage_options=options)
    report = reader.verify(5)
    assert report.ok, report.problems
    got = reader.load(5)
    assert got["step"] == 5 and torch.equal(got["w"], saved["w"])
    assert removed == []  # the step was the other writer's by then


def _dead_copy(url: str, options: dict[str, str], step: int, local: str) -> None:
    """An archive copy of `local` that dies before its commit record: its files and its copy
    marker stay (the marker, of this process and no longer claimed, is a dead writer's)."""
    from ckptfmt.runs.archivecopy import put_step
    from ckptfmt.runs.objectnames import copy_marker
    from ckptfmt.runs.objectrun import ObjectRun

    def dies(record) -> None:
        raise RuntimeError("the first archiver dies before its commit record")

    with pytest.raises(RuntimeError):
        put_step(ObjectRun(url, options), step, local, claim=copy_marker(), before_commit=dies)


def test_a_cleanup_held_at_its_delete_never_deletes_what_a_live_copy_commits(tmp_path, s3_faults) -> None:
    """The window that re-listing leaves, made deterministic: a cleaner of interrupted copies
    lists step 5 (a dead copy's state file and marker, no record), finds nothing new when it
    lists again, and its DELETE of the state file is held by the proxy.  Meanwhile another
    archiver copies step 5 and commits; then the DELETE goes through.  The copy found the
    step's prefix holding objects, so it wrote its state file under a name of its own and its
    record names that: step 5 loads bit-exactly, and the dead copy's file is gone.  (The copy
    used to keep the identical file it found, and its committed record named the object the
    held DELETE then removed.)"""
    from ckptfmt.runs.objectrun import ObjectRun

    bucket = s3_faults.new_bucket()
    direct = s3_server_options(s3_faults)
    url = f"s3://{bucket}/archive"
    saved = _state(5, SMALL)
    CheckpointManager(str(tmp_path / "local")).save(5, saved)
    local = str(tmp_path / "local" / "step-000000005")
    _dead_copy(url, direct, 5, local)
    _copy_while_a_cleanup_is_held(s3_faults, url, direct, 5, local, "state.ckpt")
    reader = CheckpointManager(url, storage_options=direct)
    report = reader.verify(5)
    assert report.ok, report.problems
    got = reader.load(5)
    assert got["step"] == 5 and torch.equal(got["w"], saved["w"])
    names = set(ObjectRun(url, direct).listing()[5])
    assert "state.ckpt" not in names and "COMMIT" in names, names
    assert [n for n in names if STATE_NAME_RE.fullmatch(n)] == [reader.latest().files[0].rsplit("/", 1)[1]]


def s3_server_options(proxy) -> dict[str, str]:
    """Storage options reaching the proxy's server directly, past its rules."""
    from s3_server import storage_options

    return storage_options(proxy.upstream)


def _outcome(call) -> object:
    """What `call()` returned, or the exception it raised."""
    try:
        return call()
    except Exception as e:
        return e


#: a bound by which a dead copy's objects, just written, are old (remove_interrupted_copies
#: deletes a commit-less prefix only once they are: spec 13.7)
NOW_OLD = datetime.timedelta(0)


def _copy_while_a_cleanup_is_held(
    s3_faults, url: str, direct: dict[str, str], step: int, local: str, name: str
) -> None:
    """Run a cleaner of interrupted copies (through the proxy) until its DELETE of step
    `step`'s object `name` is held, copy `local` as that step (past the proxy) meanwhile,
    then let the DELETE go through."""
    from ckptfmt.runs.archivecopy import put_step
    from ckptfmt.runs.objectnames import copy_marker
    from ckptfmt.runs.objectrun import ObjectRun

    target = f"step-{step:09d}/{name}"
    released = s3_faults.hold("DELETE", target)
    removed: list[object] = []
    cleaner = threading.Thread(
        target=lambda: removed.append(
            _outcome(lambda: ObjectRun(url, s3_faults.storage_options()).remove_interrupted_copies(NOW_OLD))
        )
    )
    cleaner.start()
    try:
        deadline = time.monotonic() + 60
        while s3_faults.count("DELETE", target) == 0:
            assert time.monotonic() < deadline and cleaner.is_alive(), removed
            time.sleep(0.01)
        put_step(ObjectRun(url, direct), step, local, claim=copy_marker())  # while the DELETE is held
    finally:
        released.set()
        cleaner.join(90)
    assert not cleaner.is_alive()
    assert not [e for e in removed if isinstance(e, Exception)], removed


def _save_a_sharded_step(rank: int, world: int, base: str) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    m = CheckpointManager(base)
    m.save(5, {"w": distribute_tensor(SHARDED.clone(), mesh, [Shard(0)]), "step": 5})
    m.wait()
    return {}


SHARDED = torch.arange(1 << 14, dtype=torch.float32).reshape(128, 128)


def test_a_two_rank_step_archived_over_a_dead_copy_survives_a_held_cleanup(tmp_path, s3_faults) -> None:
    """A 2-rank (DCP) step archived where a dead copy left both rank files, while a cleaner's
    DELETE of one of them is held: the copy writes rank-NNNNN.<h>.ckpt, one token for the
    step, and its record (layout "dcp", its columns unchanged: they refer to files by index)
    names them; the dead copy's rank files are gone, and the step loads bit-exactly.  (The
    copy used to keep the identical rank files it found, and the held DELETE then removed
    one its record named.)"""
    from helpers import run_ranks

    import ckptfmt.dcp as cdcp
    from ckptfmt.files.names import RANK_FILE_RE
    from ckptfmt.runs.objectrun import ObjectRun

    results = run_ranks(_save_a_sharded_step, 2, tmp_path, str(tmp_path / "local"))
    assert results == [{}, {}], results
    local = tmp_path / "local" / "step-000000005"
    assert {"rank-00000.ckpt", "rank-00001.ckpt"} <= set(os.listdir(local))
    bucket = s3_faults.new_bucket()
    direct = s3_server_options(s3_faults)
    url = f"s3://{bucket}/archive"
    _dead_copy(url, direct, 5, str(local))
    _copy_while_a_cleanup_is_held(s3_faults, url, direct, 5, str(local), "rank-00000.ckpt")
    reader = CheckpointManager(url, storage_options=direct)
    report = reader.verify(5)
    assert report.ok, report.problems
    target = {"state": {"w": torch.zeros(128, 128), "step": 0}}
    cdcp.load(target, f"{url}/step-000000005", storage_options=direct)
    assert torch.equal(target["state"]["w"], SHARDED) and target["state"]["step"] == 5
    record = ObjectRun(url, direct).record(5)
    assert record.layout == "dcp"
    tokens = {n.split(".")[1] for n in (p.name for p in record.files) if RANK_FILE_RE.fullmatch(n)}
    assert len(record.files) == 2 and len(tokens) == 1 and "ckpt" not in tokens, record.files
    names = set(ObjectRun(url, direct).listing()[5])
    assert not {"rank-00000.ckpt", "rank-00001.ckpt"} & names, names

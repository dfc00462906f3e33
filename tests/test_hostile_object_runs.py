"""Incremental and signed runs on a store that an attacker controls (each store's emulator,
behind the fault proxy where the store must lie): listings that leave out the commit record
of the step that refers to an older one, referenced objects replaced or forged, more
referenced objects than a reader may hold open.  Nothing a kept step reads is deleted,
nothing the record does not vouch for is loaded, and every refusal is a ckptfmt error."""

from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.files import incremental
from ckptfmt.files import reader as reader_module
from ckptfmt.files.reader import CheckpointFile

FROZEN = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB: referred to, never written again


def _state(step: int) -> dict[str, object]:
    return {"frozen": FROZEN, "head": torch.full((1000,), float(step)), "step": step}


def _run_of_two_steps(faults, **kw) -> tuple[str, CheckpointManager]:
    """A run (on any store) whose step 2 reads the frozen tensor's chunks from step 1's object."""
    url = f"{faults.new_root()}/run"
    m = CheckpointManager(url, incremental=True, storage_options=faults.options, **kw)
    m.save(1, _state(1))
    m.save(2, _state(2))
    assert m.latest().references == (f"{url}/step-000000001/state.ckpt",)
    return url, m


@pytest.mark.parametrize(
    "hidden",
    [
        "COMMIT",  # step 2 looks commit-less: its record is there to HEAD
        "state.ckpt",  # step 2 looks damaged (a file it names missing): its record is readable
    ],
)
def test_cleanup_keeps_objects_a_step_the_listing_misstates_reads(store_faults, hidden):
    f = store_faults
    url, m = _run_of_two_steps(f, keep_last=1)
    # rotation retired step 1: its record is gone, its object kept for step 2
    assert f.keys(url) == {
        "step-000000001/state.ckpt",
        "step-000000002/state.ckpt",
        "step-000000002/COMMIT",
    }
    # every time stale, and no step the listing shows complete refers to step 1's object
    f.hide_listed(f"run/step-000000002/{hidden}")
    m.run.cleanup(older_than=datetime.timedelta(0))
    f.clear_rules()
    assert "step-000000001/state.ckpt" in f.keys(url)
    assert torch.equal(m.load(2)["frozen"], FROZEN)


def test_remove_keeps_objects_a_step_the_listing_hides_reads(store_faults):
    url, m = _run_of_two_steps(store_faults)
    store_faults.hide_listed("run/step-000000002/COMMIT")
    m.remove(1)  # step 1 is retired, not deleted: step 2 reads its object
    store_faults.clear_rules()
    assert store_faults.keys(f"{url}/step-000000001/") == {"state.ckpt"}
    assert [c.step for c in m.checkpoints()] == [2]
    assert torch.equal(m.load(2)["frozen"], FROZEN)


def test_rotation_keeps_objects_a_step_the_listing_hides_reads(store_faults):
    url, _ = _run_of_two_steps(store_faults)
    store_faults.hide_listed("run/step-000000002/COMMIT")
    # a writer that sees steps 1 and 3 only keeps the last: step 1 goes, but step 2 reads it
    m = CheckpointManager(url, keep_last=1, storage_options=store_faults.options)
    m.save(3, _state(3))
    store_faults.clear_rules()
    assert store_faults.keys(f"{url}/step-000000001/") == {"state.ckpt"}
    assert torch.equal(m.load(2)["frozen"], FROZEN)


def _open_fds() -> int:
    """This process's descriptors other than sockets: the store client's pool opens connections as
    requests overlap, which says nothing of the referenced objects a reader holds open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed since the listing (the listing's own descriptor among them)
            pass
    return n


def _fds_settle_to(most: int, within: float = 20.0) -> bool:
    """Whether this process's descriptors (as _open_fds) come down to `most` within `within` s."""
    deadline = time.monotonic() + within
    while _open_fds() > most:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_reader_holds_a_bounded_number_of_referenced_objects_open(s3_bucket, monkeypatch):
    # file k reads tensor j < k from file j: the last one reads from every earlier object, and
    # a reader keeps at most MAX_OPEN_EXTERNALS of them open (the least recently used closed)
    monkeypatch.setattr(reader_module, "MAX_OPEN_EXTERNALS", 2)
    bucket, options = s3_bucket
    n = 8
    tensors = {f"t{j}": torch.full((1 << 14,), float(j)) for j in range(n)}
    base = None
    for k in range(n):
        state = dict(tensors, **{f"t{k}": torch.full((1 << 14,), -float(k))})
        url = f"s3://{bucket}/files/f{k}/state.ckpt"
        incremental.save(state, url, base=base, min_reference_bytes=1024, storage_options=options)
        tensors = state
        base = url
    before = _open_fds()
    with CheckpointFile(base, storage_options=options) as f:
        opened = _open_fds()
        assert len(f.externals) == n - 1
        assert f.external_problems() == []
        assert list(f.iter_chunk_problems()) == []
        # two referenced objects open: a descriptor, a spool and its mapping each (7 before); an
        # evicted object's spool is closed on a thread of its own, which a loaded machine runs late
        assert _fds_settle_to(opened + 2 * 3)
    for t in threading.enumerate():  # each spool's mapping (a descriptor) is closed on this thread
        if t.name.startswith("ckptfmt-free-spool"):
            t.join(30)
    assert _open_fds() <= before
    loaded = ckptfmt.load(base, storage_options=options)
    for j in range(n):
        assert torch.equal(loaded[f"t{j}"], tensors[f"t{j}"])


def _flip_a_chunk_step_2_never_reads(faults, url: str) -> None:
    """Change one byte of step 1's object `url` in the chunk of its own `head` tensor (step 2
    holds its own): neither a load nor a verify of step 2 reads it."""
    data = bytearray(faults.get_raw(url))
    with CheckpointFile(url, storage_options=faults.options) as f:
        k = next(k for k in range(len(f.chunks)) if f.key_of(k).endswith("['head']"))
        data[f.chunks[k].offset + 8] ^= 0x01
    faults.put_raw(url, bytes(data))


def test_verify_with_trusted_keys_hashes_the_objects_a_step_reads_from(store_faults):
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    options = store_faults.options
    url = f"{store_faults.new_root()}/signed"
    m = CheckpointManager(url, incremental=True, sign_with=key, storage_options=options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    m.remove(1)  # retired: step 2 reads its object
    reader = CheckpointManager(url, trusted_keys=[key.public_key()], storage_options=options)
    assert reader.verify(2).ok
    _flip_a_chunk_step_2_never_reads(store_faults, f"{url}/step-000000001/state.ckpt")
    with pytest.raises(ckptfmt.SignatureError):
        reader.load(2)
    report = reader.verify(2)
    assert not report.ok and report.problems[0].kind == "signature"


def test_archiving_refuses_a_present_referenced_object_other_than_the_signed_one(tmp_path, store_faults):
    # the archive already holds an object where step 2 reads step 1's from: same length, file
    # id and index, one byte of another chunk changed.  A signed step is not archived onto it
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from ckptfmt.runs.archivecopy import put_step
    from ckptfmt.runs.objectrun import ObjectRun

    key = ed25519.Ed25519PrivateKey.generate()
    f = store_faults
    archive = f"{f.new_root()}/archive"
    local = CheckpointManager(tmp_path / "run", incremental=True, sign_with=key)
    local.save(1, _state(1))
    local.save(2, _state(2))
    forged = f"{archive}/step-000000001/state.ckpt"
    f.put_raw(forged, (tmp_path / "run/step-000000001/state.ckpt").read_bytes())
    _flip_a_chunk_step_2_never_reads(f, forged)
    run = ObjectRun(archive, f.options)
    with pytest.raises(ckptfmt.SignatureError):
        put_step(run, 2, str(tmp_path / "run/step-000000002"))
    assert "step-000000002/COMMIT" not in f.keys(archive)


def test_a_commit_names_only_the_objects_the_state_was_written_against(store_faults):
    # step 1's object replaced by another save (another file id) after step 2's state object
    # was written against it: the commit record must not name (nor a signature vouch for)
    # the new object as the one step 2 reads
    from ckptfmt.background import inflight
    from ckptfmt.runs.steps import StepJob

    options = store_faults.options
    url = f"{store_faults.new_root()}/run"
    m = CheckpointManager(url, incremental=True, storage_options=options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    store_faults.delete_raw(f"{url}/step-000000002/COMMIT")
    ckptfmt.save(_state(1), f"{url}/step-000000001/state.ckpt", storage_options=options)
    job = StepJob(2, m.run.step_path(2), -1, {}, {}, inflight.SaveHandle(m.run.step_path(2)))
    with pytest.raises(ckptfmt.CorruptError, match="file id"):
        m._commit(job)
    assert "step-000000002/COMMIT" not in store_faults.keys(url)


def test_verify_refuses_a_step_reading_an_object_its_record_does_not_name(store_faults):
    # step 2's record rewritten without its reference: a load refuses the state object (it
    # reads step 1's), and verify fails where the load does, though every chunk is sound
    import dataclasses

    from ckptfmt.files import multifile

    options = store_faults.options
    url = f"{store_faults.new_root()}/run"
    m = CheckpointManager(url, incremental=True, storage_options=options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    unbound = dataclasses.replace(m.run.record(2), references=())
    store_faults.delete_raw(f"{url}/step-000000002/COMMIT")
    ckptfmt.save(unbound.as_value(), f"{url}/step-000000002/{multifile.COMMIT_NAME}", storage_options=options)
    assert [c.step for c in m.checkpoints()] == [1, 2]
    with pytest.raises(ckptfmt.CorruptError, match="does not name"):
        m.load(2)
    report = m.verify(2)
    assert not report.ok and "does not name" in report.problems[0].message


def test_a_save_that_loses_the_commit_race_leaves_the_winners_checkpoint(store_faults):
    """Two managers save step 5 of one run (a restarted job while the old one still runs):
    the loser's commit record finds the winner's there and raises, and deletes nothing the
    winner's checkpoint holds: its commit record and the state object it names stay, and the
    loser's state object goes."""
    import threading
    import time

    f = store_faults
    url = f"{f.new_root()}/run"
    old = CheckpointManager(url, storage_options=f.options)
    new = CheckpointManager(url, storage_options=f.options)
    # the old job's commit record is held on its way while the new job saves the same step
    f.delay(*f.op("write", "step-000000005/COMMIT"), seconds=3.0, count=1)
    failure: list[BaseException] = []

    def old_save() -> None:
        try:
            old.save(5, _state(-5))
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=old_save, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while f.pending_rules() and time.monotonic() < deadline:
        time.sleep(0.02)  # until the old job's PUT of its record is being held
    assert f.pending_rules() == 0
    new.save(5, _state(5))
    f.release()  # the old job's record goes on, after the new job's commit
    t.join(30)
    assert not t.is_alive()
    assert len(failure) == 1 and "committed by another writer meanwhile" in str(failure[0])
    # the winner wrote a state object of its own beside the old job's, which it deleted once committed
    named = new.run.record(5).files[0].name
    assert named != "state.ckpt"
    assert f.keys(url) == {f"step-000000005/{named}", "step-000000005/COMMIT"}
    assert new.load(5)["step"] == 5
    assert torch.equal(CheckpointManager(url, storage_options=f.options).load()["head"], _state(5)["head"])


def test_cleanup_and_rotation_delete_only_what_ckptfmt_wrote(store_faults):
    """Another program's objects beneath a run's prefix and its steps' (a note, a copy made by
    another tool, on S3 its multipart upload) survive rotation, a failed save's cleanup and
    the cleanup of stale steps and uploads: none is an object ckptfmt can show it wrote."""
    f = store_faults
    url = f"{f.new_root()}/run"
    foreign = {
        "step-000000001/notes.txt",
        "step-000000001/state.ckpt.bak",
        "step-000000004/model.safetensors",
        "README",
    }
    for key in foreign:
        f.put_raw(f"{url}/{key}", b"not ckptfmt's")
    f.put_raw(f"{url}/step-000000004/state.ckpt", b"a crashed save's")
    if f.kind == "s3":  # another tool's multipart uploads (GCS and Azure have none to list)
        c = f.client()
        bucket = url.split("/")[2]
        c.create_multipart_upload(Bucket=bucket, Key="run/step-000000004/upload.tmp")
        c.create_multipart_upload(Bucket=bucket, Key="run/step-000000004/rank-00001.ckpt")
    m = CheckpointManager(url, keep_last=1, storage_options=f.options)
    m.save(1, _state(1))
    m.save(2, _state(2))  # rotation deletes step 1
    m.run.cleanup(older_than=datetime.timedelta(0))  # step 4 is a stale leftover
    assert f.keys(url) == foreign | {"step-000000002/state.ckpt", "step-000000002/COMMIT"}
    if f.kind == "s3":
        uploads = {u["Key"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
        assert uploads == {"run/step-000000004/upload.tmp"}
    m.remove(2)
    assert f.keys(url) == foreign

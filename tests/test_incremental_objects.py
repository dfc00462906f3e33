"""Incremental runs on an object store (a real moto S3 server): CheckpointManager("s3://...",
incremental=True) uploads only the chunks that changed, each step's state object referring to
the objects of earlier steps that hold the rest (spec 12 on a store, 13.7).  Loads read
referenced chunks with ranged GETs, every chunk verified; rotation retires a step later ones
read from; a reference outside the run, a missing or replaced referenced object is refused."""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ed25519

import ckptfmt
from ckptfmt import CheckpointManager, CheckpointWarning
from ckptfmt.files import multifile
from ckptfmt.storage.references import resolve
from ckptfmt.storage.urls import parse_url

MiB = 1 << 20
FROZEN = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: referred to, never written again


def _state(step: int) -> dict[str, object]:
    return {"frozen": FROZEN, "head": torch.full((1000,), float(step)), "step": step}


def _zeros() -> dict[str, object]:
    return {"frozen": torch.zeros(1 << 18), "head": torch.zeros(1000), "step": 0}


def _sizes(server, bucket: str, prefix: str) -> dict[str, int]:
    listed = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: o["Size"] for o in listed}


def test_an_incremental_run_on_the_store(s3_server, s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/inc"
    m = CheckpointManager(url, incremental=True, keep_last=1, storage_options=options)
    for step in (1, 2, 3):
        m.save(step, _state(step))
    sizes = _sizes(s3_server, bucket, "inc/")
    # step 1 holds the frozen tensor; steps 2 and 3 hold the changed chunks only
    assert sizes["step-000000001/state.ckpt"] > FROZEN.nbytes
    assert sizes["step-000000003/state.ckpt"] < FROZEN.nbytes // 8
    # rotation kept step 3 and retired step 1 (its record gone, its object kept for step 3)
    # and deleted step 2, which nothing reads
    assert "step-000000001/COMMIT" not in sizes and "step-000000001/state.ckpt" in sizes
    assert not any(k.startswith("step-000000002/") for k in sizes)
    assert [c.step for c in m.checkpoints()] == [3]
    info = m.latest()
    assert info.references == (f"{url}/step-000000001/state.ckpt",)

    target = _zeros()
    assert m.load_into(target, restore_rng=False).step == 3
    assert torch.equal(target["frozen"], FROZEN) and torch.equal(target["head"], torch.full((1000,), 3.0))
    assert m.verify().ok
    fresh = CheckpointManager(url, incremental=True, storage_options=options)
    with warnings_as_errors():
        assert fresh.latest().step == 3  # a retained step is not warned about
    fresh.save(4, _state(4))
    assert fresh.load()["step"] == 4 and torch.equal(fresh.load()["frozen"], FROZEN)

    # the object a kept step reads from, deleted: the step is incomplete, never latest()
    s3_server.client().delete_object(Bucket=bucket, Key="inc/step-000000001/state.ckpt")
    with pytest.warns(CheckpointWarning, match="missing"):
        assert fresh.latest() is None


def test_a_signed_incremental_run_hashes_every_object_it_reads(s3_server, s3_bucket):
    key = ed25519.Ed25519PrivateKey.generate()
    bucket, options = s3_bucket
    url = f"s3://{bucket}/signed-inc"
    m = CheckpointManager(url, incremental=True, sign_with=key, storage_options=options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    reader = CheckpointManager(url, trusted_keys=[key.public_key()], storage_options=options)
    record = reader.run.trusted_record(2)
    assert [r.name for r in record.references] == ["../step-000000001/state.ckpt"]
    assert record.references[0].sha256 is not None
    assert torch.equal(reader.load()["frozen"], FROZEN)
    # a chunk of the referenced object changed (its identity kept): refused before any data
    client = s3_server.client()
    data = bytearray(
        client.get_object(Bucket=bucket, Key="signed-inc/step-000000001/state.ckpt")["Body"].read()
    )
    data[200] ^= 0x40
    client.put_object(Bucket=bucket, Key="signed-inc/step-000000001/state.ckpt", Body=bytes(data))
    target = _zeros()
    with pytest.raises(ckptfmt.SignatureError):
        reader.load_into(target, 2, restore_rng=False)
    assert not target["frozen"].any()


def test_an_incremental_local_run_archives_and_a_new_node_resumes_from_it(tmp_path, s3_server, s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/archive"
    m = CheckpointManager(
        tmp_path / "run",
        incremental=True,
        keep_last=1,
        archive=url,
        archive_keep_last=1,
        storage_options=options,
    )
    for step in (1, 2, 3):
        m.save(step, _state(step))
    m.wait()
    assert m.archive_failures() == {}
    sizes = _sizes(s3_server, bucket, "archive/")
    # the archive holds step 3 and the object of step 1 it reads from, retired
    assert "step-000000003/COMMIT" in sizes and "step-000000001/state.ckpt" in sizes
    assert "step-000000001/COMMIT" not in sizes
    assert sizes["step-000000003/state.ckpt"] < FROZEN.nbytes // 8

    node = CheckpointManager(tmp_path / "new-node", archive=url, storage_options=options)
    target = _zeros()
    assert node.load_into(target, restore_rng=False).step == 3
    assert torch.equal(target["frozen"], FROZEN) and torch.equal(target["head"], torch.full((1000,), 3.0))
    assert node.verify(3).ok


def test_references_never_leave_the_run(s3_bucket):
    bucket, _ = s3_bucket
    prefix = parse_url(f"s3://{bucket}/run/step-000000002", need_key=False)
    assert (
        str(resolve(prefix, "../step-000000001/state.ckpt")) == f"s3://{bucket}/run/step-000000001/state.ckpt"
    )
    assert str(resolve(prefix, "state.ckpt")) == f"s3://{bucket}/run/step-000000002/state.ckpt"
    top = parse_url(f"s3://{bucket}/step-000000002", need_key=False)
    with pytest.raises(ckptfmt.CorruptError, match="above the bucket"):
        resolve(top, "../../x")
    from ckptfmt.runs.objectnames import referenced_step as _referenced_step

    for bad in ("../other/state.ckpt", "state.ckpt", "../step-000000001/a/b", "../../step-000000001/x"):
        with pytest.raises(ckptfmt.CorruptError, match="not to a step of this run"):
            _referenced_step(bad, "s3://b/run")
    assert multifile.COMMIT_NAME == "COMMIT"


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", CheckpointWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_an_encrypted_incremental_run_on_the_store(s3_server, s3_bucket):
    """incremental=True with encrypt_with on a store: step 2 refers to step 1's encrypted
    object (spec 17.9), no plaintext lies on the store, and a load needs the key."""
    bucket, options = s3_bucket
    key = bytes(range(32))
    url = f"s3://{bucket}/enc-inc"
    m = CheckpointManager(url, incremental=True, encrypt_with=key, storage_options=options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    sizes = _sizes(s3_server, bucket, "enc-inc/")
    assert sizes["step-000000002/state.ckpt"] < FROZEN.nbytes // 8
    client = s3_server.client()
    stored = client.get_object(Bucket=bucket, Key="enc-inc/step-000000001/state.ckpt")["Body"].read()
    assert FROZEN.numpy().tobytes()[:4096] not in stored
    target = _zeros()
    assert m.load_into(target, restore_rng=False).step == 2
    assert torch.equal(target["frozen"], FROZEN)
    with pytest.raises(ckptfmt.DecryptionError):
        CheckpointManager(url, storage_options=options).load(2)


def _hostile_reference(original: bytes, length: int, index_length: int) -> bytes:
    """An object of `length` bytes with `original`'s prologue (its file id) and a footer that
    gives it an index of `index_length` bytes from byte 64: as much as the object holds, or
    more.  Both checksums hold."""
    import struct

    import xxhash

    prologue = bytearray(original[:64])
    struct.pack_into("<Q", prologue, 32, length)
    struct.pack_into("<Q", prologue, 56, xxhash.xxh3_64_intdigest(bytes(prologue[:56])))
    footer = bytearray(original[-64:])
    struct.pack_into("<QQ", footer, 0, 64, index_length)
    struct.pack_into("<Q", footer, 48, xxhash.xxh3_64_intdigest(bytes(footer[:48])))
    return bytes(prologue) + bytes(length - 128) + bytes(footer)


@pytest.mark.parametrize(
    ("length", "index_length", "message"),
    [
        (24 * MiB, 24 * MiB - 128, "is 25165824 bytes, the reference records"),
        (4 * MiB, 1 << 40, "exceeds the limit"),
    ],
)
def test_a_referenced_object_is_never_read_for_its_index(store_faults, length, index_length, message):
    """A referenced object replaced by one whose footer gives it a huge index (one it holds:
    24 MiB, or one it only claims: 1 TiB): loading the step that refers to it fetches its
    prologue and tail and no more, and refuses it at once; so do the next save, which cannot
    build on it, and listing the run, which passes over the steps that read it."""
    f = store_faults
    options = f.options
    url = f"{f.new_root()}/inc"
    m = CheckpointManager(url, incremental=True, storage_options=options)
    m.save(1, _state(1))
    m.save(2, _state(2))
    referenced = f"{url}/step-000000001/state.ckpt"
    f.put_raw(referenced, _hostile_reference(f.get_raw(referenced), length, index_length))
    f.clear_counts()
    with pytest.raises(ckptfmt.CorruptError, match=message) as e:
        ckptfmt.load(f"{url}/step-000000002/state.ckpt", storage_options=options)
    assert "step-000000001/state.ckpt" in str(e.value)
    m.save(3, _state(3))  # a whole one: it cannot build on a step reading the replaced object
    # latest() reads newest first and stops at step 3; listing the run shows the older steps
    assert m.latest().step == 3 and m.latest().references == ()
    problems = [s.problem or "" for s in m.statuses() if s.damaged]
    assert any(f"{length} bytes, the commit record says" in p for p in problems), problems
    fetched = f.ranges("step-000000001")
    assert fetched and sum(hi - lo for lo, hi in fetched) <= 2 * 2 * (MiB + 64)


def test_a_referenced_object_is_named_with_its_dot_dot_folded(s3_server, s3_bucket, tmp_path):
    """An error about a chunk that lies in an earlier step's object names that object's URL,
    the reference's ".." folded in the key (never "s3:/" nor "step-2/../step-1")."""
    from ckptfmt.files import incremental
    from ckptfmt.files.reader import CheckpointFile

    bucket, options = s3_bucket
    a, b = f"s3://{bucket}/fold/step-1/a.ckpt", f"s3://{bucket}/fold/step-2/b.ckpt"
    incremental.save(_state(1), a, storage_options=options)
    incremental.save(_state(2), b, base=a, storage_options=options)
    with CheckpointFile(b, storage_options=options) as f:
        assert [ext.rel for ext in f.externals] == ["../step-1/a.ckpt"]
        assert [ext.name for ext in f.externals] == [a]
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="fold/step-1/a.ckpt", Body=b"gone")  # replaced
    with pytest.raises(ckptfmt.CheckpointError) as caught:
        ckptfmt.load(b, storage_options=options)
    assert a in str(caught.value) and "/../" not in str(caught.value)


def test_a_reference_that_would_leave_the_bucket_is_refused_before_any_chunk(s3_server, s3_bucket, tmp_path):
    """A file at a bucket's top whose index refers to "../NAME" (hostile, or copied from a
    directory): the reference would leave the bucket; the index is refused when it is read."""
    import os

    from ckptfmt.files import incremental
    from ckptfmt.files.reader import CheckpointFile

    bucket, options = s3_bucket
    (tmp_path / "d").mkdir()
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "d" / "b.ckpt")
    incremental.save(_state(1), a)
    incremental.save(_state(2), b, base=a)  # refers to ../a.ckpt
    client = s3_server.client()
    for name, path in (("a.ckpt", a), ("b.ckpt", b)):
        with open(path, "rb") as src:
            client.put_object(Bucket=bucket, Key=name, Body=src.read())
    top = f"s3://{bucket}/b.ckpt"
    with pytest.raises(ckptfmt.CorruptError, match="leave the bucket") as caught:
        CheckpointFile(top, storage_options=options)
    assert top in str(caught.value) and os.path.basename(a) in str(caught.value)
    with pytest.raises(ckptfmt.CorruptError, match="leave the bucket"):
        ckptfmt.load(top, storage_options=options)
    assert not ckptfmt.verify(top, storage_options=options).ok


def test_external_names_fold_dot_dot_in_the_key_only():
    from ckptfmt.format.index import External, folded_url

    fid = b"\x01" * 16
    azure = "abfss://c1@acct.dfs.core.windows.net/run/step-2/../step-1/x.ckpt"
    assert External("../step-1/x.ckpt", fid, 128, azure).name == (
        "abfss://c1@acct.dfs.core.windows.net/run/step-1/x.ckpt"
    )
    assert External("x.ckpt", fid, 128, "gs://b/x.ckpt").name == "gs://b/x.ckpt"
    assert External("../x.ckpt", fid, 128, "/d/e/../x.ckpt").name == "/d/x.ckpt"
    for leaving in ("s3://b/../x.ckpt", "s3://b/d/../../x.ckpt", "gs://b/.."):
        assert folded_url(leaving) is None
        assert External("../x.ckpt", fid, 128, leaving).name == leaving  # shown as it is


def test_a_referenced_object_is_read_at_the_version_first_opened(s3_server, s3_bucket, monkeypatch):
    """A reader that let go of a referenced object (it keeps few open) and opens it again reads
    it at the version it first opened, or refuses it: an object replaced meanwhile is never
    mixed into what the reader already read from it (the version an incremental save's check
    keys its verdicts by is then the version of the bytes it checked)."""
    from ckptfmt.files import incremental, reader

    bucket, options = s3_bucket
    a, b, c = (f"s3://{bucket}/pin/{n}.ckpt" for n in "abc")
    x, y = torch.arange(1 << 16, dtype=torch.float32), torch.ones(1 << 16)
    incremental.save({"x": x, "y": y, "z": torch.zeros(4)}, a, storage_options=options)
    incremental.save({"x": x, "y": y * 2, "z": torch.zeros(4)}, b, base=a, storage_options=options)
    incremental.save({"x": x, "y": y * 2, "z": torch.ones(4)}, c, base=b, storage_options=options)
    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 1)  # c's two referenced objects take turns
    client = s3_server.client()
    with ckptfmt.open(c, storage_options=options) as r:
        assert torch.equal(r.get("x"), x)  # from a
        assert torch.equal(r.get("y"), y * 2)  # from b: a is let go of
        raw = bytearray(client.get_object(Bucket=bucket, Key="pin/a.ckpt")["Body"].read())
        raw[100] ^= 1  # a replaced by a damaged copy of the same length and id
        client.put_object(Bucket=bucket, Key="pin/a.ckpt", Body=bytes(raw))
        with pytest.raises(ckptfmt.StorageError, match="replaced"):
            r.get("x")

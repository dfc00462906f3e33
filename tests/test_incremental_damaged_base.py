"""An incremental save never refers to damaged bytes of its base: a base chunk's stored bytes
are checked (checksum, decoding, content digest, as a load checks them) before the first
reference to it, once per process; a damaged one is written again (a WARNING names it), or,
where a forked writer already left it unwritten, the save fails naming it."""

from __future__ import annotations

import glob
import logging
import sys

import pytest
import torch

import ckptfmt
from ckptfmt.files import basecheck, incremental
from ckptfmt.files.reader import CheckpointFile

FROZEN = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: one chunk or more, referred to
S3_FROZEN = torch.arange(1 << 18, dtype=torch.float32)


def _state(step: int, frozen: torch.Tensor = FROZEN) -> dict[str, object]:
    return {"frozen": frozen, "a": torch.full((8,), float(step))}


def _flip_a_bit_of_the_largest_chunk(path: str) -> tuple[int, int]:
    """Damage `path` as bit rot would; the damaged chunk's number and offset."""
    with CheckpointFile(path) as f:
        k, big = max(enumerate(f.chunks), key=lambda c: c[1].stored_len)
    raw = bytearray(open(path, "rb").read())
    raw[big.offset + 10] ^= 1
    with open(path, "wb") as out:
        out.write(raw)
    return k, big.offset


class _Reads:
    """Counts the base chunks that basecheck reads (the reader's own read_into, spied on)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.chunks = 0
        original = CheckpointFile.read_into

        def counted(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
            if check_only:
                self.chunks += len(items)
            return original(f, items, verify, check_only)

        monkeypatch.setattr(CheckpointFile, "read_into", counted)


def test_a_manager_run_whose_base_is_damaged_keeps_loadable_steps(tmp_path, caplog):
    m = ckptfmt.CheckpointManager(str(tmp_path), keep_last=2, incremental=True)
    m.save(1, _state(1))
    p = glob.glob(f"{tmp_path}/step-000000001/state*.ckpt")[0]
    k, offset = _flip_a_bit_of_the_largest_chunk(p)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        for s in (2, 3, 4):
            m.save(s, _state(s))
    out = m.load(fallback=True)
    assert torch.equal(out["frozen"], FROZEN) and out["a"][0] == 4.0
    for step in (3, 4):  # every kept step loads, bit for bit
        assert torch.equal(m.load(step=step)["frozen"], FROZEN)
    assert f"chunk {k} of {p} (offset {offset}) fails its check" in caplog.text


def test_a_file_saved_against_a_damaged_base_loads(tmp_path, caplog):
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_state(1), a)
    k, offset = _flip_a_bit_of_the_largest_chunk(a)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        incremental.save(_state(2), b, base=a)
    assert torch.equal(ckptfmt.load(b)["frozen"], FROZEN)
    assert ckptfmt.verify(b).ok
    assert f"{b}: chunk {k} of {a} (offset {offset}) fails its check" in caplog.text


def test_a_base_is_read_once_per_process(tmp_path, monkeypatch):
    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    reads = _Reads(monkeypatch)
    incremental.save(_state(2), str(tmp_path / "b.ckpt"), base=a)
    with CheckpointFile(a) as f:
        frozen_chunks = f.storages[0].n_chunks  # the storages in the order the state lists them
    assert reads.chunks >= frozen_chunks  # checked before the first reference
    first = reads.chunks
    incremental.save(_state(3), str(tmp_path / "c.ckpt"), base=a)
    incremental.save(_state(4), str(tmp_path / "d.ckpt"), base=str(tmp_path / "c.ckpt"))
    assert reads.chunks == first  # the same chunks of a, never read again in this process
    assert torch.equal(ckptfmt.load(str(tmp_path / "d.ckpt"))["frozen"], FROZEN)


def test_a_rewritten_base_is_checked_again(tmp_path, monkeypatch):
    # the verdicts are kept by the file's identity, not by its name or its recorded file id
    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    incremental.save(_state(2), str(tmp_path / "b.ckpt"), base=a)
    _flip_a_bit_of_the_largest_chunk(a)  # rewritten in place: a new modification time
    incremental.save(_state(3), str(tmp_path / "c.ckpt"), base=a)
    assert torch.equal(ckptfmt.load(str(tmp_path / "c.ckpt"))["frozen"], FROZEN)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ckptfmt.backend() != "c",
    reason="fork snapshots need Linux and the C engine",
)
def test_a_forked_save_against_a_damaged_base_fails_then_heals(tmp_path):
    a, b, c = (str(tmp_path / n) for n in ("a.ckpt", "b.ckpt", "c.ckpt"))
    incremental.save(_state(1), a)
    k, offset = _flip_a_bit_of_the_largest_chunk(a)
    handle = incremental.save(_state(2), b, base=a, blocking=False, snapshot="fork")
    assert handle is not None
    with pytest.raises(ckptfmt.CorruptError, match=rf"cannot refer to chunk {k} of {a} \(offset {offset}\)"):
        handle.wait()
    assert not glob.glob(b)  # nothing committed
    # the damage is known in this process now: the next forked save writes that chunk
    handle = incremental.save(_state(3), c, base=a, blocking=False, snapshot="fork")
    assert handle is not None
    handle.wait()
    assert torch.equal(ckptfmt.load(c)["frozen"], FROZEN)


def test_verdicts_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(basecheck, "MAX_FILES", 2)
    for n in range(4):
        base = str(tmp_path / f"base{n}.ckpt")
        incremental.save(_state(n), base)
        incremental.save(_state(n + 1), str(tmp_path / f"next{n}.ckpt"), base=base)
    assert len(basecheck._verdicts) == 2  # the two newest bases' (each save checks its base)


def test_an_object_store_run_whose_base_is_damaged(s3_server, s3_bucket, caplog):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/dmg"
    m = ckptfmt.CheckpointManager(url, incremental=True, keep_last=2, storage_options=options)
    m.save(1, _state(1, S3_FROZEN))
    client = s3_server.client()
    key = "dmg/step-000000001/state.ckpt"
    raw = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    with CheckpointFile(f"{url}/step-000000001/state.ckpt", storage_options=options) as f:
        big = max(f.chunks, key=lambda c: c.stored_len)
    raw[big.offset + 10] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        for s in (2, 3):
            m.save(s, _state(s, S3_FROZEN))
    assert torch.equal(m.load(fallback=True)["frozen"], S3_FROZEN)
    assert "fails its check" in caplog.text


def test_an_encrypted_base_whose_chunk_is_damaged(tmp_path, caplog):
    key = bytes(range(32))
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_state(1), a, encrypt_with=key)
    with CheckpointFile(a, decrypt_with=key) as f:
        big = max(f.chunks, key=lambda c: c.stored_len)
    raw = bytearray(open(a, "rb").read())
    raw[big.offset + 10] ^= 1  # the chunk's GCM tag no longer holds
    with open(a, "wb") as out:
        out.write(raw)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        incremental.save(_state(2), b, base=a, encrypt_with=key)
    assert torch.equal(ckptfmt.load(b, decrypt_with=key)["frozen"], FROZEN)
    assert "fails its check" in caplog.text


def test_a_base_rewritten_in_place_with_its_time_put_back_is_checked_again(tmp_path):
    """A bit flipped in place and the modification time restored (cp -p, rsync --inplace -t):
    the change time, which no one can set, tells the file is not the one checked."""
    import os

    a, b, c = (str(tmp_path / n) for n in ("a.ckpt", "b.ckpt", "c.ckpt"))
    incremental.save(_state(1), a)
    incremental.save(_state(2), b, base=a)  # a's chunks checked and found sound
    st = os.stat(a)
    with CheckpointFile(a) as f:
        big = max(f.chunks, key=lambda ch: ch.stored_len)
    with open(a, "r+b") as out:  # the same inode and size
        out.seek(big.offset + 10)
        byte = out.read(1)
        out.seek(big.offset + 10)
        out.write(bytes([byte[0] ^ 1]))
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    incremental.save(_state(3), c, base=a)
    assert torch.equal(ckptfmt.load(c)["frozen"], FROZEN)


def test_a_file_the_base_refers_to_on_a_store_is_checked_each_time(s3_server, s3_bucket):
    """c refers to a's chunks through b; a replaced by a damaged copy of the same id and length
    (the reader knows no version of a referenced object): d's save checks them again."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/refver"
    a, b, c, d = (f"{url}/{n}.ckpt" for n in "abcd")
    incremental.save(_state(1, S3_FROZEN), a, storage_options=options)
    incremental.save(_state(2, S3_FROZEN), b, base=a, storage_options=options)
    incremental.save(_state(3, S3_FROZEN), c, base=b, storage_options=options)
    client = s3_server.client()
    raw = bytearray(client.get_object(Bucket=bucket, Key="refver/a.ckpt")["Body"].read())
    with CheckpointFile(a, storage_options=options) as f:
        big = max(f.chunks, key=lambda ch: ch.stored_len)
    raw[big.offset + 10] ^= 1
    client.put_object(Bucket=bucket, Key="refver/a.ckpt", Body=bytes(raw))
    incremental.save(_state(4, S3_FROZEN), d, base=b, storage_options=options)
    assert torch.equal(ckptfmt.load(d, storage_options=options)["frozen"], S3_FROZEN)


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
def test_a_forked_run_whose_base_cannot_be_read_heals_at_the_next_save(tmp_path, monkeypatch):
    """The check's read fails (a bad sector: EIO): the forked save that referred to the chunk
    fails, naming no corruption, and the next forked save writes it: the run goes on."""
    import errno

    m = ckptfmt.CheckpointManager(
        str(tmp_path / "run"), keep_last=2, incremental=True, snapshot="fork", blocking=False
    )
    m.save(1, _state(1))
    m.wait()
    original = CheckpointFile.read_into

    def failing(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
        if check_only and "step-000000001" in f.path:  # a bad sector under step 1's chunk
            raise OSError(errno.EIO, "Input/output error")
        return original(f, items, verify, check_only)

    monkeypatch.setattr(CheckpointFile, "read_into", failing)
    failed = []
    for step in (2, 3, 4):
        try:
            m.save(step, _state(step))
            m.wait()
        except ckptfmt.CheckpointError as e:
            failed.append((step, type(e)))
    assert failed == [(2, ckptfmt.CheckpointError)]
    monkeypatch.setattr(CheckpointFile, "read_into", original)
    assert m.latest().step == 4
    assert torch.equal(m.load()["frozen"], FROZEN)


def test_an_error_about_a_referenced_object_names_its_url(s3_server, s3_bucket):
    """A chunk that lies in another object is named by that object's URL as given, not a path
    with its "//" folded ("s3:/bucket/...")."""
    bucket, options = s3_bucket
    a, b = f"s3://{bucket}/named/a.ckpt", f"s3://{bucket}/named/b.ckpt"
    incremental.save(_state(1, S3_FROZEN), a, storage_options=options)
    incremental.save(_state(2, S3_FROZEN), b, base=a, storage_options=options)
    client = s3_server.client()
    raw = bytearray(client.get_object(Bucket=bucket, Key="named/a.ckpt")["Body"].read())
    with CheckpointFile(a, storage_options=options) as f:
        big = max(f.chunks, key=lambda ch: ch.stored_len)
    raw[big.offset + 10] ^= 1
    client.put_object(Bucket=bucket, Key="named/a.ckpt", Body=bytes(raw))
    with pytest.raises(ckptfmt.CorruptError) as caught:
        ckptfmt.load(b, storage_options=options)
    assert a in str(caught.value)


def test_a_sound_object_the_base_refers_to_is_checked_once(s3_server, s3_bucket, monkeypatch):
    """A chained run on a store: the frozen chunks lie in a, checked when b and c were saved
    against it; d and e refer to them through c and read none of them again (a's version,
    named by a HEAD, is the same): a run's frozen weights are downloaded once per process."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/chain"
    a, b, c, d, e = (f"{url}/{n}.ckpt" for n in "abcde")
    incremental.save(_state(1, S3_FROZEN), a, storage_options=options)
    incremental.save(_state(2, S3_FROZEN), b, base=a, storage_options=options)
    incremental.save(_state(3, S3_FROZEN), c, base=b, storage_options=options)
    reads = _Reads(monkeypatch)
    incremental.save(_state(4, S3_FROZEN), d, base=c, storage_options=options)
    incremental.save(_state(5, S3_FROZEN), e, base=c, storage_options=options)
    assert reads.chunks == 0
    assert torch.equal(ckptfmt.load(e, storage_options=options)["frozen"], S3_FROZEN)


def test_an_object_the_base_refers_to_costs_no_request_of_its_own(s3_faults):
    """The base's reader opens each object it refers to (one HEAD, which names its version)
    before any chunk of it is referred to: the check keys its verdicts by that version and
    asks the store nothing more, so a save looks up each referenced object once."""
    bucket, options = s3_faults.new_bucket(), s3_faults.storage_options()
    url = f"s3://{bucket}/heads"
    a, b, c, d, e = (f"{url}/{n}.ckpt" for n in "abcde")
    incremental.save(_state(1, S3_FROZEN), a, storage_options=options)
    incremental.save(_state(2, S3_FROZEN), b, base=a, storage_options=options)
    incremental.save(_state(3, S3_FROZEN), c, base=b, storage_options=options)
    s3_faults.clear_counts()
    incremental.save(_state(4, S3_FROZEN), d, base=c, storage_options=options)
    incremental.save(_state(5, S3_FROZEN), e, base=c, storage_options=options)
    assert s3_faults.count("HEAD", "/heads/a.ckpt") == 2, s3_faults.requests()  # one a save
    assert torch.equal(ckptfmt.load(e, storage_options=options)["frozen"], S3_FROZEN)


def test_a_damaged_chunk_is_warned_about_once_per_process(tmp_path, caplog):
    """Saves against one damaged base (a fixed base=) each write the chunk again, and say so
    once: the same chunk of the same file is not warned about at every save."""
    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    k, offset = _flip_a_bit_of_the_largest_chunk(a)
    saved = [str(tmp_path / f"s{n}.ckpt") for n in range(3)]
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        for n, path in enumerate(saved):
            incremental.save(_state(n + 2), path, base=a)
    warned = [
        r for r in caplog.records if f"chunk {k} of {a} (offset {offset}) fails its check" in r.getMessage()
    ]
    assert len(warned) == 1, caplog.text
    for path in saved:  # each save wrote the chunk again
        assert torch.equal(ckptfmt.load(path)["frozen"], FROZEN)
        assert ckptfmt.verify(path).ok


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
def test_forked_saves_against_a_fixed_base_retry_a_chunk_that_could_not_be_read(tmp_path, monkeypatch):
    """A passing EIO under a base chunk: the forked save that referred to it fails, the next
    writes it and checks it again once RETRY_SECONDS have passed (it reads now), and the one
    after refers to it again instead of writing it at every save of the process."""
    import errno
    import os

    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    original = CheckpointFile.read_into
    eio = [True]

    def failing(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
        if check_only and eio[0] and f.path == a:  # a bad sector under a's chunk, for a while
            raise OSError(errno.EIO, "Input/output error")
        return original(f, items, verify, check_only)

    monkeypatch.setattr(CheckpointFile, "read_into", failing)
    monkeypatch.setattr(basecheck, "RETRY_SECONDS", 0.0)

    def forked(step: int) -> str:
        path = str(tmp_path / f"s{step}.ckpt")
        handle = incremental.save(_state(step), path, base=a, blocking=False, snapshot="fork")
        assert handle is not None
        handle.wait()
        return path

    with pytest.raises(ckptfmt.CheckpointError, match="could not be read"):
        forked(2)
    eio[0] = False  # the disk reads again
    written = forked(3)  # the chunk is written here, and checked again afterwards
    assert incremental.referenced_files(written) == []
    again = forked(4)
    assert incremental.referenced_files(again) == [os.path.abspath(a)]
    assert torch.equal(ckptfmt.load(again)["frozen"], FROZEN)


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
def test_a_chunk_that_could_not_be_read_is_not_read_again_before_its_time(tmp_path, monkeypatch):
    """While RETRY_SECONDS have not passed, forked saves write the chunk and do not read it."""
    import errno

    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    original = CheckpointFile.read_into
    tries = []

    def failing(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
        if check_only and f.path == a:
            tries.append(len(items))
            raise OSError(errno.EIO, "Input/output error")
        return original(f, items, verify, check_only)

    monkeypatch.setattr(CheckpointFile, "read_into", failing)
    monkeypatch.setattr(basecheck, "RETRY_SECONDS", 3600.0)
    for step in (2, 3, 4):
        path = str(tmp_path / f"s{step}.ckpt")
        handle = incremental.save(_state(step), path, base=a, blocking=False, snapshot="fork")
        assert handle is not None
        if step == 2:
            with pytest.raises(ckptfmt.CheckpointError, match="could not be read"):
                handle.wait()
        else:
            handle.wait()
            assert incremental.referenced_files(path) == []
    assert len(tries) == 1  # step 2's check alone


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ckptfmt.backend() != "c",
    reason="fork snapshots need Linux and the C engine",
)
def test_a_failed_forked_save_closes_its_base_while_its_error_is_held(tmp_path):
    """The error of a failed forked save is kept (its traceback holds the frames that held the
    base open): the save closed what it opened before raising, so no descriptor stays."""
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_state(1), a)
    _flip_a_bit_of_the_largest_chunk(a)
    before = _open_fds()
    handle = incremental.save(_state(2), b, base=a, blocking=False, snapshot="fork")
    assert handle is not None
    with pytest.raises(ckptfmt.CorruptError) as caught:
        handle.wait()
    held = caught.value  # noqa: F841 (kept alive on purpose, with its traceback)
    assert _open_fds() == before


def test_a_failed_blocking_save_closes_its_base_while_its_error_is_held(tmp_path):
    """The same for a blocking save that fails after its base was opened (a state that
    cannot be stored is refused while the base is open)."""
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_state(1), a)
    before = _open_fds()
    with pytest.raises(ckptfmt.CheckpointError) as caught:
        incremental.save({**_state(2), "bad": object()}, b, base=a)
    held = caught.value  # noqa: F841
    assert _open_fds() == before


_COPY_SAVE_FAILS = """
import os, resource, signal, sys

import torch

from ckptfmt.files import incremental

a, b = sys.argv[1], sys.argv[2]
frozen = torch.arange(1 << 20, dtype=torch.float32)
incremental.save({"frozen": frozen, "a": torch.zeros(8)}, a)


def on_a():
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == a
        except OSError:  # the listing's own descriptor, closed since
            pass
    return count


# the disk takes no file above 1 MiB (a quota): the new chunks' writes fail with EFBIG
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
handle = incremental.save({"frozen": frozen, "a": torch.ones(1 << 20)}, b, base=a, blocking=False)
try:
    handle.wait()
except OSError as e:
    held = e  # kept, with its traceback
    print("failed", e.errno, on_a())
"""


def test_a_failed_copy_save_closes_its_base_while_its_error_is_held(tmp_path):
    """A non-blocking copy save whose writes fail on its writer thread (a file size limit:
    EFBIG) before the file is finished: the base it read is closed before the error is handed
    over, though the error (and its traceback) is kept."""
    import errno
    import os
    import subprocess

    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(ckptfmt.__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run(
        [sys.executable, "-c", _COPY_SAVE_FAILS, a, b], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["failed", str(errno.EFBIG), "0"], proc.stdout + proc.stderr


# -- the base's lifetime: who closes it, and what a closed one refers to ----------------------


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
def test_an_interrupt_in_a_forked_saves_thread_start_leaves_the_base_to_the_save(tmp_path, monkeypatch):
    """An interrupt in Thread.start() after the waiter thread began: the save goes on there,
    and the caller's error path must not close the base under it (the waiter would then find
    nothing to check and refer to a damaged chunk: a committed file that fails to load)."""
    import threading

    from ckptfmt.background import inflight

    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_state(1), a)
    k, offset = _flip_a_bit_of_the_largest_chunk(a)
    start, adopt = threading.Thread.start, incremental.ContentIndex.adopt
    unwound = threading.Event()

    def interrupted_start(self):  # type: ignore[no-untyped-def]
        start(self)
        if self.name.startswith("ckptfmt-save-"):
            import time

            owner = self._args[8]  # forksave._finish's `owner`: the waiter takes it first
            assert isinstance(owner, type(threading.Lock()))
            deadline = time.monotonic() + 60
            while not owner.locked() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyboardInterrupt  # the save is the waiter's now

    def adopt_once_unwound(self, *args):  # type: ignore[no-untyped-def]
        unwound.wait(60)  # the writer's findings come after the caller's error has passed
        return adopt(self, *args)

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    monkeypatch.setattr(incremental.ContentIndex, "adopt", adopt_once_unwound)
    with pytest.raises(KeyboardInterrupt):
        try:
            incremental.save(_state(2), b, base=a, blocking=False, snapshot="fork")
        finally:
            unwound.set()
    monkeypatch.setattr(threading.Thread, "start", start)
    inflight.wait_for_path(b)
    # the save checked the base's chunk and failed, as a forked save against a damaged base does
    with pytest.raises(RuntimeError, match="never waited for") as caught:
        inflight.raise_unobserved()
    assert isinstance(caught.value.__cause__, ckptfmt.CorruptError)
    assert f"cannot refer to chunk {k} of {a} (offset {offset})" in str(caught.value.__cause__)
    assert not glob.glob(b)


def _frozen_piece() -> list[tuple[memoryview, int]]:
    return [(memoryview(FROZEN.numpy()).cast("B"), 4)]


def test_a_closed_content_index_refers_to_nothing(tmp_path):
    """Once closed, no chunk can be checked: classify writes every chunk and adopt refuses a
    forked writer's findings, never taking a chunk as sound for want of a base to read (an
    open index refers to the same chunk)."""
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_state(1), a)
    open_index = incremental.ContentIndex(b, a)
    assert open_index.classify(0, _frozen_piece(), "python", 1) != [None]
    open_index.close()
    closed = incremental.ContentIndex(b, a)
    closed.close()
    assert closed.classify(0, _frozen_piece(), "python", 1) == [None]
    forked = incremental.ContentIndex(b, a)
    keys = forked.held_keys()
    digest = open_index.digests[0]
    forked.close()
    with pytest.raises(ckptfmt.CheckpointError, match="base was closed before they were checked"):
        forked.adopt([digest], [keys.index((FROZEN.nbytes, digest))])


def test_closing_a_content_index_waits_for_a_check_under_way(tmp_path, monkeypatch):
    """close() on another thread while a check reads the base: the base is closed once the
    read is over, not under it (the read would fail on a closed descriptor, or read another
    file that took its number)."""
    import threading
    import time

    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_state(1), a)
    index = incremental.ContentIndex(b, a)
    original = CheckpointFile.read_into
    reading = threading.Event()
    read_ended: list[float] = []

    def slow(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
        if check_only:
            reading.set()
            time.sleep(0.5)
        try:
            return original(f, items, verify, check_only)
        finally:
            read_ended.append(time.monotonic())

    monkeypatch.setattr(CheckpointFile, "read_into", slow)
    found: list[object] = []
    checking = threading.Thread(target=lambda: found.extend(index.classify(0, _frozen_piece(), "python", 1)))
    checking.start()
    assert reading.wait(60)
    index.close()
    closed_at = time.monotonic()
    checking.join(60)
    assert read_ended and read_ended[0] <= closed_at
    assert found and found[0] is not None  # read whole and found sound: referred to


# -- the identity a referenced local file's verdicts are kept by ------------------------------


def test_a_referenced_file_replaced_after_the_reader_opened_it(tmp_path, monkeypatch):
    """b refers to a; while c is saved against b, a is replaced by a damaged copy (same file id
    and length: a restore) just after b's reader opened it.  c's check read the old file: its
    verdict is kept under the old file's stamp, not the new one's, so d's save reads the new
    file's chunk, finds it damaged and writes it."""
    import os
    import shutil

    a, b, c, d = (str(tmp_path / f"{n}.ckpt") for n in "abcd")
    incremental.save(_state(1), a)
    incremental.save(_state(2), b, base=a)
    assert incremental.referenced_files(b) == [a]
    bad = str(tmp_path / "bad.tmp")
    shutil.copyfile(a, bad)
    _flip_a_bit_of_the_largest_chunk(bad)
    original = CheckpointFile.external_problem
    done = []

    def replaced_once_opened(f, k):  # type: ignore[no-untyped-def]
        out = original(f, k)  # b's reader opens a here
        if not done and f.path == b:
            done.append(1)
            os.replace(bad, a)
        return out

    monkeypatch.setattr(CheckpointFile, "external_problem", replaced_once_opened)
    incremental.save(_state(3), c, base=b)
    monkeypatch.setattr(CheckpointFile, "external_problem", original)
    assert done
    incremental.save(_state(4), d, base=b)
    assert torch.equal(ckptfmt.load(d)["frozen"], FROZEN)
    assert ckptfmt.verify(d).ok


def test_a_referenced_file_opened_again_must_be_the_file_first_opened(tmp_path, monkeypatch):
    """A reader lets go of a referenced file to keep few open and opens it again later: a file
    put in its place meanwhile (even an identical copy: another inode) is refused, as an object
    at another version is, so what was read and checked through it stays about one file."""
    import os
    import shutil

    from ckptfmt.files import reader

    a, b, c = (str(tmp_path / f"{n}.ckpt") for n in "abc")
    second = torch.arange(1 << 19, dtype=torch.float64)  # 4 MiB: changed at b, then kept
    incremental.save({**_state(1), "second": torch.zeros(1 << 19, dtype=torch.float64)}, a)
    incremental.save({**_state(2), "second": second}, b, base=a)
    incremental.save({**_state(3), "second": second}, c, base=b)
    assert sorted(incremental.referenced_files(c)) == [a, b]
    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 1)
    with CheckpointFile(c) as f:
        on = {f.externals[ch.source].rel: k for k, ch in enumerate(f.chunks) if ch.source >= 0}
        k_a, k_b = on["a.ckpt"], on["b.ckpt"]

        def read(k: int) -> None:
            f.read_into([(k, memoryview(bytearray(f.chunks[k].raw_len)))], True)

        read(k_a)
        read(k_b)  # a is let go of
        shutil.copyfile(a, str(tmp_path / "copy.tmp"))
        os.replace(str(tmp_path / "copy.tmp"), a)  # the same bytes, another file
        with pytest.raises(ckptfmt.CorruptError, match="changed since this file first opened it"):
            read(k_a)


# -- reading again what could not be read: after the commit, within a budget -----------------


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
def test_a_forked_saves_retry_runs_after_its_commit_and_its_failure_fails_nothing(
    tmp_path, monkeypatch, caplog
):
    """The chunk a forked save wrote because it could not be read before is read again once the
    file is committed (a slow store delays no commit), and a failure of that read, whatever it
    is, is logged: the save stands."""
    import errno
    import os

    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    original = CheckpointFile.read_into
    saving: list[str] = []
    committed_at_retry: list[bool] = []

    def failing(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
        if check_only and f.path == a:
            if len(saving) == 1:  # step 2's check: a bad sector
                raise OSError(errno.EIO, "Input/output error")
            committed_at_retry.append(os.path.exists(saving[-1]))
            raise RuntimeError("the store's client broke")  # not an OSError
        return original(f, items, verify, check_only)

    monkeypatch.setattr(CheckpointFile, "read_into", failing)
    monkeypatch.setattr(basecheck, "RETRY_SECONDS", 0.0)
    for step in (2, 3):
        path = str(tmp_path / f"s{step}.ckpt")
        saving.append(path)
        handle = incremental.save(_state(step), path, base=a, blocking=False, snapshot="fork")
        assert handle is not None
        if step == 2:
            with pytest.raises(ckptfmt.CheckpointError, match="could not be read"):
                handle.wait()
        else:
            with caplog.at_level(logging.WARNING, logger="ckptfmt"):
                handle.wait()
    assert committed_at_retry == [True]
    assert "the store's client broke" in caplog.text
    monkeypatch.setattr(CheckpointFile, "read_into", original)
    assert incremental.referenced_files(saving[-1]) == []
    assert torch.equal(ckptfmt.load(saving[-1])["frozen"], FROZEN)


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
@pytest.mark.parametrize("budget", ["bytes", "seconds"])
def test_a_forked_save_reads_again_within_its_budget(tmp_path, monkeypatch, budget):
    """Four 1 MiB base chunks could not be read; each later forked save reads again one chunk's
    worth (RETRY_BYTES), or one window (RETRY_BUDGET_SECONDS spent), and the rest waits."""
    import errno

    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a, chunk_size=1 << 20)
    original = CheckpointFile.read_into
    eio = [True]
    saving = [2]
    reads: list[tuple[int, int]] = []  # (the save's step, chunks read)

    def failing(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
        if check_only and f.path == a:
            if eio[0]:
                raise OSError(errno.EIO, "Input/output error")
            reads.append((saving[0], len(items)))
        return original(f, items, verify, check_only)

    monkeypatch.setattr(CheckpointFile, "read_into", failing)
    monkeypatch.setattr(basecheck, "RETRY_SECONDS", 0.0)
    if budget == "bytes":
        monkeypatch.setattr(basecheck, "RETRY_BYTES", 1 << 20)
    else:
        monkeypatch.setattr(basecheck, "WINDOW_BYTES", 1 << 20)
        monkeypatch.setattr(basecheck, "RETRY_BUDGET_SECONDS", 0.0)

    def forked(step: int) -> None:
        saving[0] = step
        handle = incremental.save(
            _state(step), str(tmp_path / f"s{step}.ckpt"), base=a, blocking=False, snapshot="fork"
        )
        assert handle is not None
        handle.wait()

    with pytest.raises(ckptfmt.CheckpointError, match="could not be read"):
        forked(2)
    eio[0] = False
    for step in (3, 4, 5, 6):
        forked(step)
    assert reads == [(3, 1), (4, 1), (5, 1), (6, 1)]  # one chunk after each save
    forked(7)
    assert len(reads) == 4  # all four referred to: nothing left to read again
    with CheckpointFile(str(tmp_path / "s7.ckpt")) as f:
        assert sum(ch.source >= 0 for ch in f.chunks) == 4


# -- the bounds forget fail-safe ---------------------------------------------------------------


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
def test_a_forgotten_unreadable_chunk_is_written_not_a_failed_save(tmp_path, monkeypatch):
    """The unreadable chunks' bound forgets them: a forked save after that must write such a
    chunk (it may still not read), not refer to it and fail."""
    import errno

    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    original = CheckpointFile.read_into

    def failing(f, items, verify, check_only=False):  # type: ignore[no-untyped-def]
        if check_only and f.path == a:  # a bad sector that stays
            raise OSError(errno.EIO, "Input/output error")
        return original(f, items, verify, check_only)

    monkeypatch.setattr(CheckpointFile, "read_into", failing)
    monkeypatch.setattr(basecheck, "MAX_UNREADABLE", 0)  # every entry forgotten at once
    for step in (2, 3, 4):
        path = str(tmp_path / f"s{step}.ckpt")
        handle = incremental.save(_state(step), path, base=a, blocking=False, snapshot="fork")
        assert handle is not None
        if step == 2:
            with pytest.raises(ckptfmt.CheckpointError, match="could not be read"):
                handle.wait()
        else:
            handle.wait()
            assert incremental.referenced_files(path) == []
    monkeypatch.setattr(CheckpointFile, "read_into", original)
    assert torch.equal(ckptfmt.load(str(tmp_path / "s4.ckpt"))["frozen"], FROZEN)


@pytest.mark.skipif(ckptfmt.backend() != "c", reason="a forked save's writer is the C engine's")
def test_a_forgotten_damaged_chunk_is_written_not_a_failed_save(tmp_path, monkeypatch):
    """The verdicts' bound drops a damaged base's verdicts (other bases checked since): the next
    forked save against it writes the damaged chunk, rather than refer to it and fail."""
    a = str(tmp_path / "a.ckpt")
    incremental.save(_state(1), a)
    _flip_a_bit_of_the_largest_chunk(a)
    monkeypatch.setattr(basecheck, "MAX_FILES", 1)
    handle = incremental.save(_state(2), str(tmp_path / "b.ckpt"), base=a, blocking=False, snapshot="fork")
    assert handle is not None
    with pytest.raises(ckptfmt.CorruptError, match="cannot refer to chunk"):
        handle.wait()
    other = str(tmp_path / "other.ckpt")
    incremental.save(_state(1), other)
    incremental.save(_state(2), str(tmp_path / "other2.ckpt"), base=other)  # a's verdicts dropped
    assert len(basecheck._verdicts) == 1
    c = str(tmp_path / "c.ckpt")
    handle = incremental.save(_state(3), c, base=a, blocking=False, snapshot="fork")
    assert handle is not None
    handle.wait()
    assert torch.equal(ckptfmt.load(c)["frozen"], FROZEN)

"""How many engine threads write a file: one for plain chunks to a file on tmpfs or to a memfd
(an object upload's spool), where writes to one file take turns under its inode lock (a second thread only waits or spins and, on a busy
machine, waits for a CPU too), every core's otherwise.

The saves are real (the C engine, a tmpfs folder under /dev/shm); which threads did the work
is read from the kernel's CPU accounting: the process's CPU time less the calling thread's.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile

import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt.engine import filesystems, native
from ckptfmt.engine.chunkwrite import write_threads
from ckptfmt.engine.filesystems import filesystem_type, is_memfd, type_of_device
from ckptfmt.engine.writeoptions import WriteOptions

pytestmark = pytest.mark.skipif(not native.available(), reason="the C engine writes with threads")

STATE_BYTES = 64 << 20  # 16 chunks of 4 MiB: work for every thread the engine starts


@pytest.fixture
def shm_dir():
    """A folder on tmpfs (/dev/shm, as on every Linux machine this runs on), removed after."""
    d = tempfile.mkdtemp(prefix="ckptfmt-threads-", dir="/dev/shm")
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            assert filesystem_type(fd) == "tmpfs", "/dev/shm is not tmpfs here"
        finally:
            os.close(fd)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def four_cores(monkeypatch):
    """The engine's default of one thread per core, as on a machine with four cores."""
    monkeypatch.delenv("CKPTFMT_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert native.default_threads() == 4


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(STATE_BYTES // 4, generator=g), "step": 7}


def _cpu_of_save(state, path, **kw):
    """(CPU seconds of the calling thread, of every other thread of the process) during a save."""
    me, caller = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
    ckptfmt.save(state, path, **kw)
    me2, caller2 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
    total = me2.ru_utime + me2.ru_stime - me.ru_utime - me.ru_stime
    own = caller2.ru_utime + caller2.ru_stime - caller.ru_utime - caller.ru_stime
    return own, max(0.0, total - own)


def test_a_save_to_tmpfs_is_written_by_the_calling_thread_alone(shm_dir, four_cores):
    state = _state()
    path = os.path.join(shm_dir, "a.ckpt")
    ckptfmt.save(state, path)  # the first save's imports and allocations, out of the measure
    own, others = _cpu_of_save(state, os.path.join(shm_dir, "b.ckpt"))
    # with four writer threads the other three did about three quarters of the work
    assert others < 0.2 * (own + others), (own, others)
    assert_same(ckptfmt.load(os.path.join(shm_dir, "b.ckpt")), state)
    ckptfmt.verify(os.path.join(shm_dir, "b.ckpt"))


def test_a_compressed_save_to_tmpfs_keeps_every_thread(shm_dir, four_cores):
    """Compression is CPU work that threads share; only the writes take turns."""
    state = {"w": torch.zeros(STATE_BYTES // 4).bfloat16().float()}  # compresses: zstd works
    ckptfmt.save(state, os.path.join(shm_dir, "a.ckpt"), compression="zstd")
    own, others = _cpu_of_save(state, os.path.join(shm_dir, "b.ckpt"), compression="zstd")
    assert others > 0.0, (own, others)
    assert_same(ckptfmt.load(os.path.join(shm_dir, "b.ckpt")), state)


def test_write_threads_by_filesystem_and_options(shm_dir, tmp_path, four_cores, monkeypatch):
    plain = WriteOptions()
    with open(os.path.join(shm_dir, "f"), "wb") as on_tmpfs:
        assert write_threads(on_tmpfs.fileno(), plain) == 1
        assert write_threads(on_tmpfs.fileno(), WriteOptions(compression="zstd")) == 4
        monkeypatch.setenv("CKPTFMT_THREADS", "3")  # the user's choice is obeyed
        assert write_threads(on_tmpfs.fileno(), plain) == 3
        monkeypatch.delenv("CKPTFMT_THREADS")
        with native.threads_at_most(2):
            assert write_threads(on_tmpfs.fileno(), WriteOptions(compression="zstd")) == 2
    # an object upload's spool (a memfd) is on no mounted filesystem, but shared memory as
    # tmpfs's files are: its writes take turns too
    spool = os.memfd_create("ckptfmt-test", os.MFD_CLOEXEC)
    try:
        assert filesystem_type(spool) is None
        assert is_memfd(spool)
        assert write_threads(spool, plain) == 1
        assert write_threads(spool, WriteOptions(compression="zstd")) == 4
    finally:
        os.close(spool)
    with open(tmp_path / "f", "wb") as elsewhere:
        kind = filesystem_type(elsewhere.fileno())
        assert kind is not None
        assert not is_memfd(elsewhere.fileno())
        assert write_threads(elsewhere.fileno(), plain) == (1 if kind == "tmpfs" else 4)
    assert not is_memfd(-1)


MOUNTINFO = (
    "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "30 22 0:27 / /dev/shm rw,nosuid shared:5 - tmpfs tmpfs rw,size=24683784k\n"
    "31 22 0:28 / /mnt/with\\040space rw shared:6 master:2 - fuse.sshfs host:/ rw\n"
)


@pytest.mark.parametrize(
    "device, kind",
    [("253:1", "ext4"), ("0:27", "tmpfs"), ("0:28", "fuse.sshfs"), ("0:1", None), ("", None)],
)
def test_mountinfo_lines_name_the_type_of_their_device(device, kind):
    assert type_of_device(MOUNTINFO, device) == kind


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "0:27\n",
        "30 22 0:27 / /dev/shm rw\n",
        "30 22 0:27 / /dev/shm rw - \n",
        "- tmpfs\n",
        "\x00" * 50,
    ],
)
def test_malformed_mountinfo_names_no_type(text):
    assert type_of_device(text, "0:27") is None


#: the paths this process opened while a test listens (sys.audit's "open" event: every file the
#: interpreter opens, the real one, nothing replaced)
_opened: list[str] | None = None


def _record_opens(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], str):
        _opened.append(args[0])


sys.addaudithook(_record_opens)


@pytest.fixture
def mountinfo_reads():
    """The number of times mountinfo is opened in the test, counted from a fresh table."""
    global _opened
    filesystems.forget_devices()
    _opened = []
    try:
        yield lambda: _opened.count(filesystems.MOUNTINFO)
    finally:
        _opened = None
        filesystems.forget_devices()


def test_a_save_of_many_files_reads_mountinfo_once_per_device(shm_dir, tmp_path, mountinfo_reads):
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    for i in range(5):  # the files of a sharded save, all in one folder on tmpfs
        ckptfmt.save(state, os.path.join(shm_dir, f"shard-{i}.ckpt"))
    assert mountinfo_reads() == 1
    ckptfmt.save(state, str(tmp_path / "elsewhere.ckpt"))  # another device: read for it
    ckptfmt.save(state, str(tmp_path / "elsewhere-2.ckpt"))
    same_device = os.stat(tmp_path).st_dev == os.stat(shm_dir).st_dev
    assert mountinfo_reads() == (1 if same_device else 2)
    for i in range(5):
        assert_same(ckptfmt.load(os.path.join(shm_dir, f"shard-{i}.ckpt")), state)


def test_a_memfd_device_is_remembered_as_on_no_mount(mountinfo_reads):
    spools = [os.memfd_create("ckptfmt-test", os.MFD_CLOEXEC) for _ in range(3)]
    try:
        assert [filesystem_type(fd) for fd in spools] == [None, None, None]
    finally:
        for fd in spools:
            os.close(fd)
    assert mountinfo_reads() == 1


def test_an_unreadable_mountinfo_is_not_remembered(shm_dir, mountinfo_reads, monkeypatch):
    with open(os.path.join(shm_dir, "f"), "wb") as f:
        monkeypatch.setattr(filesystems, "MOUNTINFO", os.path.join(shm_dir, "no-such-mountinfo"))
        assert filesystem_type(f.fileno()) is None
        monkeypatch.undo()
        assert filesystem_type(f.fileno()) == "tmpfs"  # read again, now that it can be
        assert filesystem_type(f.fileno()) == "tmpfs"
    assert mountinfo_reads() == 1


@pytest.fixture
def engine_calls(monkeypatch):
    """The pieces of each engine call that writes chunks, in order, as a list."""
    from ckptfmt.engine.chunkwrite import ChunkWriter

    calls: list[int] = []
    write_run = ChunkWriter._write_run

    def counting(self, pieces, digests=None):
        calls.append(len(pieces))
        write_run(self, pieces, digests)

    monkeypatch.setattr(ChunkWriter, "_write_run", counting)
    return calls


def test_a_threaded_store_save_is_not_cut_into_an_engine_call_per_part(s3_bucket, four_cores, engine_calls):
    """A compressed save to a store writes with four engine threads: its 64 MiB batch of 16 MiB
    chunks is one engine call (each call drains the pool at its end), not four of 16 MiB; a
    plain one, written by one thread into the memfd spool, is still told to the upload every
    16 MiB, in four calls."""
    bucket, options = s3_bucket
    state = _state()
    for compression, calls in (("zstd", 1), (None, 4)):
        engine_calls.clear()
        url = f"s3://{bucket}/calls-{compression}.ckpt"
        ckptfmt.save(state, url, storage_options=options, compression=compression, chunk_size=16 << 20)
        assert len(engine_calls) == calls, (compression, engine_calls)
        assert_same(state, ckptfmt.load(url, storage_options=options))

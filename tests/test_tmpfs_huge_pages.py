"""A save's new file on tmpfs given 2 MiB pages before its chunks are written (MADV_COLLAPSE),
where the huge-page choice (engine/hostmem.py) says so: the same bytes, the same guarantees.

The files are real, in a folder under /dev/shm; whether they hold 2 MiB pages is read from the
kernel (/proc/meminfo's ShmemHugePages, while the file exists).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt.engine import chunkwrite, hostmem
from ckptfmt.engine import native as _native
from ckptfmt.engine.filesystems import filesystem_type
from ckptfmt.engine.writeoptions import WriteOptions
from ckptfmt.format.encode import encode

pytestmark = pytest.mark.skipif(not _native.available(), reason="the C engine collapses the pages")

MiB = 1 << 20
STATE_BYTES = 24 * MiB


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="ckptfmt-huge-", dir="/dev/shm")
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
def collapses(shm_dir):
    """Skip where the kernel cannot give a tmpfs file 2 MiB pages (no MADV_COLLAPSE: before
    Linux 6.1, no transparent huge pages, shmem_enabled `deny`, or no free 2 MiB block)."""
    fd = os.open(os.path.join(shm_dir, "probe"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        regions, err = _native.huge_file(fd, 2 * MiB)
    finally:
        os.close(fd)
        os.unlink(os.path.join(shm_dir, "probe"))
    if err in (errno.EINVAL, errno.ENOMEM, errno.EAGAIN, errno.EPERM, errno.ENOENT):
        pytest.skip(f"this kernel gives no 2 MiB pages to a tmpfs file ({errno.errorcode[err]})")
    assert (regions, err) == (1, 0)
    if hostmem.free_huge_blocks() < 2 * STATE_BYTES // (2 * MiB):  # wants_huge_file would say no
        pytest.skip("too few free 2 MiB blocks: memory is fragmented")


def _huge_pages(setting: str, monkeypatch) -> None:
    monkeypatch.setenv(hostmem.HUGE_PAGES_ENV, setting)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)  # the free blocks read afresh


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(STATE_BYTES // 4, generator=g), "b": torch.arange(1000), "step": 5}


def _shmem_huge_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("ShmemHugePages:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no ShmemHugePages in /proc/meminfo")


def _saved_huge_bytes(state, path: str) -> int:
    """ShmemHugePages gained by saving `state` at `path` (the file kept until measured)."""
    before = _shmem_huge_bytes()
    ckptfmt.save(state, path)
    return _shmem_huge_bytes() - before


def test_a_save_to_tmpfs_gets_2mib_pages_when_asked(shm_dir, collapses, monkeypatch):
    _huge_pages("on", monkeypatch)
    state = _state()
    path = os.path.join(shm_dir, "a.ckpt")
    gained = _saved_huge_bytes(state, path)
    # every whole 2 MiB region below the chunks' end: 12 of the 24 MiB and a little more
    assert gained >= STATE_BYTES - 2 * MiB, gained
    assert_same(ckptfmt.load(path), state)
    ckptfmt.verify(path)


def test_huge_pages_off_leaves_the_file_on_small_pages(shm_dir, collapses, monkeypatch):
    _huge_pages("off", monkeypatch)
    gained = _saved_huge_bytes(_state(), os.path.join(shm_dir, "a.ckpt"))
    assert gained < STATE_BYTES // 2, gained


def test_the_file_is_byte_for_byte_the_same_either_way(shm_dir, collapses, monkeypatch):
    monkeypatch.setenv("CKPTFMT_FILE_ID", "00112233445566778899aabbccddeeff")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    state = _state()
    files = {}
    for setting in ("on", "off"):
        _huge_pages(setting, monkeypatch)
        path = os.path.join(shm_dir, f"{setting}.ckpt")
        ckptfmt.save(state, path)
        with open(path, "rb") as f:
            files[setting] = f.read()
    assert files["on"] == files["off"]


def test_where_the_host_takes_free_2mib_blocks_back_auto_keeps_small_pages(monkeypatch):
    """There a 1 GiB file took 3.6-4.6 s to get its 2 MiB pages against 1.0 s to be written
    on small ones: a file is written once, like a load's destination."""
    monkeypatch.delenv(hostmem.HUGE_PAGES_ENV, raising=False)
    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 1 << 20)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)
    monkeypatch.setattr(hostmem, "_reclaims", True)
    assert not hostmem.wants_huge_file(64 * MiB)
    monkeypatch.setattr(hostmem, "_reclaims", False)
    assert hostmem.wants_huge_file(64 * MiB)
    assert not hostmem.wants_huge_file(2 * MiB)  # below MIN_HUGE_BYTES: too few pages to matter


def test_no_2mib_pages_without_free_2mib_blocks(monkeypatch):
    """Collapsing without free blocks would compact memory first."""
    _huge_pages("on", monkeypatch)
    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 3)
    assert not hostmem.wants_huge_file(64 * MiB)


@pytest.mark.parametrize(
    "options",
    [WriteOptions(compression="zstd"), WriteOptions(sign=lambda *parts: b"")],
    ids=["compressed", "signed"],
)
def test_only_plain_raw_chunks_get_them(shm_dir, monkeypatch, options):
    """A compressed chunk's length is known only once it is compressed, and those files are
    written by several threads; a signed or encrypted one likewise keeps the engine's way."""
    _huge_pages("on", monkeypatch)
    fd = os.open(os.path.join(shm_dir, "x"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert chunkwrite.huge_pages_for(fd, encode(_state()), options, "c") == 0
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)


def test_a_file_on_another_filesystem_or_a_memfd_is_left_alone(tmp_path, monkeypatch):
    _huge_pages("on", monkeypatch)
    encoded = encode(_state())
    fds = [os.memfd_create("spool")]
    if filesystem_type_of(str(tmp_path)) != "tmpfs":
        fds.append(os.open(tmp_path / "x", os.O_CREAT | os.O_RDWR, 0o600))
    try:
        for fd in fds:
            assert chunkwrite.huge_pages_for(fd, encoded, WriteOptions(), "c") == 0
            assert os.fstat(fd).st_size == 0
    finally:
        for fd in fds:
            os.close(fd)


def filesystem_type_of(folder: str) -> str | None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        return filesystem_type(fd)
    finally:
        os.close(fd)


def test_a_file_with_bytes_already_is_refused(shm_dir, collapses):
    """Only a new, empty file: the zero byte each region gets must overwrite nothing."""
    fd = os.open(os.path.join(shm_dir, "x"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"kept")
        assert _native.huge_file(fd, 8 * MiB) == (0, errno.EEXIST)
        assert os.pread(fd, 16, 0) == b"kept"
    finally:
        os.close(fd)


def test_the_chunks_end_is_where_the_index_begins(shm_dir, monkeypatch):
    """chunks_end predicts the engine's layout: storages of whole and partial chunks."""
    _huge_pages("off", monkeypatch)
    state = {"a": torch.zeros(3 * MiB + 5, dtype=torch.uint8), "b": torch.ones(100), "c": torch.empty(0)}
    options = WriteOptions(chunk_size=1 * MiB)
    fd = os.open(os.path.join(shm_dir, "x"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        encoded = encode(state)
        out = chunkwrite.ChunkWriter(fd, bytes(16), options)
        for pieces in chunkwrite._batches(encoded, options.chunk_size):
            out.write(pieces)
        assert out.pos == chunkwrite.chunks_end(encoded, options.chunk_size)
    finally:
        os.close(fd)

"""Fresh host buffers on huge pages, and verification of memory-mapped loads."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys

import pytest
import torch

import ckptfmt
from ckptfmt.engine import hostmem
from ckptfmt.engine import native as _native
from ckptfmt.files.reader import CheckpointFile

needs_engine = pytest.mark.skipif(not _native.available(), reason="the C engine is not built")


@pytest.fixture(autouse=True)
def _huge_pages_auto(monkeypatch):
    """These tests check the host heuristic: a user's CKPTFMT_HUGE_PAGES must not decide for it."""
    monkeypatch.delenv(hostmem.HUGE_PAGES_ENV, raising=False)


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that contains `addr`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping contains {addr:#x}")


@needs_engine
def test_large_buffers_are_advised_for_huge_pages_and_stay_ordinary(monkeypatch):
    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 1 << 20)
    monkeypatch.setattr(hostmem, "_reclaims", False)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)
    t = hostmem.empty_bytes(64 << 20)
    middle = (t.data_ptr() + (32 << 20)) & ~((2 << 20) - 1)
    assert "hg" in _vm_flags(middle)  # MADV_HUGEPAGE on the tensor's own memory
    # an ordinary torch allocation: resizable, and freed with the tensor
    t.untyped_storage().resize_(96 << 20)
    assert t.untyped_storage().nbytes() == 96 << 20


def test_small_and_pinned_buffers_are_plain_torch_allocations():
    small = hostmem.empty_bytes(4096)
    assert small.numel() == 4096 and small.dtype == torch.uint8
    assert hostmem.empty_bytes(0).numel() == 0


@needs_engine
def test_loaded_storages_get_the_advice(monkeypatch):
    import tempfile

    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 1 << 20)
    monkeypatch.setattr(hostmem, "_reclaims", False)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)
    with tempfile.TemporaryDirectory() as d:
        p = f"{d}/big.ckpt"
        state = {"w": torch.randn(16 << 20)}  # 64 MiB
        ckptfmt.save(state, p)
        out = ckptfmt.load(p)
        assert torch.equal(out["w"], state["w"])
        middle = (out["w"].data_ptr() + (32 << 20)) & ~((2 << 20) - 1)
        assert "hg" in _vm_flags(middle)
        out["w"].untyped_storage().resize_(0)  # callers may free storages the usual way


@needs_engine
def test_mapped_verify_of_a_file_that_shrank_is_incomplete(tmp_path):
    """The C engine maps pages in bulk before hashing them, so a file that shrank under
    its mapping is an error naming the chunk, not a SIGBUS (the Python path has no such check)."""
    p = tmp_path / "m.ckpt"
    ckptfmt.save({"a": torch.arange(100_000.0), "b": torch.randn(300_000)}, p, chunk_size=1 << 16)
    with CheckpointFile(p) as f:
        f._mm = mmap.mmap(f._fd, 0, access=mmap.ACCESS_COPY)  # mapped at its full size
        last = f.chunks[-1]
        with open(p, "r+b") as fh:
            fh.truncate(last.offset - (last.offset % mmap.PAGESIZE) - mmap.PAGESIZE)
        with pytest.raises(ckptfmt.IncompleteError) as info:
            f.load_subtree(f.tree.root, None, True, use_mmap=True)
        assert info.value.key == "state['b']"
        assert "shrank" in str(info.value)
        f._mm.close()
        gc.collect()


def test_save_and_load_leave_tensors_resizable(tmp_path):
    """Byte views never go through Tensor.numpy(), which would pin storages' sizes for good."""
    state = {"w": torch.randn(1000), "big": torch.randn(2 << 20)}
    p = tmp_path / "r.ckpt"
    ckptfmt.save(state, p)
    ckptfmt.save(state, tmp_path / "z.ckpt", compression="zstd")
    ckptfmt.save(state, tmp_path / "nb.ckpt", blocking=False).wait()
    out = ckptfmt.load(p)
    ckptfmt.load_into(p, state)
    for t in (*state.values(), *out.values()):
        assert t.untyped_storage().resizable()
        t.untyped_storage().resize_(0)  # how FSDP frees a storage


def _no_huge_pages_without_free_2mib_blocks() -> None:
    def advised(t: torch.Tensor) -> bool:
        return "hg" in _vm_flags((t.data_ptr() + (32 << 20)) & ~((2 << 20) - 1))

    hostmem._reclaims = False
    hostmem.free_huge_blocks = lambda: 0
    hostmem._read_at = -1e9
    assert not advised(hostmem.empty_bytes(64 << 20))
    hostmem.free_huge_blocks = lambda: 40  # room for one 64 MiB buffer
    hostmem._read_at = -1e9
    first, second = hostmem.empty_bytes(64 << 20), hostmem.empty_bytes(64 << 20)
    assert advised(first) and not advised(second)


@needs_engine
def test_no_huge_pages_without_free_2mib_blocks():
    """Fragmented free memory would make every huge-page fault compact memory first.
    (64 MiB buffers: glibc maps every allocation above 32 MiB afresh.)  In a process of its
    own: in one that ran other tests, the allocator handed back memory an earlier buffer had
    advised (its bytes were not zero), so the mapping's flags said nothing of this decision."""
    code = "import test_hostmem; test_hostmem._no_huge_pages_without_free_2mib_blocks()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    env.pop(hostmem.HUGE_PAGES_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_free_huge_blocks_reads_the_buddy_allocator():
    n = hostmem.free_huge_blocks()
    assert isinstance(n, int) and n >= 0


def _sysfs(tmp_path, features: str | None, order: str | None):
    balloon = tmp_path / "balloon"
    balloon.mkdir()
    if features is not None:
        (balloon / "virtio3").mkdir()
        (balloon / "virtio3" / "features").write_text(features + "\n")
    order_file = tmp_path / "order"
    if order is not None:
        order_file.write_text(order + "\n")
    return str(balloon), str(order_file)


@pytest.mark.parametrize(
    ("features", "order", "reclaims"),
    [
        ("0110010000", "9", True),  # free page reporting at 2 MiB: no huge pages for one use
        ("0110010000", None, True),  # the kernel's default order is 9
        ("0110010000", "10", False),  # only 4 MiB blocks and up are reported
        ("0110000000", "9", False),  # a balloon without reporting
        (None, "9", False),  # no balloon device
    ],
)
def test_no_huge_pages_where_the_host_takes_free_2mib_blocks_back(
    tmp_path, monkeypatch, features, order, reclaims
):
    balloon, order_file = _sysfs(tmp_path, features, order)
    monkeypatch.setattr(hostmem, "_BALLOON", balloon)
    monkeypatch.setattr(hostmem, "_REPORTING_ORDER", order_file)
    monkeypatch.setattr(hostmem, "_reclaims", None)
    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 1 << 20)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)
    assert hostmem.host_reclaims_huge_blocks() is reclaims
    advised = []
    monkeypatch.setattr(hostmem._native, "advise_huge", advised.append)
    hostmem.empty_bytes(8 << 20)
    assert bool(advised) is not reclaims
    advised.clear()
    hostmem.empty_bytes(8 << 20, reused=True)  # refilled many times: huge pages all the same
    assert advised


def _loads_small_pages_and_staging_huge_ones(tmp: str) -> None:
    from ckptfmt.background import staging

    def huge(t: torch.Tensor) -> bool:
        return "hg" in _vm_flags((t.data_ptr() + (32 << 20)) & ~((2 << 20) - 1))

    hostmem._reclaims = True
    hostmem.free_huge_blocks = lambda: 1 << 20
    hostmem._read_at = -1e9
    p = os.path.join(tmp, "big.ckpt")
    state = {"w": torch.randn(16 << 20)}  # 64 MiB
    ckptfmt.save(state, p)
    out = ckptfmt.load(p)
    assert torch.equal(out["w"], state["w"]) and not huge(out["w"])
    pool = staging.StagingPool(limit=128 << 20)
    slab = pool.acquire(64 << 20, pinned=False)
    assert huge(slab)
    pool.release(slab)


@needs_engine
def test_where_the_host_reclaims_loads_get_small_pages_and_staging_huge_ones(tmp_path):
    """A load's destinations are filled once, so their first fault is what counts; staging
    slabs are refilled by every non-blocking save.  In a process of its own, for the reason
    test_no_huge_pages_without_free_2mib_blocks gives (in CI's worker the load's 64 MiB came
    back on memory an earlier buffer had advised)."""
    code = f"import test_hostmem; test_hostmem._loads_small_pages_and_staging_huge_ones({str(tmp_path)!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    env.pop(hostmem.HUGE_PAGES_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    ("reclaims", "setting", "advised"),
    [
        (True, "on", True),  # the host check says no: CKPTFMT_HUGE_PAGES=on overrides it
        (False, "off", False),  # the host check says yes: off overrides it
        (True, "auto", False),
        (False, "auto", True),
        (False, "", True),  # empty is auto
        (True, " ON ", True),  # case and spaces do not matter
    ],
)
def test_the_environment_overrides_the_host_check_both_ways(monkeypatch, reclaims, setting, advised):
    monkeypatch.setenv(hostmem.HUGE_PAGES_ENV, setting)
    monkeypatch.setattr(hostmem, "_reclaims", reclaims)
    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 1 << 20)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)
    calls: list[torch.Tensor] = []
    monkeypatch.setattr(hostmem._native, "advise_huge", calls.append)
    hostmem.empty_bytes(8 << 20)
    assert bool(calls) is advised


def test_huge_pages_off_covers_reused_buffers_too(monkeypatch):
    monkeypatch.setenv(hostmem.HUGE_PAGES_ENV, "off")
    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 1 << 20)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)
    calls: list[torch.Tensor] = []
    monkeypatch.setattr(hostmem._native, "advise_huge", calls.append)
    hostmem.empty_bytes(8 << 20, reused=True)
    assert not calls


def test_huge_pages_on_still_needs_free_2mib_blocks(monkeypatch):
    """Forcing huge pages does not force compaction: without free blocks nothing is advised."""
    monkeypatch.setenv(hostmem.HUGE_PAGES_ENV, "on")
    monkeypatch.setattr(hostmem, "free_huge_blocks", lambda: 0)
    monkeypatch.setattr(hostmem, "_read_at", -1e9)
    calls: list[torch.Tensor] = []
    monkeypatch.setattr(hostmem._native, "advise_huge", calls.append)
    hostmem.empty_bytes(8 << 20)
    assert not calls


def test_an_unknown_huge_pages_setting_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(hostmem.HUGE_PAGES_ENV, "always")
    with pytest.raises(ValueError, match="CKPTFMT_HUGE_PAGES must be one of auto, on, off"):
        hostmem.empty_bytes(8 << 20)

"""The fast reader: parallel verified reads, staging, mmap, load_into, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import assert_same, states
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.background.staging import POOL
from ckptfmt.engine import native as _native
from ckptfmt.files import reader as reader_module

HS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def restore_pool():
    yield
    POOL.configure(limit=8 << 30, slab_bytes=64 << 20)


@HS
@given(
    state=states(),
    compression=st.sampled_from([None, "zstd"]),
    threads=st.sampled_from(["1", "2", "7"]),
    budget=st.sampled_from([None, 1000, 4096, 3 * 4096 + 5, 1 << 20]),
)
def test_parallel_reader_matches_reference(
    tmp_path, monkeypatch, restore_pool, state, compression, threads, budget
):
    p = tmp_path / "s.ckpt"
    ckptfmt.save(state, p, compression=compression, chunk_size=4096)
    monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    reference = ckptfmt.load(p)
    monkeypatch.setenv("CKPTFMT_BACKEND", "")
    monkeypatch.setenv("CKPTFMT_THREADS", threads)
    if budget is not None:  # the staged path, with budgets down to less than one chunk
        monkeypatch.setenv("CKPTFMT_FORCE_STAGING", "1")
        POOL.configure(limit=budget)
    fast = ckptfmt.load(p)
    assert_same(reference, fast)
    assert_same(state, fast)


def _damaged(tmp_path, compression):
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(20000, generator=g), "b": (torch.randn(20000, generator=g) * 0.02).bfloat16()}
    p = tmp_path / "d.ckpt"
    ckptfmt.save(state, p, compression=compression, chunk_size=4096)
    with ckptfmt.open(p) as r:
        chunks = r._file.chunks
    return p, state, chunks


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("path_kind", ["c", "python", "mmap", "mmap-python", "get", "staged"])
def test_corruption_detected_on_every_path(tmp_path, monkeypatch, compression, path_kind):
    p, state, chunks = _damaged(tmp_path, compression)
    target = len(chunks) - 2  # a chunk of state['b']
    data = bytearray(p.read_bytes())
    data[chunks[target].offset + 3] ^= 0x20
    p.write_bytes(bytes(data))
    if path_kind in ("python", "mmap-python"):
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    if path_kind == "staged":
        monkeypatch.setenv("CKPTFMT_FORCE_STAGING", "1")
    with pytest.raises(ckptfmt.CorruptError) as info:
        if path_kind.startswith("mmap"):
            ckptfmt.load(p, mmap=True)
        elif path_kind == "get":
            with ckptfmt.open(p) as r:
                assert torch.equal(r.get("a"), state["a"])  # the undamaged key still loads
                r.get("b")
        else:
            ckptfmt.load(p)
    e = info.value
    assert (e.key, e.chunk, e.offset) == ("state['b']", target, chunks[target].offset)
    assert e.reason == "checksum mismatch"


@pytest.mark.parametrize("threads", ["1", "2", "7"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_mmap_checks_all_storages_in_one_parallel_call(tmp_path, monkeypatch, threads, where):
    # many storages of many chunks, all checked together by the engine's threads: a flipped
    # byte in any of them is reported for its own key, chunk and offset, and nothing loads
    g = torch.Generator().manual_seed(2)
    state = {f"layer{i}.weight": torch.randn(3000 + 500 * i, generator=g) for i in range(12)}
    p = tmp_path / "many.ckpt"
    ckptfmt.save(state, p, chunk_size=4096)
    monkeypatch.setenv("CKPTFMT_THREADS", threads)
    assert_same(state, ckptfmt.load(p, mmap=True))
    with ckptfmt.open(p) as r:
        chunks = r._file.chunks
        keys = r._file.chunk_keys()
    target = {"first": 0, "middle": len(chunks) // 2, "last": len(chunks) - 1}[where]
    data = bytearray(p.read_bytes())
    data[chunks[target].offset + chunks[target].stored_len - 1] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(ckptfmt.CorruptError) as info:
        ckptfmt.load(p, mmap=True)
    e = info.value
    assert (e.key, e.chunk, e.offset, e.reason) == (
        keys[target],
        target,
        chunks[target].offset,
        "checksum mismatch",
    )


def _mapped_load_events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record, in order, each thread started ("start NAME") and each tensor made over a mapping
    ("tensor", torch.frombuffer)."""
    import threading

    events: list[str] = []
    start, frombuffer = threading.Thread.start, torch.frombuffer

    def recorded_start(self: threading.Thread) -> None:
        events.append(f"start {self.name}")
        start(self)

    def recorded_frombuffer(*args: object, **kwargs: object) -> torch.Tensor:
        events.append("tensor")
        return frombuffer(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(threading.Thread, "start", recorded_start)
    monkeypatch.setattr(torch, "frombuffer", recorded_frombuffer)
    return events


@pytest.mark.skipif(not _native.available(), reason="the C engine checks a mapping beside the caller")
def test_mmap_builds_the_tensors_while_the_engine_checks_them(tmp_path, monkeypatch):
    """A verified mapped load starts the engine's check of every chunk on a thread of its own,
    then builds the tensors over the mapping (which reads none of its pages) while the engine
    hashes, and waits for the check before returning: the Python work shares the cores with
    the hashing instead of following it."""
    import threading

    state = {f"w{i}": torch.randn(4096) for i in range(32)}
    p = tmp_path / "m.ckpt"
    ckptfmt.save(state, p, chunk_size=4096)
    monkeypatch.setattr(reader_module, "_CHECK_BESIDE_AT", 32)  # as many storages as this file's
    events = _mapped_load_events(monkeypatch)
    out = ckptfmt.load(p, mmap=True)
    assert_same(state, out)
    checks = [i for i, e in enumerate(events) if e == "start ckptfmt-mapped-check"]
    assert len(checks) == 1 and events.index("tensor") > checks[0], events[:5]
    assert not any(t.name == "ckptfmt-mapped-check" for t in threading.enumerate())


def test_a_small_mapped_load_checks_its_chunks_without_a_thread(tmp_path, monkeypatch):
    """Below _CHECK_BESIDE_AT storages the check runs in the caller, before any tensor is built:
    a thread's start and join cost more than the few tensors' building it would overlap."""
    state = {f"w{i}": torch.randn(64) for i in range(4)}
    p = tmp_path / "m.ckpt"
    ckptfmt.save(state, p)
    events = _mapped_load_events(monkeypatch)
    assert_same(state, ckptfmt.load(p, mmap=True))
    assert events and not any(e.startswith("start") for e in events), events


def test_a_file_that_shrank_before_it_was_mapped_is_incomplete(tmp_path):
    """A file cut short between its open and the mapping is an IncompleteError naming it, not
    torch's complaint about a buffer too short nor the engine's."""
    state = {f"w{i}": torch.randn(4096) for i in range(8)}
    p = tmp_path / "m.ckpt"
    ckptfmt.save(state, p, chunk_size=4096)
    f = reader_module.CheckpointFile(str(p))
    try:
        os.truncate(p, f.chunks[5].offset + 10)
        with pytest.raises(ckptfmt.IncompleteError, match="shrank") as info:
            f.load_subtree(f.tree.root, None, True, use_mmap=True)
    finally:
        f.close()
    assert info.value.path == str(p)


@pytest.mark.skipif(not _native.available(), reason="the C engine checks a mapping beside the caller")
def test_mmap_load_that_fails_building_tensors_leaves_no_check_running(tmp_path, monkeypatch):
    """Whatever fails while the tensors are built, the load waits for the engine's check (which
    holds the mapping) before raising that failure, and a damaged chunk is still refused after."""
    import threading

    state = {f"w{i}": torch.randn(4096) for i in range(32)}
    p = tmp_path / "m.ckpt"
    ckptfmt.save(state, p, chunk_size=4096)

    def fails(*args: object, **kwargs: object) -> torch.Tensor:
        raise MemoryError("no memory for the tensor")

    with monkeypatch.context() as m:
        m.setattr(reader_module, "_CHECK_BESIDE_AT", 32)
        m.setattr(torch, "frombuffer", fails)
        with pytest.raises(MemoryError, match="no memory for the tensor"):
            ckptfmt.load(p, mmap=True)
    assert not any(t.name == "ckptfmt-mapped-check" for t in threading.enumerate())
    with ckptfmt.open(p) as r:
        last = r._file.chunks[-1]
    data = bytearray(p.read_bytes())
    data[last.offset] ^= 0x04
    p.write_bytes(bytes(data))
    with pytest.raises(ckptfmt.CorruptError) as info:
        ckptfmt.load(p, mmap=True)
    assert (info.value.key, info.value.reason) == ("state['w31']", "checksum mismatch")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_truncation_while_open_is_incomplete_on_the_fast_path(tmp_path, compression):
    p, _, chunks = _damaged(tmp_path, compression)
    with ckptfmt.open(p) as r:
        os.truncate(p, chunks[3].offset + 10)
        with pytest.raises(ckptfmt.IncompleteError) as info:
            r.get("b")
    assert "shrank" in str(info.value)


def _evicted(path) -> bool:
    """Drop a file's pages from the page cache; whether none is left (tmpfs keeps them)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: maps, reads nothing
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return not any(b & 1 for b in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_files_out_of_the_page_cache_read_and_fail_the_same(tmp_path, monkeypatch, compression):
    """A file read from the device rather than the page cache: what comes back, and every
    error, is the same as from the cache."""
    monkeypatch.setenv("CKPTFMT_THREADS", "2")
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(3 << 20, generator=g), "b": torch.randn(1 << 20, generator=g).bfloat16()}
    p = tmp_path / "cold.ckpt"
    ckptfmt.save(state, p, compression=compression, chunk_size=1 << 20)
    if not _evicted(p):
        pytest.skip(f"the file system of {tmp_path} keeps files in memory (tmpfs)")
    assert_same(state, ckptfmt.load(p))
    with ckptfmt.open(p) as r:
        chunks = r._file.chunks
    target = len(chunks) - 1
    data = bytearray(p.read_bytes())
    data[chunks[target].offset + chunks[target].stored_len // 2] ^= 0x01
    p.write_bytes(bytes(data))
    assert _evicted(p)
    with pytest.raises(ckptfmt.CorruptError) as info:
        ckptfmt.load(p)
    e = info.value
    assert (e.key, e.chunk, e.offset, e.reason) == (
        "state['b']",
        target,
        chunks[target].offset,
        "checksum mismatch",
    )
    with ckptfmt.open(p) as r:
        os.truncate(p, chunks[target].offset + 100)
        assert _evicted(p)
        with pytest.raises(ckptfmt.IncompleteError) as info2:
            r.get("b")
    assert "shrank" in str(info2.value)


def test_same_messages_on_both_paths(tmp_path, monkeypatch):
    """A zstd frame that lies about its size reads the same from C and Python."""
    import sys as _sys

    _sys.path.insert(0, os.path.join(os.path.dirname(__file__), "corpus"))
    corpus = os.path.join(os.path.dirname(__file__), "corpus")
    for name in (
        "zstd_size_lie.ckpt",
        "zstd_garbage.ckpt",
        "zstd_no_content_size.ckpt",
        "nonzero_padding.ckpt",
        "transplanted_chunk.ckpt",
        "zstd_trailing_frame.ckpt",
    ):
        messages = []
        for backend in ("", "python"):
            monkeypatch.setenv("CKPTFMT_BACKEND", backend)
            with pytest.raises(ckptfmt.CorruptError) as info:
                ckptfmt.load(os.path.join(corpus, name))
            messages.append(str(info.value))
        assert messages[0] == messages[1], name


def test_mmap_is_zero_copy_for_raw_chunks(tmp_path):
    state = {"w": torch.randn(1000, 100), "v": torch.arange(10.0)[2:5], "z": (torch.zeros(50000))}
    p = tmp_path / "m.ckpt"
    ckptfmt.save(state, p)
    out = ckptfmt.load(p, mmap=True)
    assert_same(state, out)
    with ckptfmt.open(p) as r:
        w_off = r._file.chunks[0].offset
    # the tensor's memory is the file's bytes: the mapping is at the right offset
    raw = p.read_bytes()
    assert bytes(out["w"].reshape(-1).view(torch.uint8)[:64].numpy()) == raw[w_off : w_off + 64]
    out["w"][0, 0] = 123.0  # private mapping: writes never reach the file
    assert ckptfmt.load(p)["w"][0, 0] == state["w"][0, 0]
    zp = tmp_path / "z.ckpt"
    ckptfmt.save(state, zp, compression="zstd")
    assert_same(state, ckptfmt.load(zp, mmap=True))


def _model_state(width=64):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 8)
    )
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, width)).sum().backward()
    opt.step()
    return m, opt


def test_load_into_fills_in_place(tmp_path):
    m, opt = _model_state()
    p = tmp_path / "li.ckpt"
    ckptfmt.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7}, p, compression="zstd")
    m2, opt2 = _model_state()
    with torch.no_grad():
        for t in m2.parameters():
            t.zero_()
    ptrs = [t.data_ptr() for t in m2.state_dict().values()]
    target = {"model": m2.state_dict(), "optim": opt2.state_dict(), "step": 0}
    report = ckptfmt.load_into(p, target)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert [t.data_ptr() for t in m2.state_dict().values()] == ptrs  # same memory, new values
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert target["step"] == 7


def test_load_into_mismatch_raises_before_modifying(tmp_path):
    m, _ = _model_state(64)
    p = tmp_path / "li.ckpt"
    ckptfmt.save({"model": m.state_dict()}, p)
    small, _ = _model_state(32)
    sd = small.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    sd["2.bias"] = torch.zeros(8)  # this one would fit, and must not be touched either
    with pytest.raises(ckptfmt.MismatchError) as info:
        ckptfmt.load_into(p, {"model": sd}, strict=False)
    assert str(info.value).startswith(
        f"{p}: model.0.weight: shape mismatch: checkpoint [64, 64], target [32, 32]"
    )
    assert all(torch.equal(sd[k], before[k]) for k in before if k != "2.bias")
    assert torch.equal(sd["2.bias"], torch.zeros(8))
    wrong = {"model": {k: v.double() for k, v in m.state_dict().items()}}
    with pytest.raises(ckptfmt.MismatchError, match="dtype mismatch: checkpoint float32, target float64"):
        ckptfmt.load_into(p, wrong)


def test_load_into_strict_and_non_strict_keys(tmp_path):
    m, _ = _model_state()
    p = tmp_path / "li.ckpt"
    ckptfmt.save({"model": m.state_dict()}, p)
    m2, _ = _model_state()
    sd = m2.state_dict()
    del sd["1.bias"]
    sd["extra"] = torch.zeros(3)
    with pytest.raises(
        ckptfmt.MismatchError, match=r"missing keys \['model.extra'\]; unexpected keys \['model.1.bias'\]"
    ):
        ckptfmt.load_into(p, {"model": sd})
    assert torch.equal(sd["extra"], torch.zeros(3))
    report = ckptfmt.load_into(p, {"model": sd}, strict=False)
    assert report.missing_keys == ["model.extra"] and report.unexpected_keys == ["model.1.bias"]
    assert torch.equal(sd["0.weight"], m.state_dict()["0.weight"])


def test_load_into_meta_targets_are_replaced(tmp_path):
    m, _ = _model_state()
    p = tmp_path / "li.ckpt"
    ckptfmt.save({"model": m.state_dict()}, p)
    sd = {k: torch.empty_like(v, device="meta") for k, v in m.state_dict().items()}
    ckptfmt.load_into(p, {"model": sd})
    assert all(not v.is_meta for v in sd.values())
    assert torch.equal(sd["0.weight"], m.state_dict()["0.weight"])


def test_load_into_views_and_non_contiguous_targets(tmp_path):
    base = torch.arange(24.0)
    p = tmp_path / "v.ckpt"
    ckptfmt.save({"t": base.view(4, 6).t(), "s": base[3:9]}, p)
    tgt = {"t": torch.zeros(6, 4), "s": torch.zeros(12)[::2]}
    ckptfmt.load_into(p, tgt)
    assert torch.equal(tgt["t"], base.view(4, 6).t()) and torch.equal(tgt["s"], base[3:9])


_MEM_CHILD = r"""
import gc, json, os, sys, torch, ckptfmt
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
path, mode = sys.argv[1], sys.argv[2]
meta = json.loads(sys.argv[3])
target = {k: torch.empty(v) for k, v in meta.items()}
for t in target.values():
    t.zero_()
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
if mode == "load":
    out = ckptfmt.load(path)
else:
    ckptfmt.load_into(path, target)
print(json.dumps({"extra": status("VmHWM") - before}))
"""


# Sanitizers add allocations of their own (shadow memory, quarantine): memory
# budgets are checked in the normal build only.
@pytest.mark.skipif(bool(os.environ.get("CKPTFMT_SANITIZED")), reason="memory budgets need the normal build")
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_peak_memory_of_load_and_load_into(tmp_path, compression):
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024, generator=g) * 0.02 for i in range(48)}  # 192 MiB
    nbytes = sum(t.nbytes for t in state.values())
    p = tmp_path / "mem.ckpt"
    ckptfmt.save(state, p, compression=compression)
    shapes = json.dumps({k: list(v.shape) for k, v in state.items()})
    res = {}
    for mode in ("load", "load_into"):
        out = subprocess.run(
            [sys.executable, "-c", _MEM_CHILD, str(p), mode, shapes],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        res[mode] = json.loads(out.stdout)["extra"]
    # load: the destination tensors plus small per-thread buffers
    assert res["load"] <= nbytes * 1.05 + (48 << 20), res
    # load_into: no second copy of the state (10% of it, plus a fixed allowance for
    # the reader's per-thread decode buffers, which do not grow with the state)
    assert res["load_into"] <= nbytes * 0.10 + (8 << 20), res


def test_engine_reader_is_used():
    assert _native.available() == (ckptfmt.backend() == "c")


def test_raw_values_compare_hash_and_refuse_changes(tmp_path):
    """decode_raw's RawArray and RawValue (plain classes, not dataclasses: a first load imports
    their module) keep a frozen dataclass's behaviour: equal by their fields, a RawValue hashable
    (a size may be a dict key), a repr without the storage reader, no field assignable."""
    import dataclasses

    from ckptfmt.files.reader import CheckpointFile
    from ckptfmt.format.decode import RawArray, RawValue

    path = str(tmp_path / "raw.ckpt")
    ckptfmt.save({"w": torch.arange(6, dtype=torch.int32), "size": torch.Size([2, 3])}, path)
    with CheckpointFile(path) as f:
        one, two = f.load_raw(f.tree.root, True), f.load_raw(f.tree.root, True)
        w, size = one["w"], one["size"]
        assert isinstance(w, RawArray) and isinstance(size, RawValue)
        assert (w.kind, w.dtype, w.shape) == ("tensor", "int32", (6,))
        assert w.vector_bytes() == torch.arange(6, dtype=torch.int32).numpy().tobytes()
    assert size == two["size"] and hash(size) == hash(two["size"]) and {size: 1}[two["size"]] == 1
    assert size == RawValue("size", (("2", "3"),)) and size != RawValue("size", (("2", "4"),))
    assert w != RawArray("ndarray", w.dtype, w.shape, w.meta, w.storage)
    assert repr(size) == "RawValue(kind='size', fields=(('2', '3'),))"
    assert repr(w).startswith(
        "RawArray(kind='tensor', dtype='int32', shape=(6,), meta={"
    ) and "storage=" not in repr(w)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.kind = "ndarray"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del size.fields
    with pytest.raises(TypeError):
        hash(w)  # its meta is a dict, as the dataclass's was


def test_format_records_are_frozen_values(tmp_path):
    """The prologue, footer and externals records (format.frozen.Frozen, not dataclasses: a
    first load imports them) compare and hash by their fields, refuse changes, and survive a
    copy and a pickle."""
    import copy
    import dataclasses
    import pickle

    from ckptfmt.files.reader import CheckpointFile
    from ckptfmt.format.index import External
    from ckptfmt.format.layout import Footer, Prologue

    path = str(tmp_path / "f.ckpt")
    ckptfmt.save({"w": torch.ones(3)}, path)
    with CheckpointFile(path) as f, CheckpointFile(path) as g:
        assert f.prologue == g.prologue and hash(f.footer) == hash(g.footer) and f.footer == g.footer
        prologue, footer = f.prologue, f.footer
    assert footer.signature_length == 0 and Footer(1, 2, 3, b"x") == Footer(1, 2, 3, b"x", 0)
    assert prologue != Prologue(9, prologue.minor, prologue.file_id, prologue.file_length, 0, 0)
    assert repr(footer).startswith(f"Footer(index_offset={footer.index_offset}, index_length=")
    for value in (prologue, footer, External("../a.ckpt", b"\x01" * 16, 128, "/d/../a.ckpt")):
        assert copy.copy(value) == value and copy.deepcopy(value) == value
        assert pickle.loads(pickle.dumps(value)) == value
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.file_id = b""  # type: ignore[misc]
    assert prologue.pack() == open(path, "rb").read(64)


def _get_w(r) -> None:
    r.get("w")


def test_a_forked_child_reads_while_a_parent_thread_reads(tmp_path):
    """A DataLoader worker forked while another thread of the parent is inside Reader.get: the
    child inherits nothing held that its own read would wait for."""
    import multiprocessing

    path = str(tmp_path / "f.ckpt")
    ckptfmt.save({"w": torch.randn(8 << 20)}, path)
    r = ckptfmt.open(path)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            r.get("w")

    t = threading.Thread(target=loop)
    t.start()
    try:
        time.sleep(0.5)
        child = multiprocessing.get_context("fork").Process(target=_get_w, args=(r,))
        child.start()
        child.join(30)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
    finally:
        stop.set()
        t.join()
        r.close()
    assert not hung and child.exitcode == 0

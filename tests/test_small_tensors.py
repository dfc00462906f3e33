"""Loads of many small tensors: what each tensor costs, and that nothing is skipped for it.

A state of thousands of 4 KiB tensors (MoE experts, per-parameter optimizer states, LoRA
adapters) is dominated by the work done per tensor, not per byte.  These tests pin down the
per-tensor work that was removed (a uint8 tensor, a numpy-backed byte view and a buffer
export per storage on load, and per target on load_into; a first load importing the
writer's and the manager's modules) while the values, the sharing of storages and every
check stay as they were.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_same, read_bytes, write_bytes

import ckptfmt
from ckptfmt.engine import batched, bytesview, chunkrecords, hostmem
from ckptfmt.engine import native as _native

N = 2000


@pytest.fixture(scope="module")
def small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i // 64}.experts.{i % 64}.w": torch.randn(8, 8, generator=g) for i in range(N)}
    state["tied"] = state["layers.0.experts.0.w"]  # a storage shared by two entries stays shared
    return state


@pytest.fixture
def small_file(tmp_path, small_state) -> str:
    path = str(tmp_path / "small.ckpt")
    ckptfmt.save(small_state, path)
    return path


@pytest.fixture
def byte_views(monkeypatch) -> dict[str, int]:
    """Counts of the per-storage helpers a load used to call once per tensor."""
    counts = {"tensor_bytes": 0, "empty_bytes": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(bytesview, "tensor_bytes", counted("tensor_bytes", bytesview.tensor_bytes))
    monkeypatch.setattr(hostmem, "empty_bytes", counted("empty_bytes", hostmem.empty_bytes))
    return counts


@pytest.mark.parametrize("mmap", [False, True])
def test_load_makes_no_byte_view_per_storage(small_file, small_state, byte_views, mmap):
    loaded = ckptfmt.load(small_file, mmap=mmap)
    assert_same(loaded, small_state)
    assert (
        loaded["tied"].untyped_storage().data_ptr()
        == loaded["layers.0.experts.0.w"].untyped_storage().data_ptr()
    )
    # each storage is its own allocation, written by the engine where it lies
    assert byte_views == {"tensor_bytes": 0, "empty_bytes": 0}


def test_load_into_makes_no_byte_view_per_target(small_file, small_state, byte_views):
    targets = {k: torch.zeros_like(v) for k, v in small_state.items() if k != "tied"}
    targets["tied"] = targets["layers.0.experts.0.w"]
    report = ckptfmt.load_into(small_file, targets)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert_same(targets, small_state)
    # the verification pass reads through one bounce buffer: one view, not one per target
    assert byte_views["tensor_bytes"] <= 2


def test_damaged_small_chunk_is_still_found(small_file, small_state):
    """The short paths check what the long ones did: a flipped byte in any tensor is refused."""
    data = read_bytes(small_file)
    data[64 + 256 * 1000 + 17] ^= 1  # inside the bytes of a tensor in the middle (256 bytes each)
    write_bytes(small_file, data)
    with pytest.raises(ckptfmt.CorruptError, match="checksum mismatch"):
        ckptfmt.load(small_file)
    with pytest.raises(ckptfmt.CorruptError, match="checksum mismatch"):
        ckptfmt.load(small_file, mmap=True)
    targets = {k: torch.zeros_like(v) for k, v in small_state.items()}
    with pytest.raises(ckptfmt.CorruptError, match="checksum mismatch"):
        ckptfmt.load_into(small_file, targets)
    assert all(not t.any() for t in targets.values())  # atomic: nothing written


def test_first_load_imports_neither_writer_nor_manager(small_file):
    """A resume's first load in a fresh process waits only for the modules a load needs."""
    code = (
        "import sys, ckptfmt\n"
        f"ckptfmt.load({small_file!r})\n"
        "print(sorted(m for m in ('ckptfmt.files.save', 'ckptfmt.runs.manager', 'ckptfmt.engine.chunkwrite',"
        " 'ckptfmt.background.copysave') if m in sys.modules))\n"
    )
    assert _printed_by_fresh_process(code) == "[]"
    # and every public name is still there when asked for
    code = "import ckptfmt\nprint(all(getattr(ckptfmt, n) is not None for n in ckptfmt.__all__))\n"
    assert _printed_by_fresh_process(code) == "True"


def _printed_by_fresh_process(code: str) -> str:
    """What `code` prints, run in a fresh interpreter with this one's import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip()


def test_local_load_imports_no_object_store_or_key_module(small_file):
    """A load of a local, clear file imports neither the object-store modules (storage/) nor
    the handling of users' keys (files/encryption.py): each import is paid by a process's
    first load, which a state of many small tensors makes short."""
    code = (
        "import sys, ckptfmt\n"
        f"ckptfmt.load({small_file!r})\n"
        f"ckptfmt.load({small_file!r}, mmap=True)\n"
        "print(sorted(m for m in sys.modules if m.startswith('ckptfmt.storage')"
        " or m == 'ckptfmt.files.encryption'))\n"
    )
    assert _printed_by_fresh_process(code) == "[]"


def test_a_first_load_imports_nothing_its_entry_point_did_not(small_file):
    """`from ckptfmt import load` imports the reader's modules; a process's first load (and
    mapped load) then imports none of ckptfmt's: each import inside the call is paid by a
    resume's first load of many small tensors, and by no peer whose entry point was imported
    (engine.hostmem was imported there, 0.3 ms of CPU)."""
    code = (
        "import sys, torch\n"
        "from ckptfmt import load\n"
        "before = set(sys.modules)\n"
        f"load({small_file!r})\n"
        f"load({small_file!r}, mmap=True)\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('ckptfmt')))\n"
    )
    assert _printed_by_fresh_process(code) == "[]"


def test_unsigned_load_imports_no_signature_or_plain_array_module(small_file):
    """A load of an unsigned file imports neither the signature handling (format/signing.py,
    files/signing.py) nor the StoredArray of commit records (format/arrays.py)."""
    unwanted = ("ckptfmt.format.signing", "ckptfmt.files.signing", "ckptfmt.format.arrays")
    code = (
        "import sys, ckptfmt\n"
        f"ckptfmt.load({small_file!r})\n"
        f"ckptfmt.load({small_file!r}, mmap=True)\n"
        f"print(sorted(m for m in {unwanted!r} if m in sys.modules))\n"
    )
    assert _printed_by_fresh_process(code) == "[]"


def test_local_load_still_checks_storage_options(small_file):
    """storage_options given for a local path are still checked (not silently ignored)."""
    with pytest.raises(ValueError, match="unknown storage option 'nope'"):
        ckptfmt.load(small_file, storage_options={"nope": 1})


def _read_syscalls() -> int:
    """Read system calls this process has made (pread, preadv2, ...), its engine threads' included."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


@pytest.mark.skipif(not _native.available(), reason="the C engine is not built")
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="no per-process I/O counts here")
def test_small_chunks_are_read_in_runs(small_file, small_state):
    """Small chunks that follow each other in the file are read by one system call a run (of up
    to 64), not one each, and not with a probe of the page cache and an advice each as well."""
    ckptfmt.load(small_file)  # the first load's imports read files of their own
    before = _read_syscalls()
    loaded = ckptfmt.load(small_file)
    reads = _read_syscalls() - before
    assert_same(loaded, small_state)
    # N chunks of 256 bytes: N / 64 runs, and a few reads of the prologue, footer and index;
    # two reads a chunk before
    assert reads < N / 16, reads


@pytest.mark.skipif(not _native.available(), reason="the C engine is not built")
def test_mapped_check_of_small_chunks_names_the_first_past_the_end(tmp_path):
    """The mapping's pages are checked present once for many small chunks; a file that shrank
    under its mapping still fails naming the first chunk that lies past its end."""
    import mmap

    from ckptfmt.files.reader import CheckpointFile

    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(600)}  # 4 KiB chunks
    p = tmp_path / "m.ckpt"
    ckptfmt.save(state, p)
    with CheckpointFile(p) as f:
        f._mm = mmap.mmap(f._fd, 0, access=mmap.ACCESS_COPY)  # mapped at its full size
        cut = f.chunks[400].offset + 4096 + 100  # inside chunk 401: its last page lies past the end
        with open(p, "r+b") as fh:
            fh.truncate(cut)
        with pytest.raises(ckptfmt.IncompleteError) as info:
            f.load_subtree(f.tree.root, None, True, use_mmap=True)
        assert (info.value.key, info.value.chunk) == ("state['t401']", 401)
        assert "shrank" in str(info.value)
        f._mm.close()
        gc.collect()


@pytest.fixture
def tensors_built_on_storages(monkeypatch) -> list[int]:
    """How many tensors a load builds on a storage it allocated first (decode's general path)."""
    from ckptfmt.format import decode

    calls = [0]
    build = decode._build_tensor

    def counted(*args, **kwargs):
        calls[0] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(decode, "_build_tensor", counted)
    return calls


@pytest.mark.parametrize("mmap", [False, True])
def test_a_tensor_spanning_its_storage_is_built_with_its_memory(
    small_file, small_state, tensors_built_on_storages, mmap
):
    """One call allocates (or maps) a tensor that spans its whole storage, instead of a storage
    and then a tensor set on it; each is still a tensor of its own storage, not a view."""
    loaded = ckptfmt.load(small_file, mmap=mmap)
    for key, t in loaded.items():  # (before assert_same, whose .numpy() pins storages' sizes)
        assert t._base is None and t.untyped_storage().nbytes() == 256, key
        assert t.untyped_storage().resizable() != mmap, key  # as before: a mapping's is not
    assert_same(loaded, small_state)
    assert tensors_built_on_storages == [1]  # "tied" only: a second tensor on the first's storage
    first = loaded["layers.0.experts.0.w"]
    assert loaded["tied"].untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    first.add_(1)  # independent tensors stay independent
    assert torch.equal(loaded["layers.0.experts.1.w"], small_state["layers.0.experts.1.w"])
    assert torch.equal(loaded["tied"], first)


def test_a_storage_is_whole_exactly_when_its_first_tensor_spans_it(tmp_path):
    """Validation marks the storages a load may allocate (or map) as their first tensor: those
    whose first tensor's elements span exactly their bytes from their start."""
    from ckptfmt.files.reader import CheckpointFile

    state = {
        "part": torch.arange(16.0)[:2],  # from the start, but only part of its storage
        "offset": torch.arange(16.0)[4:],  # to the end, from an offset
        "plain": torch.randn(4, 4),
        "transposed": torch.randn(5, 7).t(),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "expanded": torch.ones(1).expand(4),  # stride 0: one element spans its storage
    }
    p = tmp_path / "whole.ckpt"
    ckptfmt.save(state, p)
    with CheckpointFile(p) as f:
        whole = {rec.key: rec.whole for rec in f.storages}
    assert whole == {
        "state['part']": False,
        "state['offset']": False,
        "state['plain']": True,
        "state['transposed']": True,
        "state['scalar']": True,
        "state['empty']": False,
        "state['conj']": False,
        "state['expanded']": True,
    }
    assert_same(ckptfmt.load(p), state)


@pytest.mark.parametrize("mmap", [False, True])
def test_tensors_built_with_their_memory_keep_every_attribute(tmp_path, mmap):
    """Parameters, requires_grad, strides that are not contiguous, scalars, empty tensors,
    views of part of a storage and a storage's later users listed before its first: all load
    as they were saved, and a subtree read alone still shares storage with nothing else."""
    base = torch.arange(64.0).reshape(8, 8)
    state = {
        "view first": base[2:4],  # listed before its base: a view on its storage
        "base": base,
        "param": torch.nn.Parameter(torch.randn(4, 4)),
        "grad": torch.randn(3, requires_grad=True),
        "transposed": torch.randn(5, 7).t(),  # spans its storage, not contiguous
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "ints": torch.arange(10, dtype=torch.int64),
        "complex": torch.randn(4, dtype=torch.complex64).conj(),
    }
    p = tmp_path / "attrs.ckpt"
    ckptfmt.save(state, p)
    loaded = ckptfmt.load(p, mmap=mmap)
    assert_same(loaded, state)
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad
    assert loaded["grad"].requires_grad and loaded["grad"].is_leaf
    with ckptfmt.open(p) as r:
        alone = r.get("view first")  # its storage's first tensor ("base") is not loaded
    assert torch.equal(alone, state["view first"]) and alone.storage_offset() == 16


def test_load_into_looks_again_only_at_targets_whose_spans_overlap(small_file, small_state, monkeypatch):
    """Tied targets (one tensor under two keys) are found by the overlap check, the only group of
    targets it looks at again, and filled once: the plan takes them from the match."""
    from ckptfmt.files import load_into, targets

    groups, plans = [], []
    clash_groups, make_plan = targets._clash_groups, load_into.make_plan

    def recorded(spans):
        found = clash_groups(spans)
        groups.extend(found)
        return found

    def kept(*args):
        plans.append(make_plan(*args))
        return plans[-1]

    monkeypatch.setattr(targets, "_clash_groups", recorded)
    monkeypatch.setattr(load_into, "make_plan", kept)
    state = {k: torch.zeros_like(v) for k, v in small_state.items() if k != "tied"}
    state["tied"] = state["layers.0.experts.0.w"]
    report = ckptfmt.load_into(small_file, state)
    assert report.loaded == N + 1 and report.missing_keys == report.unexpected_keys == []
    assert_same(state, small_state)
    keys = list(state)
    assert [[keys[p] for p, _, _ in g] for g in groups] == [["layers.0.experts.0.w", "tied"]]
    assert plans[0].aliases == {"layers.0.experts.0.w": ["tied"]}
    assert len(plans[0].direct) == N  # one read per chunk: the tied target's is not repeated


@pytest.mark.skipif(not _native.available(), reason="the C engine is not built")
def test_load_into_gives_the_engine_addresses_not_buffers(small_file, small_state, monkeypatch):
    """Both passes of an atomic load_into hand the engine each chunk's place as an address (in
    the bounce buffer, then in the target): no buffer export per chunk, and the checks stay."""
    kinds: set[str] = set()
    read_chunks, prepared = chunkrecords.read_chunks, batched.PreparedReads

    def recorded(fd, file_id, items, *args, **kwargs):
        kinds.update(type(dest).__name__ for _, dest in items)
        return read_chunks(fd, file_id, items, *args, **kwargs)

    class RecordedReads(prepared):  # both passes' reads, built once
        def __init__(self, reader, items):
            kinds.update(type(at).__name__ for _, at in items)
            super().__init__(reader, items)

    monkeypatch.setattr(chunkrecords, "read_chunks", recorded)
    monkeypatch.setattr(batched, "PreparedReads", RecordedReads)
    targets = {k: torch.zeros_like(v) for k, v in small_state.items()}
    ckptfmt.load_into(small_file, targets)
    assert_same(targets, small_state, check_sharing=False)
    assert kinds == {"int"}


def _padded_file(tmp_path) -> tuple[str, dict[str, torch.Tensor], list]:
    """300 tensors of 40 bytes: chunks of 40 bytes and 24 of padding, read in runs."""
    from ckptfmt.files.reader import CheckpointFile

    state = {f"t{i}": torch.full((10,), float(i)) for i in range(300)}
    p = str(tmp_path / "padded.ckpt")
    ckptfmt.save(state, p)
    with CheckpointFile(p) as f:
        chunks = list(f.chunks)
    assert all(ch.pad == 24 for ch in chunks)
    return p, state, chunks


@pytest.mark.parametrize("damage", ["checksum", "padding", "shrank"])
def test_a_fault_inside_a_run_is_named_as_one_read_per_chunk_names_it(tmp_path, monkeypatch, damage):
    """A damaged chunk, non-zero padding or the file's end inside a run of small chunks is
    reported by the C engine for the same chunk, at the same offset, with the same message as
    by the reference reader (one chunk at a time, in Python), by load and by load_into."""
    p, state, chunks = _padded_file(tmp_path)
    k = 150
    ch = chunks[k]
    data = read_bytes(p)
    if damage == "checksum":
        data[ch.offset + 5] ^= 1
    elif damage == "padding":
        data[ch.offset + ch.stored_len + 3] = 7
    write_bytes(p, data)
    seen = []
    for backend in ("", "python"):
        monkeypatch.setenv("CKPTFMT_BACKEND", backend)
        for how in ("load", "load_into"):
            targets = {key: torch.zeros_like(v) for key, v in state.items()}
            with ckptfmt.open(p) as r:  # open first: the file may shrink only after its index is read
                if damage == "shrank":
                    os.truncate(p, ch.offset + 20)
                with pytest.raises(ckptfmt.CheckpointError) as info:
                    if how == "load":
                        r.load()
                    else:
                        from ckptfmt.files.load_into import fill_from_node

                        f = r._file
                        fill_from_node(f, f.tree.root, targets, strict=True, verify=True)
                e = info.value
                seen.append((type(e).__name__, e.key, e.chunk, e.offset, str(e)))
            assert all(not t.any() for key, t in targets.items() if key != "t0"), how  # atomic
            if damage == "shrank":
                write_bytes(p, data)
    assert len(set(seen)) == 1, seen
    assert seen[0][1:3] == (f"state['t{k}']", k)


@pytest.mark.skipif(not _native.available(), reason="the C engine is not built")
def test_atomic_load_into_builds_the_engine_records_once(small_file, small_state, monkeypatch):
    """Both passes of an atomic load_into of plain targets (each the whole of a one-chunk
    storage) run one table of engine records, built once: the check of every chunk, then
    the reads into the targets, with no Python per chunk in either pass."""
    built: list[int] = []
    prepared = batched.PreparedReads

    class CountedReads(prepared):
        def __init__(self, reader, items):
            built.append(len(items))
            super().__init__(reader, items)

    def refused(*args, **kwargs):
        raise AssertionError("a chunk read outside the prepared table")

    monkeypatch.setattr(batched, "PreparedReads", CountedReads)
    monkeypatch.setattr(chunkrecords, "read_chunks", refused)
    targets = {k: torch.zeros_like(v) for k, v in small_state.items()}
    ckptfmt.load_into(small_file, targets)
    assert_same(targets, small_state, check_sharing=False)
    assert built == [N + 1]  # "tied" is a target of its own here: its chunk is read twice


@pytest.mark.skipif(not _native.available(), reason="the C engine is not built")
@pytest.mark.parametrize("field", ["codec", "filter", "width", "pad"])
def test_packed_engine_records_refuse_a_value_past_its_field_not_truncate_it(field):
    """The engine's records of every read are set from packed 64-bit fields in one call:
    a value wider than its member (a codec past 255, padding past 2^32) is refused, never cut
    down to another, valid-looking value (256 would have read as codec 0, raw)."""
    from ckptfmt.format.index import Chunk

    wide = 1 << 32 if field == "pad" else 256
    fields = dict(offset=0, stored_len=64, raw_len=64, codec=0, filter=0, width=0, checksum=0, pad=0)
    fields[field] = wide
    with pytest.raises(ValueError, match="past the engine's fields"):
        chunkrecords.build([(0, 4096)], [Chunk(**fields)], _native.ffi.NULL)
    fields[field] = 0
    rows = chunkrecords.build([(0, 4096)], [Chunk(**fields)], _native.ffi.NULL)
    assert (rows[0].stored_len, rows[0].raw_len, int(_native.ffi.cast("uintptr_t", rows[0].dst))) == (
        64,
        64,
        4096,
    )


@pytest.mark.skipif(not _native.available(), reason="the C engine is not built")
@pytest.mark.parametrize("how", ["load", "mmap", "verify"])
def test_every_engine_read_builds_its_records_with_the_packed_builder(
    small_file, small_state, monkeypatch, how
):
    """A load's reads into addresses, the verified mapping's check and verify's reads into a
    buffer build the engine's records of all their chunks in one pass of chunkrecords.build
    (fields packed, set by one engine call), none with a tuple per chunk handed to cffi; and a
    damaged chunk is still named by each."""
    built: list[int] = []
    build = chunkrecords.build

    def counted(items, records, key=None):
        built.append(len(items))
        return build(items, records, key)

    monkeypatch.setattr(chunkrecords, "build", counted)
    if how == "verify":
        assert ckptfmt.verify(small_file).ok
    else:
        loaded = ckptfmt.load(small_file, mmap=how == "mmap")
        assert_same(loaded, small_state)
    assert sum(built) == N and len(built) <= 2  # every chunk ("tied" shares one), in one or two calls
    data = read_bytes(small_file)
    data[64 + 256 * 700 + 3] ^= 0x01  # inside chunk 700 (8x8 fp32: 256 bytes each, after the prologue)
    write_bytes(small_file, data)
    if how == "verify":
        problems = ckptfmt.verify(small_file).problems
        assert [p.chunk for p in problems] == [700]
    else:
        with pytest.raises(ckptfmt.CorruptError, match="checksum mismatch") as e:
            ckptfmt.load(small_file, mmap=how == "mmap")
        assert e.value.chunk == 700

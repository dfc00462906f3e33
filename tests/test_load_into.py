"""load_into(): never half-load; views into flat buffers; conjugate tensors.

With atomic=True (the default) a load_into() that raises leaves every target as it
was, whatever the damage (a corrupt last chunk, truncation, a late mismatch, a read
error); a file changed after its verification raises PartialLoadError naming the
targets that may hold new values.  atomic=False is the single-pass path.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from helpers import storage_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.engine.batched import PreparedReads, prepare
from ckptfmt.files import fillplan, incremental
from ckptfmt.files import load_into as inplace
from ckptfmt.files.load_into import FileChangedError, PartialLoadError
from ckptfmt.files.reader import CheckpointFile

BACKENDS = pytest.mark.parametrize("backend", ["c", "python"])


@pytest.fixture
def backend(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    elif not ckptfmt.backend() == "c":
        pytest.skip("the C engine is not built")
    return request.param


def _state(n: int = 6, numel: int = 3000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(n)}


def _targets(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, 7.0) for k, v in state.items()}


def _memory(obj: object) -> list[bytes]:
    """Every byte of every target's storage (a view's whole flat buffer included)."""
    out: list[bytes] = []
    if isinstance(obj, torch.Tensor):
        out.append(storage_bytes(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            out += _memory(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _memory(v)
    return out


def _save(tmp_path, state, name="s.ckpt", **kw):
    p = tmp_path / name
    ckptfmt.save(state, p, chunk_size=4096, **kw)
    return p


def _chunks(p):
    with CheckpointFile(p) as f:
        return f.chunks


def _flip(p, offset):
    with open(p, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))


#: how an atomic load_into reads: "prepared" (plain files whose targets each take whole raw
#: chunks: both passes run one table of engine reads, PreparedReads) or "general" (a bounce
#: buffer for the check, then read_into per batch), forced here for the same file
READ_PATHS = pytest.mark.parametrize("read_path", ["prepared", "general"])


def _force_read_path(monkeypatch, read_path: str) -> None:
    if read_path == "general":
        monkeypatch.setattr(inplace, "prepare_direct", lambda f, plan, verify: None)


def _hook_reads(monkeypatch, before=None, after=None) -> None:
    """Call before(chunks, check_only) / after(chunks, check_only) around every chunk read of
    a load_into, whichever path makes it (CheckpointFile.read_into, PreparedReads.read)."""
    real_into, real_prepared = CheckpointFile.read_into, PreparedReads.read

    def read_into(self, items, verify, check_only=False):
        ks = [k for k, _ in items]
        if before:
            before(ks, check_only)
        real_into(self, items, verify, check_only=check_only)
        if after:
            after(ks, check_only)

    def prepared(self, lo, hi, verify, check_only=False):
        ks = [k for k, _ in self._items[lo:hi]]
        if before:
            before(ks, check_only)
        real_prepared(self, lo, hi, verify, check_only=check_only)
        if after:
            after(ks, check_only)

    monkeypatch.setattr(CheckpointFile, "read_into", read_into)
    monkeypatch.setattr(PreparedReads, "read", prepared)


# -- never half-load ---------------------------------------------------------------------------


@BACKENDS
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_corrupt_last_chunk_leaves_every_target_untouched(tmp_path, backend, compression):
    state = _state()
    p = _save(tmp_path, state, compression=compression)
    chunks = _chunks(p)
    _flip(p, chunks[-1].offset + 5)
    target = _targets(state)
    before = _memory(target)
    with pytest.raises(ckptfmt.CorruptError) as info:
        ckptfmt.load_into(p, target)
    assert info.value.chunk == len(chunks) - 1
    assert _memory(target) == before
    # the single-pass path writes what it read before it met the damage
    with pytest.raises(ckptfmt.CorruptError):
        ckptfmt.load_into(p, target, atomic=False)
    assert _memory(target) != before


@READ_PATHS
def test_truncation_while_verifying_leaves_targets_untouched(tmp_path, monkeypatch, read_path):
    state = _state()
    p = _save(tmp_path, state)
    chunks = _chunks(p)
    _force_read_path(monkeypatch, read_path)
    calls = []

    def shrink_first(ks, check_only):
        if not calls:
            os.truncate(p, chunks[len(chunks) // 2].offset + 10)  # mid-way through the data
        calls.append(len(ks))

    _hook_reads(monkeypatch, before=shrink_first)
    target = _targets(state)
    before = _memory(target)
    with pytest.raises(ckptfmt.IncompleteError, match="shrank"):
        ckptfmt.load_into(p, target)
    assert _memory(target) == before


def test_truncated_file_is_refused_before_anything_is_read(tmp_path):
    state = _state()
    p = _save(tmp_path, state)
    os.truncate(p, os.path.getsize(p) - 100)
    target = _targets(state)
    before = _memory(target)
    with pytest.raises(ckptfmt.CheckpointError):
        ckptfmt.load_into(p, target)
    assert _memory(target) == before


def test_late_mismatch_in_a_nested_target_leaves_the_others_untouched(tmp_path):
    state = {"a": torch.randn(100), "b": {"c": [torch.randn(10), torch.randn(4, 4)]}, "step": 3}
    p = _save(tmp_path, state)
    target = {"a": torch.zeros(100), "b": {"c": [torch.zeros(10), torch.zeros(4, 5)]}, "step": 0}
    before = _memory(target)
    with pytest.raises(ckptfmt.MismatchError, match=r"b\.c\.1: shape mismatch"):
        ckptfmt.load_into(p, target)
    assert _memory(target) == before and target["step"] == 0
    target["b"]["c"][1] = torch.zeros(4, 4, dtype=torch.float64)
    before = _memory(target)
    with pytest.raises(ckptfmt.MismatchError, match=r"b\.c\.1: dtype mismatch"):
        ckptfmt.load_into(p, target)
    assert _memory(target) == before and target["step"] == 0


def test_targets_that_cannot_be_written_are_refused_up_front(tmp_path):
    state = {"a": torch.randn(100), "e": torch.randn(5), "m": (torch.randn(3),)}
    p = _save(tmp_path, state)
    target = {"a": torch.zeros(100), "e": torch.zeros(1).expand(5), "m": (torch.zeros(3),)}
    before = _memory(target)
    with pytest.raises(ckptfmt.MismatchError, match="share memory"):
        ckptfmt.load_into(p, target)
    assert _memory(target) == before
    target = {"a": torch.zeros(100), "e": torch.zeros(5), "m": (torch.empty(3, device="meta"),)}
    with pytest.raises(ckptfmt.MismatchError, match="inside a tuple"):
        ckptfmt.load_into(p, target)
    assert torch.equal(target["a"], torch.zeros(100))


def test_inference_tensors_are_filled(tmp_path):
    state = {"a": torch.randn(100), "t": torch.randn(20, 30)}
    p = _save(tmp_path, state)
    with torch.inference_mode():
        target = {"a": torch.zeros(100), "t": torch.zeros(30, 20).t()}
    ckptfmt.load_into(p, target)
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["t"], state["t"])


@pytest.mark.parametrize("where", ["value", "meta"])
def test_damage_in_a_replaced_value_is_found_before_any_write(tmp_path, where):
    """Values and meta targets are loaded (and their chunks checked) before tensors are filled."""
    state = {"a": torch.randn(3000), "z": {"x": torch.randn(3000)}}
    p = _save(tmp_path, state)
    chunks = _chunks(p)
    _flip(p, chunks[-1].offset + 1)  # a chunk of z.x
    target = {
        "a": torch.zeros(3000),
        "z": {"x": None if where == "value" else torch.empty(3000, device="meta")},
    }
    before = storage_bytes(target["a"])
    with pytest.raises(ckptfmt.CorruptError):
        ckptfmt.load_into(p, target)
    assert storage_bytes(target["a"]) == before
    assert target["z"]["x"] is None or target["z"]["x"].is_meta


@READ_PATHS
def test_read_error_while_verifying_leaves_targets_untouched(tmp_path, monkeypatch, read_path):
    state = _state()
    p = _save(tmp_path, state)
    _force_read_path(monkeypatch, read_path)
    calls = []

    def failing(ks, check_only):
        calls.append(1)
        # the general path checks a window at a time: its second; the prepared one checks all at once
        if len(calls) == (2 if read_path == "general" else 1):
            assert check_only
            raise OSError(errno.EIO, "Input/output error", str(p))

    _hook_reads(monkeypatch, before=failing)
    target = _targets(state)
    before = _memory(target)
    with pytest.raises(OSError) as info:
        ckptfmt.load_into(p, target)
    assert info.value.errno == errno.EIO
    assert _memory(target) == before


def test_read_error_in_the_second_pass_is_a_partial_load(tmp_path, monkeypatch):
    # the file holds one storage; each tensor is less than a chunk, at offsets that do not
    # line up with chunks: every target is filled through the bounce buffer, window by window
    src = torch.randn(6 * 1000 + 7 + 200)  # no chunk lies wholly inside one tensor
    state = {f"t{i}": src[7 + 1000 * i : 7 + 1000 * (i + 1)] for i in range(6)}
    p = _save(tmp_path, state)
    real = CheckpointFile.read_into
    second: list[int] = []

    def failing(self, items, verify, **kw):
        if second:
            second.append(1)
            if len(second) == 3:  # the second read of the write phase
                raise OSError(errno.EIO, "Input/output error", str(p))
        return real(self, items, verify, **kw)

    flat = torch.full((6 * 1000 + 10,), 7.0)
    target = {f"t{i}": flat[5 + 1000 * i : 5 + 1000 * (i + 1)] for i in range(6)}
    monkeypatch.setattr(inplace, "_before_write", lambda f: second.append(1))
    monkeypatch.setattr(CheckpointFile, "read_into", failing)
    monkeypatch.setattr(fillplan, "_WINDOW_SHARE", 10**6)  # one chunk per window
    with pytest.raises(PartialLoadError) as info:
        ckptfmt.load_into(p, target)
    e = info.value
    assert isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.EIO
    assert e.modified_keys == ["t0", "t1"]  # those with bytes in the first chunk
    assert "may already hold new values" in str(e)
    for k in ("t2", "t3", "t4", "t5"):  # not listed: unchanged
        assert torch.equal(target[k], torch.full((1000,), 7.0)), k
    assert torch.equal(target["t0"], state["t0"])
    assert torch.equal(flat[:5], torch.full((5,), 7.0)) and torch.equal(flat[-5:], torch.full((5,), 7.0))


@READ_PATHS
@pytest.mark.parametrize("change", ["truncate", "flip"])
def test_change_during_verification_is_caught_before_any_write(tmp_path, monkeypatch, change, read_path):
    state = _state()
    p = _save(tmp_path, state)
    chunks = _chunks(p)
    os.utime(p, ns=(1_000_000_000, 1_000_000_000))  # a write now changes the times, whatever the clock
    _force_read_path(monkeypatch, read_path)

    def change_file() -> None:
        if change == "truncate":
            os.truncate(p, chunks[-1].offset + 10)
        else:
            _flip(p, chunks[-1].offset + 3)

    if read_path == "general":
        real = inplace.verify_chunks

        def verify_then_change(f, ks, verify, buf=None):
            real(f, ks, verify, buf)
            change_file()

        monkeypatch.setattr(inplace, "verify_chunks", verify_then_change)
    else:  # the one check of every chunk
        _hook_reads(monkeypatch, after=lambda ks, check_only: change_file() if check_only else None)
    target = _targets(state)
    before = _memory(target)
    with pytest.raises(FileChangedError, match="no target was written"):
        ckptfmt.load_into(p, target)
    assert _memory(target) == before


@BACKENDS
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_file_changed_between_the_passes_is_reported_as_partial(tmp_path, monkeypatch, backend, compression):
    """The race load_into() cannot close: bytes changed after they were verified.  The stamp
    (size, times) is blinded here, as it would be for a change within one clock tick."""
    state = _state()
    p = _save(tmp_path, state, compression=compression)
    chunks = _chunks(p)
    monkeypatch.setattr(inplace, "_stamp", lambda f: ())
    monkeypatch.setattr(inplace, "_before_write", lambda f: _flip(p, chunks[-1].offset + 3))
    target = _targets(state)
    with pytest.raises(PartialLoadError) as info:
        ckptfmt.load_into(p, target)
    e = info.value
    assert isinstance(e.__cause__, ckptfmt.CorruptError) and e.__cause__.chunk == len(chunks) - 1
    assert set(e.modified_keys) == set(target)  # every tensor here is read in the one parallel read
    assert str(e).startswith(
        f"{p}: the second read failed after load_into() verified the file (it changed, or could not"
    )


def test_damage_the_second_pass_meets_before_writing_raises_it_plainly(tmp_path, monkeypatch):
    """No target memory was reached yet: the original error, and the targets unchanged."""
    state = {"w": torch.randn(3000)}
    p = _save(tmp_path, state)
    chunks = _chunks(p)
    monkeypatch.setattr(inplace, "_stamp", lambda f: ())
    monkeypatch.setattr(inplace, "_before_write", lambda f: _flip(p, chunks[0].offset + 3))
    target = {"w": torch.zeros(6000)[::2]}  # strided: read into host memory, then copied
    with pytest.raises(ckptfmt.CorruptError):
        ckptfmt.load_into(p, target)
    assert torch.equal(target["w"], torch.zeros(3000))


def test_referenced_file_removed_before_the_load(tmp_path):
    base_state = {"a": torch.randn(3000), "b": torch.randn(3000)}
    a = tmp_path / "a.ckpt"
    b = tmp_path / "b.ckpt"
    incremental.save(base_state, a, chunk_size=4096)
    incremental.save({**base_state, "c": torch.randn(3000)}, b, base=a)
    os.unlink(a)
    target = {"a": torch.zeros(3000), "b": torch.zeros(3000), "c": torch.zeros(3000)}
    before = _memory(target)
    with pytest.raises(ckptfmt.IncompleteError, match="missing"):
        ckptfmt.load_into(b, target)
    assert _memory(target) == before


def test_files_renamed_or_removed_between_the_passes_are_still_read(tmp_path, monkeypatch):
    """Open files are read to the end: removing or replacing the paths changes nothing."""
    base_state = {"a": torch.randn(3000), "b": torch.randn(3000)}
    a = tmp_path / "a.ckpt"
    b = tmp_path / "b.ckpt"
    incremental.save(base_state, a, chunk_size=4096)
    full = {**base_state, "c": torch.randn(3000)}
    incremental.save(full, b, base=a)

    def replace_both(f):
        os.unlink(a)
        ckptfmt.save({"other": torch.zeros(1)}, b)

    monkeypatch.setattr(inplace, "_before_write", replace_both)
    target = {k: torch.zeros(3000) for k in full}
    ckptfmt.load_into(b, target)
    assert all(torch.equal(target[k], full[k]) for k in full)


def test_file_replaced_by_rename_while_verifying_still_loads(tmp_path, monkeypatch):
    """ckptfmt.save replaces a file by rename: the open file is intact, nothing to report."""
    state = _state()
    p = _save(tmp_path, state)
    real = inplace.verify_chunks

    def verify_then_replace(f, ks, verify, buf=None):
        real(f, ks, verify, buf)
        ckptfmt.save({k: torch.zeros_like(v) for k, v in state.items()}, p)

    monkeypatch.setattr(inplace, "verify_chunks", verify_then_replace)
    target = _targets(state)
    ckptfmt.load_into(p, target)
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_verify_false_still_finds_truncation_before_writing(tmp_path, monkeypatch):
    state = _state()
    p = _save(tmp_path, state)
    chunks = _chunks(p)
    real = CheckpointFile.read_into
    done = []

    def shrink_first(self, items, verify, **kw):
        if not done:
            done.append(1)
            os.truncate(p, chunks[-1].offset + 10)
        return real(self, items, verify, **kw)

    monkeypatch.setattr(CheckpointFile, "read_into", shrink_first)
    target = _targets(state)
    before = _memory(target)
    with pytest.raises(ckptfmt.IncompleteError):
        ckptfmt.load_into(p, target, verify=False)
    assert _memory(target) == before


@READ_PATHS
def test_single_pass_path_reads_each_chunk_once(tmp_path, monkeypatch, read_path):
    state = _state()
    p = _save(tmp_path, state)
    _force_read_path(monkeypatch, read_path)
    read: list[int] = []
    _hook_reads(monkeypatch, before=lambda ks, check_only: read.extend(ks))
    target = _targets(state)
    ckptfmt.load_into(p, target, atomic=False)
    n = len(_chunks(p))
    assert sorted(read) == list(range(n))
    assert all(torch.equal(target[k], state[k]) for k in state)
    read.clear()
    target = _targets(state)
    ckptfmt.load_into(p, target)
    assert sorted(read) == sorted(list(range(n)) * 2)  # verified, then read into the targets
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_manager_style_subtree_fill_is_atomic_too(tmp_path):
    state = {"model": _state(3), "other": _state(2)}
    p = _save(tmp_path, state)
    _flip(p, _chunks(p)[-1].offset + 1)
    target = {"model": _targets(state["model"]), "other": _targets(state["other"])}
    before = _memory(target)
    with CheckpointFile(p) as f, pytest.raises(ckptfmt.CorruptError):
        inplace.fill_from_node(f, f.tree.root, target, strict=True, verify=True)
    assert _memory(target) == before
    with CheckpointFile(p) as f, pytest.raises(ckptfmt.CorruptError):
        inplace.verify_subtree(f, f.tree.root)


# -- views into flat buffers --------------------------------------------------------------------


def _flat_targets(shapes, extra_front=3, extra_back=5, transposed=()):
    """Views into one flat buffer (as FSDP1 / apex flat params), at non-zero offsets."""
    total = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.full((extra_front + total + extra_back,), -3.0)
    out = {}
    pos = extra_front
    for i, s in enumerate(shapes):
        n = torch.Size(s).numel()
        v = flat[pos : pos + n].view(s)
        out[f"p{i}"] = v.t() if i in transposed else v
        pos += n
    return flat, out


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("saved_as", ["separate", "flat", "tied"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_views_into_one_flat_buffer(tmp_path, atomic, saved_as, compression):
    g = torch.Generator().manual_seed(5)
    shapes = [(40, 50), (3000,), (7,), (30, 70), (1,), (2500,)]
    transposed = {3}
    if saved_as == "separate":
        state = {}
        for i, s in enumerate(shapes):
            t = torch.randn(s, generator=g)
            state[f"p{i}"] = t.t() if i in transposed else t
    else:  # the file holds one storage: the saved parameters were views of a flat buffer too
        src_flat, state = _flat_targets(shapes, extra_front=11, extra_back=0, transposed=transposed)
        src_flat.copy_(torch.randn(src_flat.shape, generator=g))
        if saved_as == "tied":  # and the flat buffer itself, as FSDP's flat_param
            state["flat"] = src_flat
    state["plain"] = torch.randn(1000, generator=g)
    state["plain_t"] = torch.randn(20, 30, generator=g).t()
    p = _save(tmp_path, state, compression=compression)
    expected = ckptfmt.load(p)
    flat, target = _flat_targets(shapes, transposed=transposed)
    target["plain"] = torch.zeros(1000)
    target["plain_t"] = torch.zeros(30, 20)
    if saved_as == "tied":
        target["flat"] = torch.zeros(11 + flat.numel() - 8)
    ckptfmt.load_into(p, target, atomic=atomic)
    for k, v in target.items():
        assert torch.equal(v, expected[k]), k
    assert torch.equal(flat[:3], torch.full((3,), -3.0)) and torch.equal(flat[-5:], torch.full((5,), -3.0))


def test_flat_target_receives_separately_saved_tensors_bit_exact(tmp_path):
    """Targets that are views of a flat buffer at offsets that do not line up with chunks."""
    g = torch.Generator().manual_seed(9)
    state = {f"p{i}": torch.randn(1000 + 37 * i, generator=g).to(torch.bfloat16) for i in range(8)}
    p = _save(tmp_path, state)
    total = sum(v.numel() for v in state.values())
    flat = torch.full((total + 2,), 5.0, dtype=torch.bfloat16)
    target, pos = {}, 1
    for k, v in state.items():
        target[k] = flat[pos : pos + v.numel()]
        pos += v.numel()
    ckptfmt.load_into(p, target)
    joined = torch.cat([state[k] for k in state])
    assert flat[1:-1].view(torch.int16).equal(joined.view(torch.int16))
    assert flat[0].item() == 5.0 and flat[-1].item() == 5.0


def test_tied_view_at_an_offset_shares_bytes_with_another_target(tmp_path):
    """The file's storage is exactly one target (read straight into it) and another target
    views part of it: that target must get the file's bytes, not the flat buffer's."""
    w = torch.arange(12.0).view(3, 4)
    p = _save(tmp_path, {"w": w, "row": w[1], "col": w[:, 2]})
    flat = torch.full((100,), -1.0)
    target = {"w": flat[40:52].view(3, 4), "row": torch.zeros(4), "col": torch.zeros(3)}
    ckptfmt.load_into(p, target)
    assert (
        torch.equal(target["w"], w)
        and torch.equal(target["row"], w[1])
        and torch.equal(target["col"], w[:, 2])
    )
    assert torch.equal(flat[:40], torch.full((40,), -1.0)) and torch.equal(flat[52:], torch.full((48,), -1.0))


def test_tied_targets_are_filled_once(tmp_path):
    m = torch.nn.Embedding(300, 16)
    head = torch.nn.Linear(16, 300, bias=False)
    head.weight = m.weight
    p = _save(tmp_path, {"tok": m.weight, "head": head.weight})
    m2 = torch.nn.Parameter(torch.zeros(300, 16))
    ckptfmt.load_into(p, {"tok": m2, "head": m2})
    assert torch.equal(m2, m.weight)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
    gaps=st.lists(st.integers(0, 2000), min_size=7, max_size=7),
    shared_file=st.booleans(),
    atomic=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.float64, torch.uint8]),
)
def test_random_flat_layouts(tmp_path, sizes, gaps, shared_file, atomic, dtype):
    g = torch.Generator().manual_seed(sum(sizes))
    if shared_file:
        src = torch.randint(0, 100, (sum(sizes) + sum(gaps),), generator=g).to(dtype)
        state, pos = {}, gaps[0]
        for i, n in enumerate(sizes):
            state[f"p{i}"] = src[pos : pos + n]
            pos += n + gaps[i + 1]
    else:
        state = {f"p{i}": torch.randint(0, 100, (n,), generator=g).to(dtype) for i, n in enumerate(sizes)}
    p = tmp_path / "r.ckpt"
    ckptfmt.save(state, p, chunk_size=4096)
    flat = torch.full((sum(sizes) + sum(gaps),), 9, dtype=dtype)
    target, pos = {}, gaps[-1]
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    for i, n in enumerate(sizes):
        target[f"p{i}"] = flat[pos : pos + n]
        keep[pos : pos + n] = False
        pos += n + gaps[i]
    ckptfmt.load_into(p, target, atomic=atomic)
    for k in state:
        assert torch.equal(target[k], state[k]), k
    assert bool((flat[keep] == 9).all())


# -- conjugate views ---------------------------------------------------------------------------


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("saved_conj", [False, True])
@pytest.mark.parametrize("target_conj", [False, True])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_conjugate_views_load_like_load(tmp_path, atomic, saved_conj, target_conj, dtype):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2000, dtype=dtype, generator=g)
    m = torch.randn(30, 40, dtype=dtype, generator=g)
    state = {
        "z": z.conj() if saved_conj else z,
        "m": m.conj() if saved_conj else m,
        "mt": (m.conj() if saved_conj else m).t(),
    }
    p = _save(tmp_path, state)
    expected = ckptfmt.load(p)
    assert expected["z"].is_conj() == saved_conj

    def blank(shape):
        t = torch.zeros(shape, dtype=dtype)
        return t.conj() if target_conj else t

    target = {"z": blank(2000), "m": blank((30, 40)), "mt": blank((40, 30))}
    ckptfmt.load_into(p, target, atomic=atomic)
    for k in state:
        assert target[k].is_conj() == target_conj
        assert torch.equal(target[k].resolve_conj(), expected[k].resolve_conj()), k
        assert torch.equal(target[k].resolve_conj(), state[k].resolve_conj()), k


def test_negative_view_target(tmp_path):
    z = torch.randn(100, dtype=torch.complex64)
    p = _save(tmp_path, {"im": z.imag.clone()})
    base = torch.zeros(100, dtype=torch.complex64)
    target = {"im": base.conj().imag}  # a negative-bit view: writing x stores -x underneath
    assert target["im"].is_neg()
    ckptfmt.load_into(p, target)
    assert torch.equal(target["im"].resolve_neg(), z.imag)
    assert torch.equal(base.imag, -z.imag)


def test_partial_load_names_every_key_of_the_memory_it_wrote(tmp_path, monkeypatch):
    """Tied targets (one tensor under two keys) are filled once and reported under both keys."""
    w = torch.randn(3000)
    p = _save(tmp_path, {"tok": w, "head": w, "other": torch.randn(3000)})
    chunks = _chunks(p)
    monkeypatch.setattr(inplace, "_stamp", lambda f: ())
    monkeypatch.setattr(inplace, "_before_write", lambda f: _flip(p, chunks[-1].offset + 3))
    tied = torch.zeros(3000)
    other = torch.zeros(6000)[::2]  # strided: filled after the tied pair, from its own read
    with pytest.raises(PartialLoadError) as info:
        ckptfmt.load_into(p, {"tok": tied, "head": tied, "other": other})
    assert info.value.modified_keys == ["tok", "head"]
    assert torch.equal(other, torch.zeros(3000))


def test_two_targets_under_one_dotted_key_are_both_filled(tmp_path):
    """{"a.b": x} and {"a": {"b": y}} flatten to the same key: each target is filled from
    the file's entry, not one of them twice."""
    w = torch.randn(1000)  # one chunk: the commonest target's plan
    p = _save(tmp_path, {"a.b": w})
    first, second = torch.zeros(1000), torch.zeros(1000)
    report = ckptfmt.load_into(p, {"a.b": first, "a": {"b": second}})
    assert torch.equal(first, w) and torch.equal(second, w)
    assert report.loaded == 2


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("other", ["strided", "value"])
@pytest.mark.parametrize("whole_first", [True, False])
def test_a_whole_chunk_target_sharing_its_key_with_another_leaves_neither_unfilled(
    tmp_path, atomic, other, whole_first
):
    """Under one dotted key, a target taking one whole chunk as it is and another that does not
    (a transposed view, or a value that is replaced): the second is filled too, not planned as
    a read into the first one's memory."""
    w = torch.arange(4.0).reshape(2, 2)
    p = _save(tmp_path, {"a": {"b": w}})
    x = torch.zeros(2, 2).t() if other == "strided" else "not a tensor"
    y = torch.zeros(2, 2)  # the commonest target: one whole chunk read into its memory
    target = {"a": {"b": y}, "a.b": x} if whole_first else {"a.b": x, "a": {"b": y}}
    report = ckptfmt.load_into(p, target, strict=False, atomic=atomic)
    assert torch.equal(target["a"]["b"], w) and target["a"]["b"] is y
    assert torch.equal(target["a.b"], w)
    assert report.loaded == 2


@pytest.mark.skipif(not ckptfmt.backend() == "c", reason="the C engine is not built")
@pytest.mark.parametrize("verify", [True, False])
def test_prepared_reads_that_only_check_never_write_the_targets(tmp_path, verify):
    """The first pass of an atomic load_into runs prepared reads into the targets' own memory
    with check_only: they are left as they were, whatever `verify` says, as read_chunks does."""
    state = _state(n=3, numel=1000)  # one chunk each
    p = _save(tmp_path, state)
    target = _targets(state)
    with CheckpointFile(p) as f:
        items = [(f.storages[i].first_chunk, target[f"t{i}"].data_ptr()) for i in range(3)]
        reads = prepare(f.chunk_reader, items)
        assert reads is not None
        reads.read(0, reads.n, verify, check_only=True)
        assert all(torch.equal(t, torch.full_like(t, 7.0)) for t in target.values())
        reads.read(0, reads.n, verify)
    assert all(torch.equal(target[k], state[k]) for k in state)


@pytest.mark.parametrize("atomic", [True, False])
def test_targets_of_one_shape_whose_file_layouts_differ_are_each_filled_as_stored(tmp_path, atomic):
    """The plan recognises a target taking a whole chunk as it is by its file tensor's dtype,
    shape and strides, worked out once per layout: tensors of the same shape stored another way
    (transposed, a size-1 dim with its own stride, a view at an offset of a larger storage, a
    conjugate) are each filled with their own values, whichever comes first."""
    g = torch.Generator().manual_seed(5)
    square = torch.randn(4, 4, generator=g)
    base = torch.randn(20, generator=g)
    z = torch.randn(4, 4, dtype=torch.complex64, generator=g)
    state = {
        "plain": square,
        "transposed": torch.randn(4, 4, generator=g).t(),
        "row": torch.randn(4, 1, generator=g).t(),  # shape (1, 4), strides (1, 1)
        "row_plain": torch.randn(1, 4, generator=g),
        "at_offset": base[4:].view(4, 4),  # one chunk of a storage holding more than the tensor
        "head": base[:4],
        "conj": z.conj(),
        "complex": z.clone(),
    }
    assert state["row"].stride() == (1, 1)
    p = _save(tmp_path, state)
    for order in (list(state), list(reversed(state))):
        target = {k: torch.zeros(state[k].shape, dtype=state[k].dtype) for k in order}
        ckptfmt.load_into(p, target, atomic=atomic)
        for k in state:
            assert torch.equal(target[k].resolve_conj(), state[k].resolve_conj()), k


# -- targets that share memory -----------------------------------------------------------------


def _two_entries(tmp_path, n: int):
    a, b = torch.full((n,), 1.0), torch.full((n,), 2.0)
    return _save(tmp_path, {"a": a, "b": b}), a, b


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("n", [1000, 3000])  # one whole chunk each (the commonest plan), or several
def test_overlapping_views_are_refused_before_anything_is_written(tmp_path, atomic, n):
    """Two views of one buffer that overlap: filling both would leave one holding the other's
    values (or a damaged chunk blamed on the file).  MismatchError naming both, nothing written."""
    p, _, _ = _two_entries(tmp_path, n)
    buf = torch.zeros(3 * n // 2)
    target = {"a": buf[:n], "b": buf[n // 2 : n // 2 + n]}
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'b' overlap in memory"):
        ckptfmt.load_into(p, target, atomic=atomic)
    assert torch.equal(buf, torch.zeros_like(buf))


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("n", [1000, 3000])
def test_one_tensor_under_two_keys_of_different_entries_is_refused(tmp_path, atomic, n):
    """One tensor under two keys whose saved tensors differ cannot hold both: refused before any
    write (tied entries, one tensor in the file too, are filled once: test_tied_targets_are_filled_once;
    equal ones stored apart too: test_load_into_sharing.py)."""
    p, _, _ = _two_entries(tmp_path, n)
    x = torch.zeros(n)
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'b' are the same memory"):
        ckptfmt.load_into(p, {"a": x, "b": x}, atomic=atomic)
    assert torch.equal(x, torch.zeros(n))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 2500), min_size=2, max_size=5),
    gaps=st.lists(st.integers(-40, 40), min_size=5, max_size=5),
    atomic=st.booleans(),
)
def test_views_of_one_buffer_load_when_disjoint_and_are_refused_when_they_overlap(
    tmp_path, sizes, gaps, atomic
):
    """Views of one buffer placed one after another with small gaps, adjacent or overlapping
    (a negative gap): disjoint views are filled exactly, the rest of the buffer untouched;
    any overlap is a MismatchError before anything is written."""
    g = torch.Generator().manual_seed(sum(sizes))
    state = {f"p{i}": torch.randint(1, 100, (n,), generator=g).float() for i, n in enumerate(sizes)}
    p = tmp_path / "v.ckpt"
    ckptfmt.save(state, p, chunk_size=4096)
    spans, pos = [], 40 * len(sizes)
    for i, n in enumerate(sizes):
        spans.append((pos, pos + n))
        pos += n + gaps[i]
    buf = torch.zeros(max(e for _, e in spans) + 40)
    target = {f"p{i}": buf[s:e] for i, (s, e) in enumerate(spans)}
    overlap = any(s0 < e1 and s1 < e0 for i, (s0, e0) in enumerate(spans) for s1, e1 in spans[i + 1 :])
    if overlap:
        with pytest.raises(ckptfmt.MismatchError, match="overlap in memory|are the same memory"):
            ckptfmt.load_into(p, target, atomic=atomic)
        assert not bool(buf.any())
        return
    ckptfmt.load_into(p, target, atomic=atomic)
    keep = torch.ones(buf.numel(), dtype=torch.bool)
    for i, (s, e) in enumerate(spans):
        assert torch.equal(buf[s:e], state[f"p{i}"]), i
        keep[s:e] = False
    assert not bool(buf[keep].any())


def _shared_layouts(n: int) -> dict[str, dict[str, torch.Tensor]]:
    """States whose tensors share memory: a row view, a transposed view, a flat buffer with views
    of it (one of them strided)."""
    w = torch.randn(n, 64, generator=torch.Generator().manual_seed(5))
    flat = torch.randn(3 * n * 64, generator=torch.Generator().manual_seed(6))
    return {
        "row": {"w": w, "row": w[1]},
        "transposed": {"w": w, "wt": w.t()},
        "flat": {
            "flat": flat,
            "a": flat[: n * 64].view(n, 64),
            "b": flat[n * 64 : 3 * n * 64 : 2],
            "c": flat[5:70],
        },
    }


def _same_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh zero tensors sharing memory exactly as `state`'s do."""
    out: dict[str, torch.Tensor] = {}
    fresh: dict[int, torch.Tensor] = {}
    for k, v in state.items():
        st = v.untyped_storage()
        if st.data_ptr() not in fresh:
            fresh[st.data_ptr()] = torch.zeros(st.nbytes() // v.element_size(), dtype=v.dtype)
        out[k] = fresh[st.data_ptr()].as_strided(v.shape, v.stride(), v.storage_offset())
    return out


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("layout", ["row", "transposed", "flat"])
@pytest.mark.parametrize("n", [4, 200])  # one chunk, or several
def test_targets_sharing_memory_as_the_file_did_are_filled(tmp_path, atomic, layout, n):
    """Targets that share memory exactly as the saved tensors did (a row of a weight, its
    transpose, views of a flat buffer) each take the same verified bytes at the same addresses:
    loaded, values exact, and the atomic pass does not take their sharing for a changed file."""
    state = _shared_layouts(n)[layout]
    p = _save(tmp_path, state)
    target = _same_layout(state)
    report = ckptfmt.load_into(p, target, atomic=atomic)
    assert report.loaded == len(state)
    for k, v in state.items():
        assert torch.equal(target[k], v), k


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("n", [4, 200])
def test_targets_sharing_memory_unlike_the_file_are_refused(tmp_path, atomic, n):
    """Targets that share memory, but not where the file's shared storage would put each: the
    row view of the wrong row, a transpose over a target laid out row-major the other way, and a
    flat buffer whose view sits at another offset are refused before anything is written."""
    w = torch.randn(n, 64)
    p = _save(tmp_path, {"w": w, "row": w[1], "wt": w.t()}, name="w.ckpt")
    for wrong in ("row", "wt"):
        buf = torch.zeros(n, 64)
        target = {"w": buf, "row": buf[2] if wrong == "row" else buf[1], "wt": buf.t()}
        if wrong == "wt":
            target["wt"] = buf.view(64, n)  # same bytes, row-major: not the file's transpose
        with pytest.raises(ckptfmt.MismatchError, match="overlap in memory|are the same memory"):
            ckptfmt.load_into(p, target, atomic=atomic)
        assert not bool(buf.any()), wrong
    state = _shared_layouts(n)["flat"]
    q = _save(tmp_path, state, name="flat.ckpt")
    target = _same_layout(state)
    buf = target["flat"]
    target["c"] = buf[6:71]
    with pytest.raises(ckptfmt.MismatchError, match="overlap in memory"):
        ckptfmt.load_into(q, target, atomic=atomic)
    assert not bool(buf.any())


# last in the module: the npu devices stay switched on from here to the module's end
@pytest.mark.usefixtures("npu_devices")
@pytest.mark.parametrize("atomic", [True, False])
def test_overlapping_accelerator_targets_are_refused_and_tied_ones_filled(tmp_path, atomic):
    """Targets on an accelerator (the test-only "npu") are checked by device as host ones are:
    overlapping views refused before anything is written; a tied pair, one tensor in the file
    too, filled once, beside a target of the other device."""
    n = 3000
    p, a, b = _two_entries(tmp_path, n)
    buf = torch.zeros(3 * n // 2, device="npu:0")
    with pytest.raises(ckptfmt.MismatchError, match="'a' and 'b' overlap in memory"):
        ckptfmt.load_into(p, {"a": buf[:n], "b": buf[n // 2 : n // 2 + n]}, atomic=atomic)
    assert not bool(buf.cpu().any())
    w = torch.randn(n)
    tied = _save(tmp_path, {"tok": w, "head": w, "other": b}, name="tied.ckpt")
    x, other = torch.zeros(n, device="npu:0"), torch.zeros(n, device="npu:1")
    ckptfmt.load_into(tied, {"tok": x, "head": x, "other": other}, atomic=atomic)
    assert torch.equal(x.cpu(), w) and torch.equal(other.cpu(), b)


# -- strided targets read in pieces --------------------------------------------------------------


def _column_file(tmp_path, cols: int = 1024):
    """A 2048 x `cols` fp32 weight (8 MiB or so, in 1 MiB chunks) saved with its column 0 as a view."""
    w = torch.arange(2048.0 * cols).view(2048, cols)
    p = tmp_path / "col.ckpt"
    ckptfmt.save({"w": w, "c": w[:, 0]}, p, chunk_size=1 << 20)
    return p, w


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("cols", [1024, 1000])
def test_pieces_smaller_than_a_chunk_read_each_chunk_once(tmp_path, monkeypatch, atomic, cols):
    """A column view read in pieces whose span (here lowered to 64 KiB) is smaller than a chunk
    (1 MiB): the chunks already in the buffer are kept for the next pieces, so each of the
    column's 8 chunks is read (decoded) once, not once per piece (some 128 pieces; with rows of
    4000 bytes some pieces straddle two chunks, and the buffer's kept chunk moves to its front)."""
    p, w = _column_file(tmp_path, cols)
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 64 << 10)
    written: list[int] = []
    _hook_reads(monkeypatch, before=lambda ks, check_only: None if check_only else written.extend(ks))
    c = torch.zeros(2048)
    ckptfmt.load_into(p, {"c": c}, strict=False, atomic=atomic)
    assert torch.equal(c, w[:, 0])
    assert sorted(written) == sorted(set(written)) and len(written) == 8, written


def test_an_atomic_load_checks_only_the_chunks_of_a_strided_targets_pieces(tmp_path, monkeypatch):
    """Two elements 8 MiB apart (a view of a buffer in 64 KiB chunks, read in pieces: the span
    window lowered to 64 KiB): the atomic load's checking pass reads the 2 chunks the pieces lie
    in, as the writes do, not the 128 chunks of the span."""
    base = torch.arange(float(1 << 21))
    p = tmp_path / "far.ckpt"
    ckptfmt.save({"base": base, "two": base[:: (1 << 21) - 1]}, p, chunk_size=64 << 10)
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 64 << 10)
    read: dict[bool, list[int]] = {True: [], False: []}
    _hook_reads(monkeypatch, before=lambda ks, check_only: read[check_only].extend(ks))
    two = torch.zeros(2)
    ckptfmt.load_into(p, {"two": two}, strict=False)
    assert two.tolist() == [0.0, float((1 << 21) - 1)]
    assert sorted(read[True]) == sorted(read[False]) == [0, 127], read


def test_a_span_just_past_the_window_is_read_in_pieces(tmp_path, monkeypatch):
    """Whether a strided target is read whole is decided by its span's bytes, as its pieces are
    cut: two elements 128 KiB apart, past the (lowered) 64 KiB window, read as two pieces of one
    chunk each, not as the 3 chunks of their span."""
    base = torch.arange(float(1 << 16))
    p = tmp_path / "near.ckpt"
    ckptfmt.save({"base": base, "two": base[: (1 << 15) + 1 : 1 << 15]}, p, chunk_size=64 << 10)
    monkeypatch.setattr(fillplan, "_SPAN_WINDOW", 64 << 10)
    read: list[int] = []
    _hook_reads(monkeypatch, before=lambda ks, check_only: read.extend(ks))
    two = torch.zeros(2)
    ckptfmt.load_into(p, {"two": two}, strict=False, atomic=False)
    assert two.tolist() == [0.0, float(1 << 15)]
    assert sorted(read) == [0, 2], read

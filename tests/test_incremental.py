"""Incremental checkpoints (spec section 12): external chunks, content digests, references."""

from __future__ import annotations

import gc
import json
import os
import shutil
import struct
import subprocess
import tempfile

import numpy as np
import pytest
import torch
import xxhash
from cli_runner import run_cli
from helpers import assert_same, states
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.engine import native as _native
from ckptfmt.files import consolidate, incremental, reader
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.format import layout as fmt

BACKENDS = ["c", "python"]
CORPUS = os.path.join(os.path.dirname(__file__), "corpus")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    elif not _native.built():
        pytest.skip("the C engine is not built")
    return request.param


@pytest.fixture(autouse=True)
def _no_fd_leaks():
    before = len(os.listdir("/proc/self/fd"))
    yield
    gc.collect()  # tensors loaded with mmap=True keep the mapping (and its descriptor) until collected
    assert len(os.listdir("/proc/self/fd")) <= before, "a file descriptor leaked"


def _run_dir(tmp_path, n: int) -> list[str]:
    """run/step-0/state.ckpt ... as a checkpoint manager lays them out."""
    paths = []
    for i in range(n):
        os.makedirs(tmp_path / "run" / f"step-{i}", exist_ok=True)
        paths.append(str(tmp_path / "run" / f"step-{i}" / "state.ckpt"))
    return paths


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "frozen": torch.randn(64, 1024, generator=g) * 0.02,  # 256 KiB, 4 chunks of 64 KiB
        "embed": torch.randn(100, 96, generator=g).bfloat16(),
        "lora": torch.randn(16, 64, generator=g),
    }


def _index(path) -> dict:
    data = open(path, "rb").read()
    ioff, ilen = struct.unpack_from("<QQ", data, len(data) - 64)
    return json.loads(data[ioff : ioff + ilen])


def _local(path) -> list[int]:
    with CheckpointFile(path) as f:
        return [k for k, ch in enumerate(f.chunks) if ch.source < 0]


def _data_bytes(path) -> int:
    with CheckpointFile(path) as f:
        return f.footer.index_offset - fmt.PROLOGUE_SIZE


def _raw_chunks(path) -> list[bytes]:
    """Every chunk's raw bytes, wherever it lies (verified)."""
    with CheckpointFile(path) as f:
        out = []
        for k, ch in enumerate(f.chunks):
            buf = bytearray(ch.raw_len)
            f.read_into([(k, memoryview(buf))], True)
            out.append(bytes(buf))
        return out


# -- round trips -------------------------------------------------------------


@st.composite
def _runs(draw: st.DrawFn):
    """A generated state plus 1-4 tensors, and which of those change (wholly or one element)."""
    gen = draw(states(max_leaves=8))
    sizes = draw(st.lists(st.integers(1, 3 * 1024), min_size=1, max_size=4))
    changes = draw(
        st.lists(st.sampled_from(["none", "all", "one"]), min_size=len(sizes), max_size=len(sizes))
    )
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return gen, sizes, changes, dtype


@settings(
    max_examples=8 if os.environ.get("CKPTFMT_SANITIZED") else 30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(run=_runs(), backend_name=st.sampled_from(BACKENDS), compression=st.sampled_from([None, "zstd"]))
def test_round_trip_writes_only_what_changed(tmp_path, monkeypatch, run, backend_name, compression):
    gen, sizes, changes, dtype = run
    monkeypatch.setenv("CKPTFMT_BACKEND", "python" if backend_name == "python" else "")
    g = torch.Generator().manual_seed(len(sizes))
    big = {f"t{i}": torch.randn(n, generator=g).to(dtype) for i, n in enumerate(sizes)}
    state = {"gen": gen, "big": big}
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        a, b = os.path.join(d, "a.ckpt"), os.path.join(d, "b.ckpt")
        incremental.save(state, a, chunk_size=4096, compression=compression)
        first = {k: v.clone() for k, v in big.items()}
        for t, how in zip(big.values(), changes):
            if how == "all":
                t.add_(1.0)
            elif how == "one":
                t[len(t) // 2] += 1.0
        incremental.save(state, b, base=a, compression=compression)
        assert_same({"gen": gen, "big": first}, ckptfmt.load(a))
        assert_same(state, ckptfmt.load(b))
        # independently of digests: exactly the chunks whose bytes the first file lacks are local
        have = set(_raw_chunks(a))
        raw_b = _raw_chunks(b)
        expected = [k for k, raw in enumerate(raw_b) if raw not in have]
        assert _local(b) == expected
        if compression is None:
            assert _data_bytes(b) == sum(fmt.align_up(len(raw_b[k])) for k in expected)


def test_second_save_is_about_the_size_of_the_changed_tensors(tmp_path, backend):
    a, b = _run_dir(tmp_path, 2)
    state = _model()
    incremental.save(state, a, chunk_size=1 << 16)
    state["lora"].add_(0.5)
    incremental.save(state, b, base=a)
    full = os.path.getsize(a)
    assert os.path.getsize(b) < 16 * 64 * 4 + 4096  # the changed tensor and the index
    assert os.path.getsize(b) < full / 20
    assert _index(b)["chunk_size"] == 1 << 16  # the base's chunk size, so chunks line up
    assert_same(state, ckptfmt.load(b))


def test_first_save_has_digests_and_no_externals(tmp_path):
    p = tmp_path / "a.ckpt"
    t = torch.arange(10.0)
    incremental.save({"t": t}, p)
    data = p.read_bytes()
    assert struct.unpack_from("<Q", data, 40)[0] == fmt.FEATURE_EXTERNAL
    index = _index(p)
    assert index["externals"] == []
    assert index["chunks"][0][7] == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())
    assert incremental.referenced_files(p) == []
    assert ckptfmt.verify(p).ok


def test_plain_save_is_unchanged(tmp_path, monkeypatch):
    """Files without the feature are the bytes they always were (required features 0, 7-field records)."""
    monkeypatch.setenv("CKPTFMT_FILE_ID", "00" * 16)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764460800")
    p = tmp_path / "p.ckpt"
    ckptfmt.save({"w": torch.tensor([1.0, 2.0]), "step": 7}, p)
    data = p.read_bytes()
    assert len(data) == 704 and struct.unpack_from("<Q", data, 40)[0] == 0
    assert "externals" not in _index(p) and len(_index(p)["chunks"][0]) == 7


# -- chains and deletion --------------------------------------------------------


def test_chain_of_three_refers_to_the_holder_directly(tmp_path, backend):
    s0, s1, s2 = _run_dir(tmp_path, 3)
    state = _model()
    incremental.save(state, s0, chunk_size=1 << 16)
    state["lora"].add_(1.0)
    incremental.save(state, s1, base=s0)
    state["lora"].add_(1.0)
    incremental.save(state, s2, base=s1)
    assert incremental.referenced_files(s2) == [os.path.abspath(s0)]
    assert _index(s2)["externals"][0][0] == "../step-0/state.ckpt"
    os.unlink(s1)
    assert_same(state, ckptfmt.load(s2))
    assert ckptfmt.verify(s2).ok


def test_unchanged_since_the_middle_file_refers_to_both(tmp_path, backend):
    s0, s1, s2 = _run_dir(tmp_path, 3)
    state = _model()
    incremental.save(state, s0, chunk_size=1 << 16)
    state["lora"].add_(1.0)
    incremental.save(state, s1, base=s0)
    state["step"] = 2  # the lora weights stay as saved in s1
    incremental.save(state, s2, base=s1)
    assert sorted(incremental.referenced_files(s2)) == sorted(map(os.path.abspath, [s0, s1]))
    assert os.path.getsize(s2) < 4096  # nothing but the index
    assert_same(state, ckptfmt.load(s2))


def test_flat_layout_and_same_directory_references(tmp_path):
    a, b = str(tmp_path / "step-1.ckpt"), str(tmp_path / "step-2.ckpt")
    state = _model()
    incremental.save(state, a)
    incremental.save(state, b, base=a)
    assert _index(b)["externals"][0][0] == "step-1.ckpt"
    assert_same(state, ckptfmt.load(b))


def test_mutation_through_data_and_no_grad_is_detected(tmp_path, backend):
    s0, s1, s2 = _run_dir(tmp_path, 3)
    p = torch.nn.Parameter(torch.randn(4096))
    buf = torch.randn(4096)
    state = {"p": p, "buf": buf}
    incremental.save(state, s0, chunk_size=4096)
    p.data[7] += 1.0  # no version counter of p sees this
    incremental.save(state, s1, base=s0)
    assert _local(s1) == [0]
    with torch.no_grad():
        buf.add_(1)
    incremental.save(state, s2, base=s1)
    assert _local(s2) == [4, 5, 6, 7]  # 16 KiB each: p is chunks 0-3, buf 4-7
    out = ckptfmt.load(s2)
    assert torch.equal(out["p"], p) and torch.equal(out["buf"], buf)


def test_external_chunks_never_chain_after_deletion(tmp_path):
    """A base whose referenced file is gone: its chunks are written again, not referred to."""
    s0, s1, s2 = _run_dir(tmp_path, 3)
    state = _model()
    incremental.save(state, s0, chunk_size=1 << 16)
    state["lora"].add_(1.0)
    incremental.save(state, s1, base=s0)
    os.unlink(s0)
    incremental.save(state, s2, base=s1)
    assert incremental.referenced_files(s2) == [os.path.abspath(s1)]
    assert_same(state, ckptfmt.load(s2))


# -- every reading path -------------------------------------------------------


def test_every_reading_path_follows_external_chunks(tmp_path, monkeypatch, backend):
    a, b = _run_dir(tmp_path, 2)
    state = _model()
    state["arr"] = np.arange(5000, dtype=np.float64)
    incremental.save(state, a, chunk_size=4096, compression="zstd")
    state["lora"].mul_(2)
    incremental.save(state, b, base=a)
    assert_same(state, ckptfmt.load(b))
    assert_same(state, ckptfmt.load(b, mmap=True))  # external storages are read, not mapped
    assert_same(state, ckptfmt.load(b, verify=False))
    with ckptfmt.open(b) as r:
        assert torch.equal(r.get("frozen"), state["frozen"])
        meta = r.get("embed", map_location="meta")
        assert meta.is_meta and meta.shape == state["embed"].shape
        assert torch.equal(r.get("lora"), state["lora"])
    target = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    target["arr"] = np.zeros(5000)
    report = ckptfmt.load_into(b, target)
    assert report.loaded == 4
    for k in ("frozen", "embed", "lora"):
        assert torch.equal(target[k], state[k])
    monkeypatch.setenv("CKPTFMT_FORCE_STAGING", "1")  # the staged device path, on the CPU
    assert_same(state, ckptfmt.load(b))
    monkeypatch.setattr(reader, "staging_budget", lambda: 4096)
    assert_same(state, ckptfmt.load(b))


def test_open_referenced_files_are_bounded_and_closed(tmp_path, monkeypatch, backend):
    """Each step changes one tensor: the last file refers to every earlier one."""
    n = 8
    paths = _run_dir(tmp_path, n)
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(n)}
    incremental.save(state, paths[0], chunk_size=4096)
    for i in range(1, n):
        state[f"t{i}"].add_(100)
        incremental.save(state, paths[i], base=paths[i - 1])
    assert len(incremental.referenced_files(paths[-1])) == n - 1
    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 3)
    fds = len(os.listdir("/proc/self/fd"))
    with ckptfmt.open(paths[-1]) as r:
        for i in range(n):
            assert r.get(f"t{i}")[0].item() == state[f"t{i}"][0].item()
            # the file, its directory (references are resolved beneath it) and 3 referenced files
            assert len(os.listdir("/proc/self/fd")) <= fds + 2 + 3
    assert len(os.listdir("/proc/self/fd")) == fds
    assert_same(state, ckptfmt.load(paths[-1]))


# -- damaged and missing referenced files --------------------------------------


def _two_files(tmp_path):
    a, b = _run_dir(tmp_path, 2)
    state = _model()
    incremental.save(state, a, chunk_size=1 << 16)
    state["lora"].add_(1.0)
    incremental.save(state, b, base=a)
    return a, b, state


@pytest.mark.parametrize(
    "damage", ["flip", "missing", "replaced", "truncated", "directory", "symlink", "fifo"]
)
def test_damaged_referenced_file_names_both_files(tmp_path, backend, damage):
    a, b, state = _two_files(tmp_path)
    with CheckpointFile(a) as f:
        frozen_off = f.chunks[0].offset
    if damage == "flip":
        data = bytearray(open(a, "rb").read())
        data[frozen_off + 100] ^= 0x10
        open(a, "wb").write(data)
    elif damage == "missing":
        os.unlink(a)
    elif damage == "replaced":  # another save at that path: a different file id
        incremental.save(state, a)
    elif damage == "truncated":
        os.truncate(a, 4096)
    elif damage == "directory":
        os.unlink(a)
        os.mkdir(a)
    elif damage == "fifo":  # must not hang the reader
        os.unlink(a)
        os.mkfifo(a)
    else:
        shutil.move(a, a + ".real")
        os.symlink(os.path.basename(a) + ".real", a)
    expected = ckptfmt.IncompleteError if damage in ("missing", "truncated") else ckptfmt.CorruptError
    with pytest.raises(expected) as info:
        ckptfmt.load(b)
    msg = str(info.value)
    assert msg.startswith(b + ": state['frozen']: chunk 0: ")
    assert os.path.normpath(a) in msg
    report = ckptfmt.verify(b)
    assert not report.ok
    first = report.problems[0]
    assert first.key == "state['frozen']" and first.chunk == 0 and os.path.normpath(a) in first.message
    if damage != "flip":  # an unusable file is one problem, not one per chunk
        assert len(report.problems) == 1
    with ckptfmt.open(b) as r:  # what lies in the file itself still reads
        assert torch.equal(r.get("lora"), state["lora"])


def test_damage_reads_the_same_on_both_backends(tmp_path, monkeypatch):
    if not _native.built():
        pytest.skip("the C engine is not built")
    a, b, _ = _two_files(tmp_path)
    with CheckpointFile(a) as f:
        second = f.chunks[1].offset
    data = bytearray(open(a, "rb").read())
    data[second + 5] ^= 1
    open(a, "wb").write(data)
    messages = []
    for be in ("", "python"):
        monkeypatch.setenv("CKPTFMT_BACKEND", be)
        with pytest.raises(ckptfmt.CorruptError) as info:
            ckptfmt.load(b)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert "chunk 1: external chunk 1 at offset" in messages[0] and "checksum mismatch" in messages[0]


@pytest.mark.parametrize(
    "name",
    [
        "ext_chunk_outside_data",
        "ext_digest_mismatch",
        "ext_missing_file",
        "ext_not_ckptfmt",
        "ext_transplanted_chunk",
        "ext_wrong_file_id",
        "ext_wrong_length",
    ],
)
def test_corpus_errors_name_both_files_on_both_backends(monkeypatch, name):
    messages = []
    for be in ("", "python"):
        monkeypatch.setenv("CKPTFMT_BACKEND", be)
        with pytest.raises(ckptfmt.CheckpointError) as info:
            ckptfmt.load(os.path.join(CORPUS, f"{name}.ckpt"))
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert f"{name}.ckpt: state['w']: chunk 0: " in messages[0]
    assert ".ref" in messages[0]


# -- the writer's choices --------------------------------------------------------


def test_bases_that_cannot_be_referred_to(tmp_path):
    """Not an incremental base: a warning, and a correct save that writes every chunk."""
    state = {"t": torch.ones(3)}
    a = tmp_path / "a.ckpt"
    ckptfmt.save(state, a)
    b = tmp_path / "b.ckpt"
    with pytest.warns(ckptfmt.CheckpointWarning, match="without content digests"):
        incremental.save(state, b, base=a)
    assert _local(b) == [0] and incremental.referenced_files(b) == []
    with pytest.warns(ckptfmt.CheckpointWarning, match="cannot refer to"):
        incremental.save(state, b, base=b)  # the file being replaced
    assert _local(b) == [0]
    deep = tmp_path / "x" / "y"
    deep.mkdir(parents=True)
    with pytest.warns(ckptfmt.CheckpointWarning, match="cannot refer to"):
        incremental.save(state, deep / "c.ckpt", base=b)  # ../../b.ckpt
    hidden = tmp_path / ".hidden.ckpt"
    shutil.copy(b, hidden)
    with pytest.warns(ckptfmt.CheckpointWarning, match="cannot refer to"):
        incremental.save(state, tmp_path / "c.ckpt", base=hidden)
    assert_same(state, ckptfmt.load(tmp_path / "c.ckpt"))
    with pytest.raises(FileNotFoundError):
        incremental.save(state, tmp_path / "d.ckpt", base=tmp_path / "missing.ckpt")
    with pytest.raises(FileNotFoundError):
        incremental.save(state, tmp_path / "nodir" / "d.ckpt", base=b)
    (tmp_path / "bad.ckpt").write_bytes(b"\x89CKF\r\n\x1a\n" + bytes(100))
    with pytest.raises(ckptfmt.CheckpointError):
        incremental.save(state, tmp_path / "d.ckpt", base=tmp_path / "bad.ckpt")


def test_externals_cap_writes_the_rest_locally(tmp_path, monkeypatch):
    paths = _run_dir(tmp_path, 4)
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    incremental.save(state, paths[0], chunk_size=4096)
    for i in range(1, 4):
        state[f"t{i}"].add_(100)
        incremental.save(state, paths[i], base=paths[i - 1])
    assert len(incremental.referenced_files(paths[-1])) == 3
    # the next save could refer to 4 files (t0..t2 in steps 0-2, t3 in step 3); it may name 3
    monkeypatch.setattr(fmt.Limits, "MAX_EXTERNALS", 3)
    out = tmp_path / "run" / "final.ckpt"
    incremental.save(state, out, base=paths[-1])
    assert len(_index(out)["externals"]) == 3
    assert _local(out) == [3]
    assert_same(state, ckptfmt.load(out))


def test_both_backends_write_identical_incremental_files(tmp_path, monkeypatch):
    if not _native.built():
        pytest.skip("the C engine is not built")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764460800")
    outputs = []
    for be in ("", "python"):
        monkeypatch.setenv("CKPTFMT_BACKEND", be)
        d = tmp_path / (be or "c")
        d.mkdir()
        state = _model()
        files = []
        for i, blocking in enumerate([True, True, False]):
            monkeypatch.setenv("CKPTFMT_FILE_ID", f"{i:02x}" * 16)
            p = d / f"s{i}.ckpt"
            h = incremental.save(
                state,
                p,
                base=files[-1] if files else None,
                chunk_size=4096,
                blocking=blocking,
                compression="zstd",
            )
            if h is not None:
                h.wait()
            files.append(p)
            state["lora"].add_(1.0)
        outputs.append([p.read_bytes() for p in files])
    assert outputs[0] == outputs[1]


def test_nonblocking_save_snapshots_at_call_time(tmp_path, backend):
    a, b = _run_dir(tmp_path, 2)
    state = _model()
    incremental.save(state, a, chunk_size=4096)
    state["lora"].add_(1.0)
    expected = {k: v.clone() for k, v in state.items()}
    h = incremental.save(state, b, base=a, blocking=False)
    assert isinstance(h, ckptfmt.SaveHandle)
    for t in state.values():
        t.fill_(-3)  # after the call: neither the bytes nor the digests may see this
    h.wait()
    assert_same(expected, ckptfmt.load(b), check_sharing=False)
    assert incremental.referenced_files(b) == [os.path.abspath(a)]
    assert len(_local(b)) == 1  # only the lora chunk


def test_save_waits_for_a_nonblocking_base(tmp_path):
    a, b = _run_dir(tmp_path, 2)
    state = _model()
    h = incremental.save(state, a, blocking=False)
    incremental.save(state, b, base=a)  # waits for a to be committed
    h.wait()
    assert incremental.referenced_files(b) == [os.path.abspath(a)]


# -- the spec alone --------------------------------------------------------------


def test_external_records_decode_from_the_spec_alone(tmp_path, monkeypatch):
    """Section 12, read with struct, json and xxhash only: every chunk's bytes, wherever they lie."""
    a, b = _run_dir(tmp_path, 2)
    state = {"w": torch.randn(3000), "b": torch.randn(100)}
    incremental.save(state, a, chunk_size=4096)
    state["b"].add_(1)
    incremental.save(state, b, base=a)
    data = open(b, "rb").read()
    fid = data[16:32]
    assert struct.unpack_from("<Q", data, 40)[0] & 1
    index = _index(b)
    assert list(index)[4:7] == ["storages", "externals", "chunks"]
    raw = b""
    expect_local = 64
    for k, rec in enumerate(index["chunks"]):
        off, slen, rlen, codec, filt, width, check, digest = rec[:8]
        assert codec == 0 and len(digest) == 32
        if len(rec) == 10:
            rel, ext_id, ext_len = index["externals"][rec[8]]
            other = open(os.path.join(os.path.dirname(b), rel), "rb").read()
            assert len(other) == ext_len and other[16:32].hex() == ext_id
            ioff = struct.unpack_from("<Q", other, len(other) - 64)[0]
            assert (off + slen + 63) // 64 * 64 <= ioff
            seed_id, number, src = bytes.fromhex(ext_id), rec[9], other
        else:
            assert len(rec) == 8 and off == expect_local
            expect_local = (off + slen + 63) // 64 * 64
            seed_id, number, src = fid, k, data
        ctx = (
            b"ckptfmt-chunk\0\0\0"
            + seed_id
            + struct.pack("<QQQQBBB5x", number, off, slen, rlen, codec, filt, width)
        )
        stored = src[off : off + slen]
        assert int(check, 16) == xxhash.xxh3_64_intdigest(stored, seed=xxhash.xxh3_64_intdigest(ctx))
        assert digest == xxhash.xxh3_128_digest(stored).hex()  # big-endian, canonical
        raw += stored
    ioff = struct.unpack_from("<Q", data, len(data) - 64)[0]
    assert expect_local == ioff
    assert raw == state["w"].numpy().tobytes() + state["b"].numpy().tobytes()


def test_spec_example_12_8(tmp_path, monkeypatch):
    """The worked example of spec section 12.8, byte for byte in the members it shows."""
    s0, s1 = _run_dir(tmp_path, 2)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764460800")
    monkeypatch.setenv("CKPTFMT_FILE_ID", bytes(range(16)).hex())
    state = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0]), "step": 7}
    incremental.save(state, s0)
    monkeypatch.setenv("CKPTFMT_FILE_ID", bytes(range(16, 32)).hex())
    state.update(b=torch.tensor([4.0]), step=8)
    incremental.save(state, s1, base=s0)
    assert os.path.getsize(s0) == 1024
    index = _index(s1)
    assert index["storages"] == [[8, "cpu"], [4, "cpu"]]
    assert index["externals"] == [["../step-0/state.ckpt", "000102030405060708090a0b0c0d0e0f", 1024]]
    assert index["chunks"] == [
        [64, 8, 8, 0, 0, 0, "842bbfe4c9565e46", "4533ce61c4655ba3c3e077b25dd1d769", 0, 0],
        [64, 4, 4, 0, 0, 0, "97a3cba1e4b07aa2", "c1d88dfa6e58e2f115fe407e91fb7956"],
    ]
    assert struct.unpack_from("<Q", open(s1, "rb").read(), 40)[0] == 1
    assert xxhash.xxh3_128_hexdigest(b"abc") == "06b05ab6733a618578af5f94892f3950"


# -- command line -----------------------------------------------------------------


def _cli(*args: str, rc: int) -> subprocess.CompletedProcess:
    return run_cli(*args, rc=rc)


def test_cli_consolidate_inspect_verify(tmp_path):
    s0, s1, s2 = _run_dir(tmp_path, 3)
    state = _model()
    incremental.save(state, s0, chunk_size=4096, metadata={"run": "x"})
    state["lora"].add_(1.0)
    incremental.save(state, s1, base=s0, metadata={"run": "x"})
    state["embed"].add_(1.0)
    incremental.save(state, s2, base=s1, metadata={"run": "x"})
    out = _cli("inspect", s2, rc=0).stdout
    assert "externals: " in out and "lie in 2 referenced file(s)" in out
    assert "../step-0/state.ckpt" in out and "../step-1/state.ckpt" in out
    doc = json.loads(_cli("inspect", "--json", s2, rc=0).stdout)
    assert doc["content_digests"] and [e["path"] for e in doc["externals"]] == [
        "../step-0/state.ckpt",
        "../step-1/state.ckpt",
    ]
    frozen = next(r for r in doc["tree"] if r["key"] == "state['frozen']")
    assert frozen["external_chunks"] == frozen["chunks"] == 64
    # frozen (64 chunks, in step 0) and lora (1 chunk, changed in step 1); embed changed in step 2
    assert doc["external_chunks"] == 65 and doc["external_bytes"] == 65 * 4096
    _cli("verify", s2, rc=0)

    flat = str(tmp_path / "flat.ckpt")
    doc = json.loads(_cli("consolidate", "--json", s2, flat, rc=0).stdout)
    assert doc["ok"] and doc["external_chunks"] == 65 and doc["referenced_files"] == 2
    packed = str(tmp_path / "packed.ckpt")
    line = _cli("consolidate", s2, packed, "--compression", "zstd", rc=0).stdout
    assert "self-contained copy" in line
    for p in (flat, packed):
        assert struct.unpack_from("<Q", open(p, "rb").read(), 40)[0] == 0
        assert "externals" not in _index(p)
    shutil.rmtree(tmp_path / "run" / "step-0")
    shutil.rmtree(tmp_path / "run" / "step-1")
    for p in (flat, packed):
        _cli("verify", p, rc=0)
        assert_same(state, ckptfmt.load(p))
        with ckptfmt.open(p) as r:
            assert r.metadata == {"run": "x"}
        assert _index(p)["chunk_size"] == 4096
    assert os.path.getsize(packed) < os.path.getsize(flat)
    # the base files are gone: the incremental file fails, naming them
    proc = _cli("verify", s2, rc=1)
    assert "FAILED incomplete" in proc.stdout and "step-0/state.ckpt" in proc.stdout
    proc = _cli("consolidate", s2, str(tmp_path / "again.ckpt"), rc=1)
    assert "step-0/state.ckpt" in proc.stderr and not os.path.exists(tmp_path / "again.ckpt")
    _cli("consolidate", str(tmp_path / "nothing.ckpt"), str(tmp_path / "x.ckpt"), rc=2)
    _cli("consolidate", flat, flat, rc=2)
    _cli("consolidate", flat, rc=2)


def test_consolidate_keeps_device_tags_and_tree(tmp_path):
    a, b = _run_dir(tmp_path, 2)
    state = {"w": torch.randn(5000), "v": torch.arange(10.0)[2:5], "n": np.arange(4), "s": "x"}
    incremental.save(state, a, chunk_size=4096)
    state["s"] = "y"
    incremental.save(state, b, base=a)
    out = tmp_path / "c.ckpt"
    report = consolidate.consolidate(b, out)
    assert report.external_chunks == report.chunks == 7 and report.referenced_files == 1
    assert _index(out)["nodes"] == _index(b)["nodes"]
    assert _index(out)["storages"] == _index(b)["storages"]
    assert_same(state, ckptfmt.load(out))


# -- DCP saves against a base (cdcp.save(..., incremental=True / base=)) --------------------------


def test_dcp_saves_against_a_base(tmp_path):
    """A DCP save with base= writes only what changed, its record names the base's files it
    reads from, it loads and verifies; with the base's file gone, the load fails naming it."""
    from ckptfmt import dcp as cdcp
    from ckptfmt.files import multifile

    frozen = torch.arange(1 << 18, dtype=torch.float32)
    first, second = tmp_path / "d1", tmp_path / "d2"
    cdcp.save({"frozen": frozen.clone(), "lora": torch.zeros(100), "n": 1}, str(first), incremental=True)
    cdcp.save({"frozen": frozen.clone(), "lora": torch.ones(100), "n": 2}, str(second), base=str(first))
    assert (first / "rank-00000.ckpt").stat().st_size > frozen.numel() * 4
    assert (second / "rank-00000.ckpt").stat().st_size < 16 << 10
    record = multifile.check_complete(str(second))
    assert [p.name for p in record.references] == ["../d1/rank-00000.ckpt"]
    target = {"frozen": torch.zeros(1 << 18), "lora": torch.zeros(100), "n": 0}
    cdcp.load(target, str(second))
    assert torch.equal(target["frozen"], frozen) and torch.equal(target["lora"], torch.ones(100))
    assert target["n"] == 2
    assert "OK" in run_cli("verify", second, rc=0).stdout
    # a base saved without digests (incremental=False) cannot be referred to: every chunk written
    plain, third = tmp_path / "plain", tmp_path / "d3"
    cdcp.save({"frozen": frozen.clone(), "lora": torch.zeros(100), "n": 1}, str(plain))
    with pytest.warns(ckptfmt.CheckpointWarning):
        cdcp.save({"frozen": frozen.clone(), "lora": torch.ones(100), "n": 3}, str(third), base=str(plain))
    assert (third / "rank-00000.ckpt").stat().st_size > frozen.numel() * 4
    assert multifile.check_complete(str(third)).references == ()
    os.unlink(first / "rank-00000.ckpt")
    with pytest.raises(ckptfmt.IncompleteError, match="d1/rank-00000.ckpt"):
        cdcp.load(target, str(second))
    with pytest.raises(ValueError, match="must lie where the checkpoint does"):
        cdcp.save({"n": 1}, str(tmp_path / "d4"), base="s3://bucket/d1")


def test_an_incremental_save_checks_its_keywords_as_save_does(tmp_path):
    """Its keywords go through save()'s one check (files.save.save_options) before any file is
    read or written: an option it cannot honour is refused, not ignored."""
    a = tmp_path / "a.ckpt"
    with pytest.raises(ValueError, match="unknown storage option 'bogus'"):
        incremental.save({"w": torch.ones(4)}, a, storage_options={"bogus": 1})
    with pytest.raises(ValueError, match="level is only meaningful"):
        incremental.save({"w": torch.ones(4)}, a, level=3)
    assert not a.exists() and os.listdir(tmp_path) == []

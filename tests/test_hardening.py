"""Hostile files and paths found by an independent reader: wrong devices, sizes beyond int64,
NaN keys, hash-colliding keys, FIFOs, memory per node, eager key paths, zstd frames that
one engine took and the other refused, scratch sized to the work, and max_bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import zstandard

import ckptfmt
from ckptfmt.engine import native as _native
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.format import layout as fmt
from ckptfmt.format import render
from ckptfmt.format.layout import Limits

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "corpus"))
import make_corpus as mc  # noqa: E402

CORPUS = os.path.join(os.path.dirname(__file__), "corpus")


def _write(tmp_path, data: bytes, name: str = "h.ckpt") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def _python(code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
    """Run `code` in a fresh interpreter; its stdout.  A hang fails the test instead of the run."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# -- devices --------------------------------------------------------------------


def test_device_index_torch_cannot_hold_is_refused(tmp_path):
    for tag in ("cuda:300", "cuda:128", "cuda:255", "cuda:01", "cuda:9999"):
        p = _write(tmp_path, mc.build(mc.idx(storages=[[16, tag]])))
        with pytest.raises(ckptfmt.CorruptError, match="invalid device"):
            ckptfmt.load(p)
        p = _write(tmp_path, mc.build(mc.idx(storages=[], nodes=[["device", tag]]), []))
        with pytest.raises(ckptfmt.CorruptError):
            ckptfmt.load(p)
    p = _write(tmp_path, mc.build(mc.idx(storages=[], nodes=[["device", "cuda:127"]]), []))
    assert ckptfmt.load(p) == torch.device("cuda", 127)


def test_map_location_that_torch_would_wrap_is_refused(tmp_path):
    p = tmp_path / "x.ckpt"
    ckptfmt.save({"w": torch.ones(2)}, p)
    for bad in ("cuda:300", {"cpu": "cuda:200"}):
        with pytest.raises(ValueError, match="index above 127"):
            ckptfmt.load(p, map_location=bad)


def test_storage_on_a_backend_torch_does_not_know(tmp_path):
    """A tag of a backend not installed here: loads on the CPU, and a map_location that would
    send it to that backend is an UnsupportedError (not torch's RuntimeError)."""
    # in a process of its own: the test backend (tests/npu_ext) registers "npu" for good in a
    # worker that ran test_npu.py or test_load_into.py before this file
    p = _write(tmp_path, mc.build(mc.idx(storages=[[16, "npu:0"]])))
    code = textwrap.dedent(
        f"""
        import pytest, ckptfmt
        p = {p!r}
        assert ckptfmt.load(p)["w"].tolist() == [1.0, 2.0, 3.0, 4.0]
        assert ckptfmt.load(p, map_location={{"npu:0": "cpu"}})["w"].device.type == "cpu"
        with pytest.raises(ckptfmt.UnsupportedError, match=r"saved on 'npu:0'.*map_location"):
            ckptfmt.load(p, map_location={{"cuda:0": "cpu"}})
        with pytest.raises(ckptfmt.UnsupportedError, match="npu"):
            ckptfmt.load(p, map_location=lambda storage, location: None)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# -- torch.Size beyond int64 ----------------------------------------------------


def test_size_dim_beyond_int64_is_refused_at_validation(tmp_path):
    p = _write(tmp_path, mc.build(mc.idx(storages=[], nodes=[["size", ["8000000000000000"]]]), []))
    with pytest.raises(ckptfmt.CorruptError, match="size"):
        CheckpointFile(p)
    assert not ckptfmt.verify(p).ok
    p = _write(tmp_path, mc.build(mc.idx(storages=[], nodes=[["size", ["7fffffffffffffff"]]]), []))
    assert ckptfmt.load(p) == torch.Size([2**63 - 1])


# -- NaN keys -------------------------------------------------------------------


def test_nan_key_from_keys_finds_its_entry(tmp_path):
    p = tmp_path / "n.ckpt"
    other_nan = -float("nan")  # another bit pattern
    ckptfmt.save({float("nan"): 1, other_nan: 2, "w": torch.ones(1), (1.0, float("nan")): 3}, p)
    with ckptfmt.open(p) as r:
        keys = r.keys()
        assert [r.get(k) for k in keys[:2]] == [1, 2]
        assert r.get(keys[3]) == 3
        assert all(k in r for k in keys)
        # a fresh NaN with the same bits finds it too
        assert r.get(float("nan")) == 1 and r.get(-float("nan")) == 2
        assert r.get((1.0, float("nan"))) == 3
        # keys of another type are other keys (unlike in a dict: 1 == 1.0 == True)
        assert 1.0 not in r and "w" in r


# -- keys that collide in Python's hash ----------------------------------------


def test_colliding_keys_are_refused_in_bounded_time():
    out = _python(
        """
        import sys, time, ckptfmt
        for attempt in range(2):  # the second is timed: the first pays the reader's imports
            t = time.perf_counter()
            try:
                ckptfmt.load(sys.argv[1])
            except ckptfmt.LimitError as e:
                outcome = type(e).__name__
        print(outcome, time.perf_counter() - t)
        """,
        os.path.join(CORPUS, "dict_keys_hash_collide.ckpt"),
        timeout=60,
    )
    name, seconds = out.split()
    assert name == "LimitError" and float(seconds) < 2.0  # 0.05 s here; it was 28 s for this 1 MB file


def test_colliding_keys_at_the_limit_load(tmp_path):
    n = Limits.MAX_KEY_COLLISIONS
    p = _write(tmp_path, mc.build(mc.idx(storages=[], nodes=mc.colliding_keys_nodes(n)), []))
    assert len(ckptfmt.load(p)) == n


# -- FIFOs and other files that are not regular ---------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_never_blocks(tmp_path):
    fifo = str(tmp_path / "pipe.ckpt")
    os.mkfifo(fifo)
    out = _python(
        """
        import sys, ckptfmt
        path = sys.argv[1]
        for name, call in [
            ("load", lambda: ckptfmt.load(path)),
            ("open", lambda: ckptfmt.open(path)),
        ]:
            try:
                call()
                print(name, "no error")
            except ckptfmt.CheckpointError as e:
                print(name, type(e).__name__)
        report = ckptfmt.verify(path)
        print("verify", report.ok, report.problems[0].kind)
        """,
        fifo,
        timeout=60,
    )
    assert out.split("\n")[:3] == [
        "load UnsupportedError",
        "open UnsupportedError",
        "verify False unsupported",
    ]
    for cmd in ("inspect", "verify"):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptfmt", cmd, fifo], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (cmd, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_character_device_is_not_a_checkpoint():
    with pytest.raises(ckptfmt.UnsupportedError, match="not a regular file"):
        ckptfmt.load("/dev/null")


# -- memory per node and the index bound ---------------------------------------

_MEASURE = """
import json, sys, tracemalloc
from ckptfmt.format import layout as fmt
from ckptfmt.files.reader import CheckpointFile
out = []
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    ioff, ilen = int.from_bytes(data[-64:-56], "little"), int.from_bytes(data[-56:-48], "little")
    bound = fmt.index_memory_bound(data[ioff : ioff + ilen])
    del data
    tracemalloc.start()
    try:
        CheckpointFile(path).close()
        err = None
    except Exception as e:
        err = type(e).__name__
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out.append({"index": ilen, "peak": peak, "bound": bound, "error": err})
print(json.dumps(out))
"""


def _measure(paths: list[str]) -> list[dict]:
    return json.loads(_python(_MEASURE, *paths, timeout=300))


def test_memory_per_node_is_bounded(tmp_path):
    """The cheapest node (["none"], 9 bytes of index plus its reference) costs about 220 bytes
    while the index is parsed and checked (was about 470: eager key paths, per-node lists and
    kind strings); the whole stays within a small multiple of the index."""
    n = 100_000
    shapes = {
        "none": [["none"]] * n + [["list", list(range(n))]],
        "empty lists": [["list", []]] * n + [["list", list(range(n))]],
        "int keys": [x for i in range(n // 2) for x in (["int", format(i, "x")], ["none"])]
        + [["dict", [[2 * i, 2 * i + 1] for i in range(n // 2)]]],
    }
    paths = [
        _write(tmp_path, mc.build(mc.idx(storages=[], nodes=v), []), f"{k}.ckpt") for k, v in shapes.items()
    ]
    for r in _measure(paths):
        assert r["error"] is None
        assert r["peak"] / (n + 1) < 320, r  # bytes per node
        assert r["peak"] < 16 * r["index"], r
        assert r["peak"] <= r["bound"], r


def test_index_memory_bound_holds_for_adversarial_json(tmp_path):
    """fmt.index_memory_bound, computed before json.loads, is an upper bound of what parsing
    takes for the JSON shapes that cost the most memory per byte."""
    n = 60_000
    junk = {
        "nested lists": [json.loads("[" * 400 + "]" * 400)] * 100,
        "empty lists": [[]] * n,
        "[[]]": [[[]]] * n,
        "empty objects": [{}] * n,
        "objects": [{"a": 1}] * n,
        "short strings": ["ab"] * n,
        "ints": [1000] * n,
    }
    paths = [
        _write(tmp_path, mc.build(mc.idx(storages=[], nodes=v), []), f"j{i}.ckpt")
        for i, v in enumerate(junk.values())
    ]
    paths.append(
        _write(tmp_path, mc.build(mc.idx(metadata={f"{i:x}": "v" for i in range(60000)})), "meta.ckpt")
    )
    for name, r in zip([*junk, "metadata"], _measure(paths)):
        assert r["peak"] <= r["bound"], (name, r)
        assert r["bound"] <= 70 * r["index"], (name, r)


# -- key paths are rendered when printed, with caps ------------------------------


def test_wide_and_deep_index_opens_in_bounded_memory(tmp_path):
    """200 nested dicts keyed by 20 KB strings over 20000 tensors: a key path of 4 MB each,
    80 GB if rendered for every node on open, as the reader did."""
    depth, width, keylen = 200, 20_000, 20_000
    nodes: list = [mc.tensor_node(0) for _ in range(width)]
    nodes.append(["list", list(range(width))])
    for level in range(depth):
        nodes.append(["str", "k" * keylen + str(level)])
        nodes.append(["dict", [[len(nodes) - 1, len(nodes) - 2]]])
    p = _write(tmp_path, mc.build(mc.idx(nodes=nodes)))
    out = _python(
        """
        import os, resource, sys, time
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1536 << 20), resource.RLIM_INFINITY))
        import ckptfmt
        from ckptfmt.files.reader import CheckpointFile
        from ckptfmt.format import tree
        t = time.perf_counter()
        f = CheckpointFile(sys.argv[1])
        longest = max(len(p) for p, _ in tree.iter_paths(f.tree, f.tree.root, "state"))
        key = f.storages[0].key
        ok = ckptfmt.verify(sys.argv[1]).ok
        print(longest, len(key), ok, time.perf_counter() - t)
        """,
        p,
        timeout=300,
    )
    longest, keylen_, ok, seconds = out.split()
    assert int(longest) <= render.PATH_CHARS and int(keylen_) <= render.PATH_CHARS
    assert ok == "True" and float(seconds) < 60


def test_key_path_names_the_first_tensor_of_a_storage(tmp_path):
    p = tmp_path / "k.ckpt"
    w = torch.ones(4)
    ckptfmt.save({"model": {"a": w[:2], "b": w}, "x": [torch.zeros(1)]}, p)
    with CheckpointFile(p) as f:
        assert [r.key for r in f.storages] == ["state['model']['a']", "state['x'][0]"]
        assert f.key_of(1) == "state['x'][0]"


# -- zstd frames: both engines refuse the same ones -----------------------------


@pytest.mark.parametrize("backend", ["python", "c"])
@pytest.mark.parametrize(
    "case, message",
    [
        ("zstd_window_too_large", "window of 268435456 bytes"),
        ("zstd_legacy_frame", "not a zstd frame"),
        ("zstd_skippable_frame", "not a zstd frame"),
        ("zstd_dictionary_id", "dictionary 7"),
        ("zstd_bad_content_checksum", "does not decode"),
    ],
)
def test_zstd_frames_the_format_refuses(monkeypatch, backend, case, message):
    if backend == "c" and not _native.built():
        pytest.skip("the C engine is not built")
    monkeypatch.setenv("CKPTFMT_BACKEND", backend)
    with pytest.raises(ckptfmt.CorruptError, match=message) as info:
        ckptfmt.load(os.path.join(CORPUS, f"{case}.ckpt"))
    assert info.value.chunk == 0 and info.value.offset == 64


@pytest.mark.parametrize("backend", ["python", "c"])
def test_zstd_frames_the_format_accepts(tmp_path, monkeypatch, backend):
    """A content checksum is allowed (both engines verify it); a window of exactly 2**27 too."""
    if backend == "c" and not _native.built():
        pytest.skip("the C engine is not built")
    monkeypatch.setenv("CKPTFMT_BACKEND", backend)
    checked = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(bytes(4096))
    for frame in (checked, mc.zstd_window(27)):
        p = _write(tmp_path, mc.zstd_case(frame))
        assert ckptfmt.load(p)["w"].count_nonzero() == 0


# -- the C reader's scratch is sized to the work --------------------------------


@pytest.mark.skipif(
    not _native.built() or os.environ.get("CKPTFMT_SANITIZED") == "1", reason="needs the plain C engine"
)
def test_one_big_chunk_does_not_allocate_scratch_for_every_thread(tmp_path):
    p = tmp_path / "big.ckpt"
    ckptfmt.save({"w": torch.zeros(16 << 20)}, p, compression="zstd", chunk_size=64 << 20)  # one 64 MiB chunk
    with CheckpointFile(p) as f:
        assert len(f.chunks) == 1 and f.chunks[0].codec == fmt.CODEC_ZSTD and f.chunks[0].filter == 1
    out = _python(
        """
        import os, resource, sys
        import ckptfmt
        import torch  # mapped before the limit is taken: import ckptfmt leaves it for the first load
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        # the storage and one thread's decode buffer fit; 16 threads' buffers (1 GiB) do not
        resource.setrlimit(resource.RLIMIT_AS, (vm + (400 << 20), resource.RLIM_INFINITY))
        print(ckptfmt.load(sys.argv[1])["w"].count_nonzero().item())
        """,
        str(p),
        env={"CKPTFMT_THREADS": "16"},
    )
    assert out.strip() == "0"


def test_buffers_are_sized_to_the_chunks_not_the_chunk_size(tmp_path):
    """A 1 KB file declaring 1 GiB chunks: verify's window and a staged load's buffer hold the
    bytes there are, not 1 GiB each (a RuntimeError from torch's allocator under a limit)."""
    p = _write(tmp_path, mc.build(mc.idx(chunk_size=1 << 30)))
    out = _python(
        """
        import os, resource, sys
        import ckptfmt
        import torch  # mapped before the limit is taken: import ckptfmt leaves it for the first load
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        print(ckptfmt.verify(sys.argv[1]).ok, ckptfmt.load(sys.argv[1])["w"].tolist())
        """,
        p,
        env={"CKPTFMT_FORCE_STAGING": "1"},
    )
    assert out.split("\n")[0] == "True [1.0, 2.0, 3.0, 4.0]"


# -- max_bytes ------------------------------------------------------------------


def test_max_bytes_refuses_a_small_file_that_asks_for_much(tmp_path):
    p = tmp_path / "z.ckpt"
    ckptfmt.save({"w": torch.zeros(16 << 20), "step": 3}, p, compression="zstd")  # 64 MiB in a few KB
    assert os.path.getsize(p) < 64 << 10
    with pytest.raises(ckptfmt.LimitError, match="max_bytes=1048576"):
        ckptfmt.load(p, max_bytes=1 << 20)
    assert ckptfmt.load(p, max_bytes=256 << 20)["step"] == 3
    with ckptfmt.open(p, max_bytes=1 << 20) as r:
        assert r.get("step") == 3  # no storage needed
        with pytest.raises(ckptfmt.LimitError, match="storages"):
            r.get("w")


def test_max_bytes_bounds_the_index_before_it_is_parsed(tmp_path):
    p = tmp_path / "i.ckpt"
    ckptfmt.save({"x": list(range(10_000))}, p)
    with CheckpointFile(p) as f:
        need = f.index_memory
    assert need > 0
    with pytest.raises(ckptfmt.LimitError, match="index"):
        ckptfmt.open(p, max_bytes=need - 1)
    ckptfmt.open(p, max_bytes=need).close()
    with pytest.raises(ValueError):
        ckptfmt.load(p, max_bytes=-1)


def test_max_bytes_counts_memory_mapped_storages_as_nothing(tmp_path):
    p = tmp_path / "m.ckpt"
    ckptfmt.save({"w": torch.ones(1 << 20)}, p)  # 4 MiB raw
    with pytest.raises(ckptfmt.LimitError):
        ckptfmt.load(p, max_bytes=2 << 20)
    assert ckptfmt.load(p, mmap=True, max_bytes=2 << 20)["w"].sum() == 1 << 20


def test_memory_needed_bounds_decode_buffers(tmp_path):
    p = tmp_path / "d.ckpt"
    ckptfmt.save({"w": torch.zeros(3 << 20)}, p, compression="zstd", chunk_size=1 << 20)
    with CheckpointFile(p) as f:
        sids = list(range(len(f.storages)))
        base = f.index_memory + sum(r.nbytes for r in f.storages)
        need = f.memory_needed(sids)
        assert need > base  # room for decode buffers: 12 zstd chunks


# -- nothing escapes as a plain ValueError ---------------------------------------


def test_inspect_and_verify_with_a_huge_int_key(tmp_path):
    p = tmp_path / "k.ckpt"
    ckptfmt.save({10**5000: {"w": torch.ones(2)}}, p)
    assert ckptfmt.verify(p).ok
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfmt", "inspect", "--json", str(p)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    keys = [r["key"] for r in json.loads(proc.stdout)["tree"]]
    assert "state[<int of 4153 hex digits>]['w']" in keys


def test_inspect_with_a_huge_int_value(tmp_path):
    p = tmp_path / "v.ckpt"
    ckptfmt.save({"n": 10**5000}, p)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfmt", "inspect", str(p)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_short_repr_never_raises():
    class Bad:
        def __repr__(self) -> str:
            raise RuntimeError("boom")

    deep: list = []
    for _ in range(5000):
        deep = [deep]
    for value in (10**5000, Bad(), deep, "x" * 10**6, {1: 10**5000}, (10**5000,)):
        text = render.short_repr(value, 80)
        assert len(text) <= 80
    assert render.short_repr(10**5000) == "<int of 4153 hex digits>"


# -- the prologue: which bytes decide what a file is ------------------------------------------


@pytest.mark.parametrize(
    "head, cls",
    [
        (b"", ckptfmt.IncompleteError),
        (b"\0" * 30, ckptfmt.IncompleteError),
        (b"\x89CKF", ckptfmt.IncompleteError),  # a prefix of the magic: a save that just began
        (b"\x89CKF\r\n\x1a\n\x01\x00", ckptfmt.IncompleteError),
        (b"hello", ckptfmt.UnsupportedError),
        (b"\x89CKF\r\n\x1a\n\x02\x00", ckptfmt.UnsupportedError),  # 2.x, shorter than a 1.x prologue
        (b"\x89CKF\r\n\x1a\n\x02\x00\x05\x00" + b"\xff" * 100, ckptfmt.UnsupportedError),  # bad checksum
    ],
)
def test_prologue_order_makes_other_major_versions_unsupported(tmp_path, head, cls):
    p = tmp_path / "f.ckpt"
    p.write_bytes(head)
    with pytest.raises(cls) as e:
        ckptfmt.load(p)
    if head[8:10] == b"\x02\x00":
        assert "format version 2." in str(e.value)

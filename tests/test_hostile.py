"""Hostile and damaged files: the right CheckpointError, in bounded time and memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptfmt
from ckptfmt.engine import native as _native
from ckptfmt.format import layout as fmt

CORPUS = os.path.join(os.path.dirname(__file__), "corpus")
EXPECTED = json.load(open(os.path.join(CORPUS, "expected.json")))

# Loads every corpus file in one process after capping its address space at what
# it uses now plus 512 MiB, and timing each load.
_RUNNER = r"""
import json, os, resource, sys, time
import ckptfmt
from ckptfmt import verify
# what a load imports (torch among it), before the cap: the cap bounds what a file costs
import torch
import ckptfmt.files.load, ckptfmt.files.reader
soft = 0
with open("/proc/self/statm") as f:
    vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
out = {}
for name in sys.argv[2:]:
    path = os.path.join(sys.argv[1], name)
    t = time.perf_counter()
    try:
        ckptfmt.load(path)
        got, where = "no error", None
    except BaseException as e:
        got = type(e).__name__
        where = [str(e), getattr(e, "chunk", None), getattr(e, "offset", None)]
    try:
        report = verify(path)
        ok, problems = report.ok, [str(p) for p in report.problems]
    except BaseException as e:  # verify reports problems; it must never raise on a file's bytes
        ok, problems = None, [f"verify raised {type(e).__name__}: {str(e)[:200]}"]
    out[name] = {
        "error": got,
        "where": where,
        "seconds": time.perf_counter() - t,
        "verify_ok": ok,
        "problems": problems,
    }
print(json.dumps(out))
"""


def _run_corpus(backend: str) -> dict:
    env = dict(os.environ, CKPTFMT_BACKEND=backend)
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, CORPUS, *sorted(EXPECTED)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def corpus_results():
    return _run_corpus("")  # the C engine when it is built


@pytest.fixture(scope="module")
def corpus_results_python():
    return _run_corpus("python")


def test_corpus_is_current():
    files = sorted(f for f in os.listdir(CORPUS) if f.endswith(".ckpt"))
    assert files == sorted(EXPECTED)
    assert len(files) >= 60


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_gives_expected_error(corpus_results, name):
    r = corpus_results[name]
    assert r["error"] == EXPECTED[name], f"{name}: {r}"
    assert r["verify_ok"] is False, f"{name}: {r}"
    assert r["seconds"] < 5.0, f"{name} took {r['seconds']:.1f}s"


@pytest.mark.skipif(not _native.built(), reason="the C engine is not built")
def test_both_engines_refuse_every_corpus_file_alike(corpus_results, corpus_results_python):
    """The C and the Python reader accept and reject exactly the same files, with the same
    error class, message, chunk and offset (zstd frames included: window, legacy, skippable,
    dictionary, content checksum), and verify reports the same problems."""
    differ = {
        name: (corpus_results[name], corpus_results_python[name])
        for name in EXPECTED
        if {k: v for k, v in corpus_results[name].items() if k != "seconds"}
        != {k: v for k, v in corpus_results_python[name].items() if k != "seconds"}
    }
    assert differ == {}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_python_engine(corpus_results_python, name):
    r = corpus_results_python[name]
    assert r["error"] == EXPECTED[name], f"{name}: {r}"
    assert r["verify_ok"] is False, f"{name}: {r}"
    assert r["seconds"] < 5.0, f"{name} took {r['seconds']:.1f}s"


def test_every_error_class_is_a_value_error():
    for cls in (ckptfmt.CorruptError, ckptfmt.IncompleteError, ckptfmt.UnsupportedError, ckptfmt.LimitError):
        assert issubclass(cls, ValueError) and issubclass(cls, ckptfmt.CheckpointError)


def _tiny(tmp_path) -> bytes:
    p = tmp_path / "tiny.ckpt"
    os.environ["CKPTFMT_FILE_ID"] = "00" * 16
    try:
        ckptfmt.save({"w": torch.tensor([1.0, 2.0]), "step": 7, "s": "x", "t": (None, b"\x01")}, p)
    finally:
        del os.environ["CKPTFMT_FILE_ID"]
    return p.read_bytes()


def test_every_bit_of_prologue_index_and_footer(tmp_path):
    """Exhaustive: flipping any one bit outside the chunk data is detected."""
    data = _tiny(tmp_path)
    with ckptfmt.open(tmp_path / "tiny.ckpt") as r:
        ioff = r._file.footer.index_offset
    regions = list(range(0, 64)) + list(range(ioff, len(data)))
    p = tmp_path / "f.ckpt"
    undetected = []
    for byte in regions:
        for bit in range(8):
            buf = bytearray(data)
            buf[byte] ^= 1 << bit
            p.write_bytes(buf)
            try:
                ckptfmt.load(p)
                undetected.append((byte, bit))
            except ckptfmt.CheckpointError:
                pass
    assert undetected == []
    assert len(regions) * 8 > 4000


def test_huge_string_is_a_limit_error(tmp_path, monkeypatch):
    p = tmp_path / "s.ckpt"
    ckptfmt.save({"s": "x" * 5000}, p)
    monkeypatch.setattr(fmt.Limits, "MAX_STRING_BYTES", 4096)
    with pytest.raises(ckptfmt.LimitError, match="longer than 4096"):
        ckptfmt.load(p)


def test_too_many_nodes_is_a_limit_error(tmp_path, monkeypatch):
    p = tmp_path / "n.ckpt"
    ckptfmt.save(list(range(100)), p)
    monkeypatch.setattr(fmt.Limits, "MAX_NODES", 50)
    with pytest.raises(ckptfmt.LimitError, match="nodes exceed"):
        ckptfmt.load(p)


def test_too_many_chunks_is_a_limit_error(tmp_path, monkeypatch):
    p = tmp_path / "c.ckpt"
    ckptfmt.save([torch.ones(1) for _ in range(10)], p)
    monkeypatch.setattr(fmt.Limits, "MAX_CHUNKS", 5)
    with pytest.raises(ckptfmt.LimitError, match="chunks exceed"):
        ckptfmt.load(p)


def test_file_shrinking_after_open_is_incomplete(tmp_path):
    p = tmp_path / "shrink.ckpt"
    ckptfmt.save({"w": torch.randn(10000)}, p)
    with ckptfmt.open(p) as r:
        os.truncate(p, 1000)
        with pytest.raises(ckptfmt.IncompleteError, match="shrank"):
            r.get("w")


def test_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises((ckptfmt.UnsupportedError, IsADirectoryError)):
        ckptfmt.load(tmp_path)

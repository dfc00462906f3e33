"""save(..., blocking=False): snapshot semantics, ordering, errors, and no leaks."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from helpers import assert_same, states
from hypothesis import HealthCheck, given, settings

import ckptfmt
from ckptfmt import background, writer
from ckptfmt.staging import POOL

BACKENDS = ["c", "python"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    elif ckptfmt.backend() != "c":
        pytest.skip("the C engine is not built")
    return request.param


@pytest.fixture(autouse=True)
def _no_leaks():
    threads = threading.active_count()
    fds = len(os.listdir("/proc/self/fd"))
    yield
    for h in list(background._in_flight.values()):
        h._done.wait(30)
    assert threading.active_count() == threads, "a writer thread outlived its save"
    assert len(os.listdir("/proc/self/fd")) <= fds, "a file descriptor leaked"
    assert POOL.free_bytes == POOL.allocated, "a staging slab was not returned"


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "model": {f"l{i}": torch.randn(256, 256, generator=g) for i in range(6)},
        "opt": {"step": torch.tensor(10.0), "m": torch.randn(1000, generator=g).bfloat16()},
        "n": 10,
    }


def test_mutations_after_return_do_not_reach_the_file(tmp_path, backend):
    state = _state()
    expected = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "opt": {k: v.clone() for k, v in state["opt"].items()},
        "n": 10,
    }
    h = ckptfmt.save(state, tmp_path / "a.ckpt", blocking=False, chunk_size=1 << 16)
    assert isinstance(h, ckptfmt.SaveHandle)
    for t in [*state["model"].values(), *state["opt"].values()]:
        t.fill_(-7)
    state["n"] = 11
    h.wait()
    assert h.done() and h.exception() is None
    assert_same(expected, ckptfmt.load(tmp_path / "a.ckpt"), check_sharing=False)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states(max_leaves=8))
def test_generated_states_nonblocking_equal_blocking(tmp_path, state):
    h = ckptfmt.save(state, tmp_path / "nb.ckpt", blocking=False, chunk_size=4096)
    h.wait()
    assert_same(state, ckptfmt.load(tmp_path / "nb.ckpt"))


def test_state_larger_than_staging_is_saved_in_pieces(tmp_path, backend):
    POOL.configure(limit=1 << 20, slab_bytes=256 << 10)
    try:
        state = _state()
        h = ckptfmt.save(state, tmp_path / "big.ckpt", blocking=False, chunk_size=1 << 16)
        h.wait()
        assert POOL.allocated <= 1 << 20
        assert_same(state, ckptfmt.load(tmp_path / "big.ckpt"), check_sharing=False)
    finally:
        POOL.configure(limit=8 << 30, slab_bytes=64 << 20)


def test_same_path_in_a_row_and_load_waits(tmp_path, backend):
    p = tmp_path / "x.ckpt"
    handles = [ckptfmt.save({"v": torch.full((200_000,), float(i))}, p, blocking=False) for i in range(5)]
    assert ckptfmt.load(p)["v"][0].item() == 4.0  # load waited for the last save
    for h in handles:
        h.wait()
    assert os.listdir(tmp_path) == ["x.ckpt"]


def test_many_saves_in_flight(tmp_path, backend):
    handles = [
        ckptfmt.save({"i": i, "t": torch.full((50_000,), float(i))}, tmp_path / f"{i}.ckpt", blocking=False)
        for i in range(12)
    ]
    for i, h in enumerate(handles):
        h.wait(timeout=60)
        assert ckptfmt.load(tmp_path / f"{i}.ckpt")["i"] == i
    ckptfmt.remove(tmp_path / "0.ckpt")
    assert not (tmp_path / "0.ckpt").exists()


def test_directory_that_disappears(tmp_path, backend, monkeypatch):
    d = tmp_path / "gone"
    d.mkdir()
    commit = writer.AtomicFile.commit

    def vanish_then_commit(self):  # the directory goes away between the writes and the rename
        shutil.rmtree(d)
        commit(self)

    monkeypatch.setattr(writer.AtomicFile, "commit", vanish_then_commit)
    h = ckptfmt.save({"t": torch.randn(1 << 20)}, d / "x.ckpt", blocking=False, chunk_size=1 << 16)
    exc = h.exception(timeout=60)
    assert isinstance(exc, OSError) and exc.errno == 2 and str(d) in exc.filename
    with pytest.raises(OSError):
        h.wait()


def test_creation_errors_are_raised_by_save_itself(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckptfmt.save({"a": 1}, tmp_path / "missing" / "x.ckpt", blocking=False)
    with pytest.raises(ckptfmt.UnsupportedObjectError):
        ckptfmt.save({"f": lambda: 1}, tmp_path / "x.ckpt", blocking=False)
    assert os.listdir(tmp_path) == []


def test_dropped_handle_error_is_raised_by_next_save(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    h = ckptfmt.save({"t": torch.randn(10)}, d / "x.ckpt", blocking=False)
    h._done.wait()
    # simulate a failure nobody waited for
    h._exc, h._observed = OSError(5, "Input/output error", str(d / "x.ckpt")), False
    background._unobserved.append(h)
    del h
    gc.collect()
    with pytest.raises(RuntimeError, match="never waited for") as info:
        ckptfmt.save({"a": 1}, tmp_path / "y.ckpt")
    assert isinstance(info.value.__cause__, OSError)
    ckptfmt.save({"a": 1}, tmp_path / "y.ckpt")  # reported once


_FSIZE_CHILD = r"""
import resource, sys, torch, ckptfmt
p = sys.argv[1]
ckptfmt.save({"v": torch.ones(10)}, p)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
h = ckptfmt.save({"v": torch.ones(1 << 20)}, p, blocking=False)
e = h.exception()
print("ERR", e.errno, e.filename)
"""


@pytest.mark.parametrize("force_python", [False, True])
def test_file_size_limit_error_keeps_previous_checkpoint(tmp_path, force_python):
    p = tmp_path / "x.ckpt"
    env = dict(os.environ, CKPTFMT_BACKEND="python" if force_python else "")
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(p)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.stdout.split() == ["ERR", "27", str(p)], out.stderr[-2000:]
    assert ckptfmt.load(p)["v"].shape == (10,)
    assert os.listdir(tmp_path) == ["x.ckpt"]


def test_exit_with_a_save_in_flight_finishes_it(tmp_path):
    p = tmp_path / "exit.ckpt"
    code = (
        "import sys, torch, ckptfmt\n"
        "ckptfmt.save({'t': torch.arange(4_000_000, dtype=torch.float32)}, sys.argv[1], blocking=False)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(p)], check=True, timeout=120)
    assert ckptfmt.verify(p).ok
    assert torch.equal(ckptfmt.load(p)["t"], torch.arange(4_000_000, dtype=torch.float32))


def test_staging_pool_is_reused(tmp_path, backend):
    state = _state()
    ckptfmt.save(state, tmp_path / "a", blocking=False).wait()
    before = POOL.allocated
    ckptfmt.save(state, tmp_path / "b", blocking=False).wait()
    assert POOL.allocated == before > 0

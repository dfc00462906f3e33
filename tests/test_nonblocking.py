"""save(..., blocking=False): snapshot semantics, ordering, errors, and no leaks."""

from __future__ import annotations

import errno
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
from ckptfmt.background import copysave as background
from ckptfmt.background import inflight
from ckptfmt.background.staging import POOL, StagingPool
from ckptfmt.engine import commit as commit_mod

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
    # the threads alive before: another test file's threads (a server's, a timer's) may end meanwhile
    threads = set(threading.enumerate())
    fds = len(os.listdir("/proc/self/fd"))
    yield
    for h in list(inflight._in_flight.values()):
        h._done.wait(30)
    for t in threading.enumerate():  # files a save replaced are freed after it is done
        if t.name == "ckptfmt-free-replaced" or t.name.startswith("ckptfmt-save-"):
            t.join(30)
    left = [t.name for t in threading.enumerate() if t not in threads]
    assert not left, f"a writer thread outlived its save: {left}"
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
    commit = commit_mod.AtomicFile.commit

    def vanish_then_commit(self, **kwargs):  # the directory goes away between the writes and the rename
        shutil.rmtree(d)
        commit(self, **kwargs)

    monkeypatch.setattr(commit_mod.AtomicFile, "commit", vanish_then_commit)
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
    inflight._unobserved.append(h)
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


# -- failures part-way through a non-blocking save leave nothing behind ------------------------


def _pool_settled() -> None:
    assert POOL.free_bytes == POOL.allocated, "a staging slab was not returned"


def test_thread_that_fails_to_start_leaves_nothing_in_flight(tmp_path, monkeypatch):
    def cannot_start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    p = tmp_path / "x.ckpt"
    with pytest.raises(RuntimeError, match="can't start new thread"):
        ckptfmt.save(_state(), p, blocking=False)
    monkeypatch.undo()
    assert not inflight._in_flight, "the path stays marked in flight: every later save of it hangs"
    assert os.listdir(tmp_path) == [], "the temp file leaked"
    ckptfmt.save({"a": 1}, p)  # waits for nothing
    assert ckptfmt.load(p) == {"a": 1}
    _pool_settled()


@pytest.mark.parametrize("fail_at", [1, 3, 8])
def test_exception_mid_snapshot_returns_every_slab(tmp_path, monkeypatch, backend, fail_at):
    POOL.configure(limit=1 << 20, slab_bytes=256 << 10)  # several slabs: some handed over, one open
    real = background._host_bytes
    calls: list[int] = []

    def failing_host_bytes(src: object) -> object:
        calls.append(1)
        if len(calls) == fail_at:
            raise MemoryError("injected mid-snapshot")
        return real(src)

    monkeypatch.setattr(background, "_host_bytes", failing_host_bytes)
    p = tmp_path / "x.ckpt"
    try:
        with pytest.raises(MemoryError, match="injected"):
            ckptfmt.save(_state(), p, blocking=False, chunk_size=1 << 16)
        assert len(calls) == fail_at
        assert not inflight._in_flight
        assert os.listdir(tmp_path) == []
        _pool_settled()
        monkeypatch.undo()
        ckptfmt.save(_state(), p, blocking=False, chunk_size=1 << 16).wait()  # the pool still works
        assert ckptfmt.verify(p).ok
        _pool_settled()
    finally:
        POOL.configure(limit=8 << 30, slab_bytes=64 << 20)


class _FinishesBetweenChecks(inflight.SaveHandle):
    """A failed save whose thread finishes between two of raise_unobserved's looks at it."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        if self.looks == 2:
            self._finish(OSError(errno.EIO, "Input/output error", self.path))
        return super().done()


def test_an_error_that_lands_between_two_checks_is_not_dropped(tmp_path):
    h = _FinishesBetweenChecks(str(tmp_path / "x.ckpt"))
    inflight._unobserved.append(h)
    raised = []
    for i in range(3):
        try:
            ckptfmt.save({"i": i}, tmp_path / "y.ckpt")
        except RuntimeError as e:
            raised.append(e)
    assert len(raised) == 1 and isinstance(raised[0].__cause__, OSError)
    assert h not in inflight._unobserved


# -- staging accelerator storages (simulated: no accelerator here) ---------------------------------


class _TestPool(StagingPool):
    """A staging pool whose "pinned" slabs are ordinary memory, counting what it allocates."""

    def __init__(self, limit: int, slab_bytes: int) -> None:
        super().__init__(limit, slab_bytes)
        self.pinned_ptrs: set[int] = set()
        self.allocations: list[bool] = []

    def _allocate(self, size: int, pinned: bool) -> torch.Tensor:
        t = torch.empty(size, dtype=torch.uint8)
        self.allocations.append(pinned)
        if pinned:
            self.pinned_ptrs.add(t.data_ptr())
        return t

    def _is_pinned(self, slab: torch.Tensor) -> bool:
        return slab.data_ptr() in self.pinned_ptrs


class _Fence:
    def __init__(self) -> None:
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True


class _FakeAccelerator:
    """Tensors given to `on_device` are staged as an accelerator's would be: into pinned slabs,
    copied with non_blocking=True, each copy fenced by an event."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pool: _TestPool) -> None:
        self.ptrs: set[int] = set()
        self.fences: list[_Fence] = []
        self.copies = 0
        real_host_bytes = background._host_bytes
        real_copy = background._copy_into_slab

        def host_bytes(src: object) -> object:
            if isinstance(src, torch.UntypedStorage) and src.data_ptr() in self.ptrs:
                return None
            return real_host_bytes(src)

        def copy(*args: object) -> None:
            self.copies += 1
            real_copy(*args)

        def fence(device: torch.device) -> _Fence:
            self.fences.append(_Fence())
            return self.fences[-1]

        monkeypatch.setattr(background, "_host_bytes", host_bytes)
        monkeypatch.setattr(background, "_copy_into_slab", copy)
        monkeypatch.setattr(background, "_accelerator_type", lambda: "cpu")
        monkeypatch.setattr(background, "_fence", fence)
        monkeypatch.setattr(background, "POOL", pool)

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        self.ptrs.add(t.untyped_storage().data_ptr())
        return t


def _adamw_like(acc: _FakeAccelerator, params: int = 8, n: int = 20_000) -> dict[str, object]:
    """AdamW's layout: a CPU `step` tensor between the two moments on the device, per parameter."""
    g = torch.Generator().manual_seed(7)
    return {
        "state": {
            i: {
                "step": torch.tensor(float(i + 1)),
                "exp_avg": acc.on_device(torch.randn(n, generator=g)),
                "exp_avg_sq": acc.on_device(torch.rand(n, generator=g)),
            }
            for i in range(params)
        },
        "lr": 1e-3,
    }


def test_alternating_host_and_device_storages_keep_one_slab_of_each_kind(tmp_path, monkeypatch, backend):
    pool = _TestPool(limit=8 << 20, slab_bytes=1 << 20)
    acc = _FakeAccelerator(monkeypatch, pool)
    state = _adamw_like(acc, params=8, n=10_000)  # 640 KB of moments, 8 steps: one slab of each
    h = ckptfmt.save(state, tmp_path / "x.ckpt", blocking=False, chunk_size=1 << 16)
    h.wait(timeout=60)
    assert sorted(pool.allocations) == [False, True], "a slab was handed over at each change of kind"
    assert acc.copies == 16 and acc.fences[-1].synchronized
    assert pool.in_use == 0
    assert_same(state, ckptfmt.load(tmp_path / "x.ckpt"), check_sharing=False)


@pytest.mark.parametrize("slabs", [1, 2, 3])
def test_tight_pool_with_both_kinds_neither_deadlocks_nor_reorders(tmp_path, monkeypatch, slabs):
    """With room for fewer slabs than there are kinds, the open slab of the other kind is handed
    to the writer when the pool is full, and the chunks still reach the file in order."""
    pool = _TestPool(limit=slabs << 16, slab_bytes=1 << 16)
    acc = _FakeAccelerator(monkeypatch, pool)
    state = _adamw_like(acc, params=6, n=30_000)  # 120 KB moments: two chunks and a bit
    state["big_host"] = torch.arange(100_000, dtype=torch.float64)
    state["big_device"] = acc.on_device(torch.arange(70_000, dtype=torch.float32))
    h = ckptfmt.save(state, tmp_path / "x.ckpt", blocking=False, chunk_size=1 << 14)
    h.wait(timeout=120)
    assert pool.in_use == 0 and pool.allocated <= max(slabs, 1) << 16
    assert acc.fences[-1].synchronized  # fences on one stream: the newest covers the others
    assert_same(state, ckptfmt.load(tmp_path / "x.ckpt"), check_sharing=False)


@pytest.mark.parametrize("fail_at", [1, 4, 11])
def test_device_copy_failing_mid_snapshot_returns_every_slab(tmp_path, monkeypatch, fail_at):
    pool = _TestPool(limit=4 << 16, slab_bytes=1 << 16)
    acc = _FakeAccelerator(monkeypatch, pool)
    state = _adamw_like(acc, params=8, n=10_000)
    copy = background._copy_into_slab

    def failing_copy(*args: object) -> None:
        if acc.copies + 1 == fail_at:
            raise RuntimeError("injected: device copy failed")
        copy(*args)

    monkeypatch.setattr(background, "_copy_into_slab", failing_copy)
    with pytest.raises(RuntimeError, match="injected"):
        ckptfmt.save(state, tmp_path / "x.ckpt", blocking=False, chunk_size=1 << 14)
    assert pool.in_use == 0, "a staging slab was not returned"
    # fences on one stream: the newest covers the copies before it
    assert not acc.fences or acc.fences[-1].synchronized, "a slab went back while a copy could still run"
    assert not inflight._in_flight and os.listdir(tmp_path) == []


def test_fence_is_recorded_on_the_source_devices_stream(monkeypatch):
    """A copy from device 1 while device 0 is current runs on device 1's stream: the event
    must be recorded there, not on the current device's stream."""
    asked: list[object] = []

    class Stream:
        def __init__(self, device: object) -> None:
            self.device = device

        def record_event(self) -> tuple[str, object]:
            return ("recorded on", self.device)

    def current_stream(device: object = None) -> Stream:
        asked.append(device)
        return Stream(device)

    monkeypatch.setattr(torch.accelerator, "current_stream", current_stream)
    dev = torch.device("cuda", 1)
    assert background._fence(dev) == ("recorded on", dev)
    assert asked == [dev]


def _accelerator_devices() -> list[int]:
    if not torch.accelerator.is_available():
        return []
    n = torch.accelerator.device_count()
    return sorted({0, n - 1})


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
@pytest.mark.parametrize("index", _accelerator_devices() or [0])
def test_device_copies_are_fenced_on_the_source_device(tmp_path, index):
    """The source tensor is produced at the end of a long queue of kernels on its device, which
    is not the current one when index > 0: the file holds its final bytes all the same."""
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    src = torch.device(acc.type, index)
    torch.accelerator.set_device_index(0)
    g = torch.Generator(device=src).manual_seed(1)
    busy = torch.randn(2048, 2048, device=src, generator=g)
    for _ in range(200):  # tens of milliseconds of work queued on the source device's stream
        busy = torch.tanh(busy @ busy / 45.0)
    state = {"y": busy.flatten()[: 1 << 20].clone(), "host": torch.arange(10)}
    h = ckptfmt.save(state, tmp_path / "x.ckpt", blocking=False)
    h.wait(timeout=120)
    assert torch.equal(ckptfmt.load(tmp_path / "x.ckpt")["y"], state["y"].cpu())


def test_an_interrupt_in_a_copy_saves_thread_start_leaves_no_writer_waiting(tmp_path, monkeypatch):
    """An interrupt in Thread.start() after the writer thread began: the writer must end the
    save (failed) rather than wait forever for a snapshot no one will give it (a non-daemon
    thread the interpreter's exit would wait for)."""
    import time

    start = threading.Thread.start

    def interrupted_start(self):  # type: ignore[no-untyped-def]
        start(self)
        if self.name.startswith("ckptfmt-save-"):
            raise KeyboardInterrupt

    path = str(tmp_path / "s.ckpt")
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        ckptfmt.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, path, blocking=False)
    monkeypatch.setattr(threading.Thread, "start", start)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        t.name.startswith("ckptfmt-save-") and t.is_alive() for t in threading.enumerate()
    ):
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckptfmt-save-") and t.is_alive()]
    inflight.wait_for_path(path)  # ended: its failure is reported, not raised here
    assert os.listdir(tmp_path) == []  # nothing committed, no temp file left
    with pytest.raises(RuntimeError, match="never waited for") as caught:  # the save's outcome
        inflight.raise_unobserved()
    assert isinstance(caught.value.__cause__, KeyboardInterrupt)

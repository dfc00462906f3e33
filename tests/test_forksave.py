"""save(..., blocking=False, snapshot="fork"): a copy-on-write snapshot written by a child process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import functools
import os
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from helpers import assert_same, states
from hypothesis import HealthCheck, given, settings

import ckptfmt
from ckptfmt.background import forksave, inflight
from ckptfmt.engine import native as _native
from ckptfmt.errors import CheckpointError, SnapshotError, UnsupportedError

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ckptfmt.backend() != "c",
    reason="fork snapshots need Linux and the C engine",
)


def _children() -> set[int]:
    """This process's child processes, zombies included."""
    out: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                out.update(int(p) for p in f.read().split())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(autouse=True)
def forked():
    """The handles of the fork snapshots a test took; after it, no thread, descriptor or child left."""
    # the threads alive before: another test file's threads (a server's, a timer's) may end meanwhile
    threads = set(threading.enumerate())
    fds = len(os.listdir("/proc/self/fd"))
    children = _children()
    handles: list[ckptfmt.SaveHandle] = []
    real = forksave.save_forked

    def tracked(*args, **kwargs):
        h = real(*args, **kwargs)
        handles.append(h)
        return h

    forksave.save_forked = tracked
    try:
        yield handles
    finally:
        forksave.save_forked = real
        for h in handles:  # a child that hangs fails the test instead of hanging the run
            if h._pid is not None and not h._done.wait(60):
                os.kill(h._pid, signal.SIGKILL)
    for t in threading.enumerate():
        # a manager's commit thread or an upload pool's worker may still be returning after
        # the handle said done: each is given time to end, and must end
        if t.name.startswith("ckptfmt-") and t is not threading.current_thread():
            t.join(30)
    left = [t.name for t in threading.enumerate() if t not in threads]
    assert not left, f"a waiter thread outlived its save: {left}"
    assert len(os.listdir("/proc/self/fd")) <= fds, "a file descriptor leaked"
    for h in handles:
        assert h._pid is not None and _gone(h._pid), "a child was not reaped"
    assert _children() <= children, "a child process was left behind"


def _state(seed: int = 3) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"l{i}": torch.randn(256, 256, generator=g) for i in range(6)},
        "opt": {"step": torch.tensor(10.0), "m": torch.randn(1000, generator=g).bfloat16()},
        "arr": np.arange(1000, dtype=np.int64),
        "n": 10,
    }


def _copy(state: dict[str, object]) -> dict[str, object]:
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},  # type: ignore[attr-defined]
        "opt": {k: v.clone() for k, v in state["opt"].items()},  # type: ignore[attr-defined]
        "arr": state["arr"].copy(),  # type: ignore[attr-defined]
        "n": state["n"],
    }


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_changes_after_return_do_not_reach_the_file(tmp_path, monkeypatch, compression):
    monkeypatch.setattr(_native, "fork_write", functools.partial(_native.fork_write, _fault=3))
    state = _state()  # the child sleeps before it reads: every change below comes first
    expected = _copy(state)
    h = ckptfmt.save(
        state,
        tmp_path / "a.ckpt",
        blocking=False,
        snapshot="fork",
        chunk_size=1 << 16,
        compression=compression,
    )
    assert h.snapshot == "fork"
    for t in [*state["model"].values(), *state["opt"].values()]:  # type: ignore[attr-defined]
        t.fill_(-7)
    state["arr"][:] = -1  # type: ignore[index]
    h.wait()
    assert ckptfmt.verify(tmp_path / "a.ckpt").ok
    assert_same(expected, ckptfmt.load(tmp_path / "a.ckpt"), check_sharing=False)


def test_copy_stays_the_default(tmp_path):
    h = ckptfmt.save(_state(), tmp_path / "a.ckpt", blocking=False)
    h.wait()
    assert h.snapshot == "copy" and h._pid is None


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states(max_leaves=8))
def test_generated_states_round_trip(tmp_path, state):
    ckptfmt.save(state, tmp_path / "f.ckpt", blocking=False, snapshot="fork", chunk_size=4096).wait()
    assert_same(state, ckptfmt.load(tmp_path / "f.ckpt"))


def test_what_fork_cannot_snapshot_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    shared = torch.zeros(1000)
    shared.share_memory_()
    with pytest.raises(ValueError, match="shared with other processes"):
        ckptfmt.save({"s": shared}, tmp_path / "a.ckpt", blocking=False, snapshot="fork")
    mapped = torch.from_numpy(np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4096,)))
    with pytest.raises(ValueError, match="in a shared mapping"):
        ckptfmt.save({"m": mapped}, tmp_path / "a.ckpt", blocking=False, snapshot="fork")
    del mapped
    with pytest.raises(ValueError, match="snapshot must be"):
        ckptfmt.save({"a": 1}, tmp_path / "a.ckpt", blocking=False, snapshot="cow")
    monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    with pytest.raises(ValueError, match="C engine"):
        ckptfmt.save({"a": torch.ones(3)}, tmp_path / "a.ckpt", blocking=False, snapshot="fork")
    assert sorted(os.listdir(tmp_path)) == ["m.bin"]


def test_a_private_file_mapping_is_snapshotted(tmp_path):
    path = tmp_path / "w.bin"
    torch.save(torch.arange(50_000, dtype=torch.float32), path)
    mapped = torch.load(path, mmap=True)  # MAP_PRIVATE: writes stay in this process
    h = ckptfmt.save({"w": mapped}, tmp_path / "a.ckpt", blocking=False, snapshot="fork")
    mapped.fill_(0)
    h.wait()
    assert torch.equal(ckptfmt.load(tmp_path / "a.ckpt")["w"], torch.arange(50_000, dtype=torch.float32))


@pytest.mark.parametrize(("fault", "how"), [(1, "killed by signal 9 (SIGKILL)"), (2, "exited with status 3")])
def test_a_child_that_dies_fails_the_save_and_keeps_the_previous_file(tmp_path, monkeypatch, fault, how):
    p = tmp_path / "x.ckpt"
    ckptfmt.save({"v": torch.ones(10)}, p)
    monkeypatch.setattr(_native, "fork_write", functools.partial(_native.fork_write, _fault=fault))
    h = ckptfmt.save({"v": torch.zeros(100_000)}, p, blocking=False, snapshot="fork")
    exc = h.exception(timeout=60)
    assert isinstance(exc, SnapshotError) and how in str(exc) and str(p) in str(exc)
    assert torch.equal(ckptfmt.load(p)["v"], torch.ones(10))
    assert os.listdir(tmp_path) == ["x.ckpt"]


def test_fork_failing_is_an_error_that_leaves_nothing(tmp_path, monkeypatch):
    def no_fork(*args, **kwargs):
        raise OSError(errno.ENOMEM, "fork failed: Cannot allocate memory")

    monkeypatch.setattr(_native, "fork_write", no_fork)
    with pytest.raises(OSError, match="cannot take a fork snapshot") as info:
        ckptfmt.save({"v": torch.ones(10)}, tmp_path / "x.ckpt", blocking=False, snapshot="fork")
    assert info.value.errno == errno.ENOMEM and info.value.filename == str(tmp_path / "x.ckpt")
    assert os.listdir(tmp_path) == []
    assert not inflight._in_flight


def test_no_descriptors_left_is_an_error_that_leaves_nothing(tmp_path, monkeypatch):
    pipes = []
    real = os.pipe

    def second_pipe_fails() -> tuple[int, int]:
        if pipes:
            raise OSError(errno.EMFILE, "Too many open files")
        pipes.append(real())
        return pipes[-1]

    monkeypatch.setattr(forksave.os, "pipe", second_pipe_fails)
    with pytest.raises(OSError, match="cannot take a fork snapshot") as info:
        ckptfmt.save({"v": torch.ones(10)}, tmp_path / "x.ckpt", blocking=False, snapshot="fork")
    assert info.value.errno == errno.EMFILE and info.value.filename == str(tmp_path / "x.ckpt")
    assert os.listdir(tmp_path) == []
    assert not inflight._in_flight


def test_an_interrupt_after_the_fork_stops_and_reaps_the_child(tmp_path, monkeypatch):
    started = []
    real = _native.fork_write

    def remember(*args, **kwargs):
        child = real(*args, **kwargs, _fault=4)  # it would sleep 30 s
        started.append(child.pid)
        return child

    def interrupted(self: threading.Thread) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_native, "fork_write", remember)
    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckptfmt.save({"v": torch.ones(10)}, tmp_path / "x.ckpt", blocking=False, snapshot="fork")
    assert started and _gone(started[0])  # killed and reaped: not even a zombie
    assert os.listdir(tmp_path) == []
    assert not inflight._in_flight


def test_the_child_keeps_no_other_descriptor_and_ignores_job_signals(tmp_path, monkeypatch):
    monkeypatch.setattr(_native, "fork_write", functools.partial(_native.fork_write, _fault=3))
    r, w = os.pipe()
    try:
        h = ckptfmt.save({"v": torch.arange(1000)}, tmp_path / "x.ckpt", blocking=False, snapshot="fork")
        assert h._pid is not None
        deadline = time.monotonic() + 1.5  # the child sleeps 2 s once it has closed what it does not need
        while True:
            held = {int(fd) for fd in os.listdir(f"/proc/{h._pid}/fd")}
            if len(held - {0, 1, 2}) <= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        os.kill(h._pid, signal.SIGTERM)  # a scheduler's TERM to the job is the parent's to act on
        os.kill(h._pid, signal.SIGINT)
    finally:
        os.close(r)
        os.close(w)
    assert r not in held and w not in held
    assert len(held - {0, 1, 2}) == 3  # the temp file, the pipe to say it is done, the one to watch us
    h.wait(timeout=60)
    assert torch.equal(ckptfmt.load(tmp_path / "x.ckpt")["v"], torch.arange(1000))


def test_a_fork_while_another_thread_holds_the_engine_cache_lock_does_not_hang_the_child(tmp_path):
    """The child's writer takes the cache's lock (compressed saves do): a fork while another
    thread holds it must not leave it held in the child (cache.c's at-fork handlers)."""
    holder = threading.Thread(target=_native.lib.ckf_test_hold_cache, args=(500,))
    holder.start()
    try:
        time.sleep(0.1)  # the lock is held now
        state = {"v": torch.randn(1 << 16)}
        h = ckptfmt.save(state, tmp_path / "x.ckpt", blocking=False, snapshot="fork", compression="zstd")
        h.wait(60)
    finally:
        holder.join()
    assert torch.equal(ckptfmt.load(tmp_path / "x.ckpt")["v"], state["v"])


_CHILD = r"""
import resource, signal, sys, torch, ckptfmt
from ckptfmt.engine import native as _native
import functools
p, case = sys.argv[1], sys.argv[2]
if case == "fsize":
    ckptfmt.save({"v": torch.ones(10)}, p)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    e = ckptfmt.save({"v": torch.ones(1 << 20)}, p, blocking=False, snapshot="fork").exception()
    print("ERR", e.errno, e.filename)
elif case == "sigchld-ignored":
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    ckptfmt.save({"v": torch.arange(10)}, p, blocking=False, snapshot="fork").wait()
    _native.fork_write = functools.partial(_native.fork_write, _fault=1)
    e = ckptfmt.save({"v": torch.zeros(10)}, p, blocking=False, snapshot="fork").exception()
    print("OK", type(e).__name__, ckptfmt.load(p)["v"].tolist() == list(range(10)))
elif case == "parent-dies":
    import os
    _native.fork_write = functools.partial(_native.fork_write, _fault=4)  # the child would sleep 30 s
    h = ckptfmt.save({"v": torch.arange(10)}, p, blocking=False, snapshot="fork")
    print(h._pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
elif case == "exit":
    ckptfmt.save({"t": torch.arange(4_000_000, dtype=torch.float32)}, p, blocking=False, snapshot="fork")
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=120)


def test_file_size_limit_in_the_child_is_an_oserror_naming_the_file(tmp_path):
    p = tmp_path / "x.ckpt"
    out = _run(str(p), "fsize")
    assert out.stdout.split() == ["ERR", "27", str(p)], out.stderr[-2000:]
    assert ckptfmt.load(p)["v"].shape == (10,)
    assert os.listdir(tmp_path) == ["x.ckpt"]


def test_sigchld_ignored_still_finishes_and_still_reports_a_dead_child(tmp_path):
    out = _run(str(tmp_path / "x.ckpt"), "sigchld-ignored")
    assert out.stdout.split() == ["OK", "SnapshotError", "True"], out.stderr[-2000:]


def test_exit_with_a_fork_save_in_flight_finishes_it(tmp_path):
    p = tmp_path / "exit.ckpt"
    out = _run(str(p), "exit")
    assert out.returncode == 0, out.stderr[-2000:]
    assert ckptfmt.verify(p).ok
    assert torch.equal(ckptfmt.load(p)["t"], torch.arange(4_000_000, dtype=torch.float32))


def test_a_manager_takes_fork_snapshots_when_asked(tmp_path, forked):
    with pytest.raises(ValueError, match="snapshot must be"):
        ckptfmt.CheckpointManager(tmp_path / "i", snapshot="cow")
    mgr = ckptfmt.CheckpointManager(tmp_path / "run", blocking=False, snapshot="fork", keep_last=2)
    model = torch.nn.Linear(64, 64)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    h = mgr.save(1, {"model": model})
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    assert h is not None
    h.wait(60)
    mgr.wait()
    assert [f.snapshot for f in forked] == ["fork"]
    got = mgr.load()["model"]
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (its parent died; init may not reap in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_child_ends_when_its_parent_dies_and_holds_none_of_its_output(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path / "x.ckpt"), "parent-dies"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    ready, _, _ = select.select([proc.stdout], [], [], 20)  # end-of-file: nobody holds it now
    assert ready and proc.stdout.read() == b"", "the child kept the parent's stdout"
    proc.wait(20)
    proc.stdout.close()
    assert proc.stderr is not None
    proc.stderr.close()
    deadline = time.monotonic() + 20  # it would sleep 30 s if it did not watch its parent
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(pid)
    assert not (tmp_path / "x.ckpt").exists()


def test_a_dead_child_is_noticed_even_while_another_process_holds_its_pipe(tmp_path, monkeypatch):
    """A process forked elsewhere in the moment the pipe's write end was open keeps it
    open: the child's death then shows through waitpid, not end-of-file."""
    held: list[int] = []
    real = _native.fork_write

    def keep_a_write_end(*args, **kwargs):
        held.append(os.dup(args[7]))  # ready_fd, as another fork would inherit it
        return real(*args, **kwargs, _fault=1)

    monkeypatch.setattr(_native, "fork_write", keep_a_write_end)
    try:
        h = ckptfmt.save({"v": torch.ones(10)}, tmp_path / "x.ckpt", blocking=False, snapshot="fork")
        exc = h.exception(timeout=60)
    finally:
        for fd in held:
            os.close(fd)
    assert isinstance(exc, SnapshotError) and "killed by signal 9" in str(exc)


def test_an_interrupt_right_after_fork_returns_stops_and_reaps_the_child(tmp_path, monkeypatch):
    """fork() runs with signals blocked: a ^C pressed meanwhile is raised as soon as it
    returns, before save_forked holds the child."""
    real = _native._release
    raised = []

    def interrupted_once(bufs: list[object]) -> None:
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt
        real(bufs)

    monkeypatch.setattr(_native, "_release", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        ckptfmt.save({"v": torch.ones(10)}, tmp_path / "x.ckpt", blocking=False, snapshot="fork")
    assert raised and os.listdir(tmp_path) == []
    assert not inflight._in_flight


def test_an_interrupt_in_thread_start_cleans_up_once(tmp_path, monkeypatch):
    """An interrupt can land in Thread.start() after the waiter thread began: either the
    waiter finishes the save or the failing call cleans up, never both."""
    real = threading.Thread.start

    def started_then_interrupted(self: threading.Thread) -> None:
        real(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", started_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckptfmt.save({"v": torch.arange(10)}, tmp_path / "x.ckpt", blocking=False, snapshot="fork")
    monkeypatch.undo()
    for t in threading.enumerate():
        if t.name.startswith("ckptfmt-save-"):
            t.join(60)
    names = os.listdir(tmp_path)
    assert names in ([], ["x.ckpt"])  # no temp file either way
    if names:
        assert torch.equal(ckptfmt.load(tmp_path / "x.ckpt")["v"], torch.arange(10))
    assert not inflight._in_flight


# -- incremental fork saves: the child finds the chunks the base holds and writes the rest ---


def _layout(path: object, key: bytes | None) -> tuple[list[tuple[int, int, bytes]], list[str]]:
    """Each chunk's (file it lies in, number there, digest), and the files it refers to."""
    from ckptfmt.files.reader import CheckpointFile

    with CheckpointFile(str(path), decrypt_with=key) as f:
        names = [os.path.basename(e.path) for e in f.externals]
        return [(ch.source, ch.number, ch.digest) for ch in f.chunks], names


@pytest.mark.parametrize(
    "compression, key", [(None, None), ("zstd", bytes(range(32)))], ids=["raw", "zstd-encrypted"]
)
def test_an_incremental_fork_save_writes_only_what_the_base_does_not_hold(
    tmp_path, monkeypatch, compression, key
):
    """A chain of three saves: 0 whole, 1 against 0 (copy snapshot), 2 against 1 by fork. The
    child finds the chunks 0 and 1 hold, writes only the changed ones, and the file refers to
    where each lies exactly as a copy snapshot's save of the same state does; changes made
    after the fork do not reach it."""
    from ckptfmt.files import incremental

    kw = {"compression": compression, "encrypt_with": key, "chunk_size": 1 << 16}
    state = _state()
    incremental.save(state, tmp_path / "0.ckpt", **kw)
    state["model"]["l0"].add_(1)  # type: ignore[index]
    incremental.save(state, tmp_path / "1.ckpt", base=tmp_path / "0.ckpt", **kw)
    state["model"]["l1"].add_(1)  # type: ignore[index]
    expected = _copy(state)
    monkeypatch.setattr(_native, "fork_write", functools.partial(_native.fork_write, _fault=3))
    h = incremental.save(
        state, tmp_path / "2.ckpt", base=tmp_path / "1.ckpt", blocking=False, snapshot="fork", **kw
    )
    assert h is not None and h.snapshot == "fork"
    for t in state["model"].values():  # type: ignore[attr-defined]
        t.fill_(-7)  # the child sleeps before it reads: these changes come first
    h.wait()
    monkeypatch.undo()
    incremental.save(expected, tmp_path / "c.ckpt", base=tmp_path / "1.ckpt", blocking=False, **kw).wait()
    assert _layout(tmp_path / "2.ckpt", key) == _layout(tmp_path / "c.ckpt", key)
    chunks, files = _layout(tmp_path / "2.ckpt", key)
    assert sorted(files) == ["0.ckpt", "1.ckpt"]
    assert sum(source < 0 for source, _, _ in chunks) == 4  # l1's 256 KiB: all it wrote
    assert os.path.getsize(tmp_path / "2.ckpt") < os.path.getsize(tmp_path / "0.ckpt") // 4
    assert ckptfmt.verify(tmp_path / "2.ckpt", decrypt_with=key).ok
    assert_same(expected, ckptfmt.load(tmp_path / "2.ckpt", decrypt_with=key), check_sharing=False)


def test_an_incremental_fork_save_without_a_usable_base_writes_every_chunk_with_digests(tmp_path):
    from ckptfmt.files import incremental

    state = _state()
    h = incremental.save(state, tmp_path / "0.ckpt", blocking=False, snapshot="fork", chunk_size=1 << 16)
    assert h is not None
    h.wait()
    chunks, files = _layout(tmp_path / "0.ckpt", None)
    assert files == [] and all(source < 0 and len(digest) == 16 for source, _, digest in chunks)
    # the digests the child took are those a later save matches against
    state["model"]["l2"].add_(1)  # type: ignore[index]
    incremental.save(state, tmp_path / "1.ckpt", base=tmp_path / "0.ckpt", chunk_size=1 << 16)
    assert sum(source < 0 for source, _, _ in _layout(tmp_path / "1.ckpt", None)[0]) == 4


def test_a_signed_fork_save_is_signed_by_the_child(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    state = _state()
    for compression in (None, "zstd"):
        p = tmp_path / f"{compression}.ckpt"
        ckptfmt.save(state, p, sign_with=key, blocking=False, snapshot="fork", compression=compression).wait()
        assert ckptfmt.verify(p, trusted_keys=[key.public_key()]).ok
        assert_same(state, ckptfmt.load(p, trusted_keys=[key.public_key()]), check_sharing=False)


# -- fork saves to an object store: the child writes the spool, this process uploads it ------


@pytest.mark.parametrize("key", [None, bytes(range(32))], ids=["clear", "encrypted"])
def test_a_fork_save_to_a_store_is_uploaded_once_the_child_is_done(s3_bucket, monkeypatch, key):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/a.ckpt"
    state = _state()
    expected = _copy(state)
    monkeypatch.setattr(_native, "fork_write", functools.partial(_native.fork_write, _fault=3))
    h = ckptfmt.save(
        state,
        url,
        blocking=False,
        snapshot="fork",
        encrypt_with=key,
        storage_options=options,
        chunk_size=1 << 16,
    )
    assert h.snapshot == "fork"
    for t in state["model"].values():  # type: ignore[attr-defined]
        t.fill_(-7)
    h.wait()
    assert h.version is not None  # the ETag of what this save uploaded
    assert ckptfmt.verify(url, decrypt_with=key, storage_options=options).ok
    assert_same(expected, ckptfmt.load(url, decrypt_with=key, storage_options=options), check_sharing=False)


def test_a_fork_save_to_a_store_whose_child_dies_uploads_nothing(s3_server, s3_bucket, monkeypatch):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/dead.ckpt"
    monkeypatch.setattr(_native, "fork_write", functools.partial(_native.fork_write, _fault=1))
    h = ckptfmt.save(_state(), url, blocking=False, snapshot="fork", storage_options=options)
    with pytest.raises(SnapshotError, match="was killed by signal 9"):
        h.wait()
    s3 = s3_server.client()
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket)
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.mark.parametrize("where, snapshot", [("local", "fork"), ("store", "fork"), ("store", "copy")])
def test_an_incremental_run_keeps_what_later_steps_refer_to(tmp_path, s3_bucket, forked, where, snapshot):
    """keep_last=1 over three non-blocking steps that change one layer each: the newest step
    refers to the first two's files, which rotation keeps (on a store, each save waits for
    the one in flight to commit and rotate before it picks its base: else that rotation
    deletes what it refers to); a fresh manager resumes it bit for bit."""
    bucket, options = s3_bucket
    run = str(tmp_path / "run") if where == "local" else f"s3://{bucket}/run"
    kw = {"storage_options": options} if where == "store" else {}
    mgr = ckptfmt.CheckpointManager(
        run, blocking=False, snapshot=snapshot, incremental=True, keep_last=1, **kw
    )
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3)))
    for step in range(3):
        with torch.no_grad():
            model[step].weight.add_(1)
        mgr.save(step, {"model": model})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)  # after the last snapshot: not in the checkpoint
    mgr.wait()
    assert [f.snapshot for f in forked] == ["fork"] * 3 * (snapshot == "fork")
    fresh = ckptfmt.CheckpointManager(run, incremental=True, **kw)
    assert [c.step for c in fresh.checkpoints()] == [2]
    assert fresh.verify().ok
    got = fresh.load()["model"]
    assert all(torch.equal(got[k], v) for k, v in expected.items())


# -- a snapshot taken before the save is planned (DCP's stager): the child waits for its job --


def _sources(state: dict[str, object]) -> list[tuple[str, object]]:
    tensors = [*state["model"].values(), *state["opt"].values()]  # type: ignore[attr-defined]
    return [(f"t{i}", t.untyped_storage()) for i, t in enumerate(tensors)] + [("arr", state["arr"])]


def _save_staged(
    state: object, path: object, snapshot: forksave.ForkSnapshot, **kw: object
) -> ckptfmt.SaveHandle:
    """Save `state` with its chunks written by the child of `snapshot`: ckptfmt's own save path,
    the one the DCP writer takes (the public snapshot= takes only "copy" and "fork")."""
    from ckptfmt.files.save import save_file, save_options, staged_by

    return save_file(state, str(path), staged_by(save_options(**kw), snapshot))  # type: ignore[arg-type]


def _change(state: dict[str, object]) -> None:
    for t in [*state["model"].values(), *state["opt"].values()]:  # type: ignore[attr-defined]
        t.add_(1)
    state["arr"] += 1  # type: ignore[operator]


@pytest.mark.parametrize("keys", [False, True], ids=["plain", "encrypted-signed"])
def test_a_staged_child_writes_the_state_as_it_was_when_forked(tmp_path, keys):
    from cryptography.hazmat.primitives.asymmetric import ed25519

    signer = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    kw = {"encrypt_with": bytes(range(32)), "sign_with": signer, "compression": "zstd"} if keys else {}
    state = _state()
    want = _copy(state)
    snapshot = forksave.take_snapshot(_sources(state))
    _change(state)  # after the snapshot, before the save is planned
    p = tmp_path / "staged.ckpt"
    handle = _save_staged(state, p, snapshot, **kw)
    handle.wait()
    assert handle.snapshot == "fork"  # the fixture checks the child is reaped
    read = {"decrypt_with": kw["encrypt_with"], "trusted_keys": [signer.public_key()]} if keys else {}
    assert ckptfmt.verify(p, **read).ok
    assert_same(want, ckptfmt.load(p, **read), check_sharing=False)
    with pytest.raises(SnapshotError, match="used or discarded already"):  # one file per child
        _save_staged(state, tmp_path / "again.ckpt", snapshot)


def test_a_storage_the_staged_child_does_not_hold_is_refused_and_the_child_killed(tmp_path):
    a = torch.arange(1000.0)
    snapshot = forksave.take_snapshot([("a", a.untyped_storage())])
    with pytest.raises(SnapshotError, match="not in the memory the fork snapshot holds"):
        _save_staged({"a": a, "b": torch.ones(100)}, tmp_path / "x.ckpt", snapshot)
    assert _gone(snapshot.pid) and os.listdir(tmp_path) == []
    unused = forksave.take_snapshot([("a", a.untyped_storage())])
    unused.discard()  # a save that never came: killed and reaped
    unused.discard()
    assert _gone(unused.pid)


def test_a_staged_child_that_dies_fails_the_save_and_keeps_the_previous_file(tmp_path, monkeypatch):
    p = tmp_path / "x.ckpt"
    ckptfmt.save({"a": torch.zeros(10)}, p)
    a = torch.arange(1000.0)
    monkeypatch.setattr(_native, "hand_job", functools.partial(_native.hand_job, _fault=1))
    snapshot = forksave.take_snapshot([("a", a.untyped_storage())])
    handle = _save_staged({"a": a}, p, snapshot)
    with pytest.raises(SnapshotError, match=r"killed by signal 9 \(SIGKILL\).*nothing was committed"):
        handle.wait()
    assert torch.equal(ckptfmt.load(p)["a"], torch.zeros(10)) and os.listdir(tmp_path) == ["x.ckpt"]


def test_dcp_async_save_in_one_process_snapshots_by_fork(tmp_path):
    import ckptfmt.dcp as cdcp

    state = {"w": torch.arange(4096.0).reshape(64, 64), "view": torch.arange(100.0)[10:60], "n": 3}
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    future = cdcp.async_save(state, tmp_path / "ckpt", snapshot="fork")
    state["w"].add_(1)  # type: ignore[attr-defined]
    state["view"].add_(1)  # type: ignore[attr-defined]
    future.result()
    got = {"w": torch.zeros(64, 64), "view": torch.zeros(50), "n": 0}
    cdcp.load(got, tmp_path / "ckpt")
    assert_same(want, got, check_sharing=False)
    with pytest.raises(ValueError, match="snapshot must be 'copy' or 'fork'"):
        cdcp.async_save(state, tmp_path / "other", snapshot="later")


def test_the_public_calls_refuse_a_fork_snapshot_object(tmp_path):
    """A fork snapshot taken earlier is ckptfmt's own (the DCP writer hands it down the internal
    save path): the public snapshot= takes only "copy" and "fork", and says so as a typed error."""
    import ckptfmt.dcp as cdcp
    from ckptfmt.files import incremental
    from ckptfmt.files.save import save_options

    a = torch.arange(10.0)
    snapshot = forksave.take_snapshot([("a", a.untyped_storage())])
    p = tmp_path / "x.ckpt"
    try:
        calls = (
            functools.partial(ckptfmt.save, {"a": a}, p, blocking=False),
            functools.partial(incremental.save, {"a": a}, p, blocking=False),
            functools.partial(save_options, blocking=False),
            functools.partial(ckptfmt.CheckpointManager, tmp_path / "run", blocking=False),
            functools.partial(cdcp.async_save, {"a": a}, tmp_path / "dcp"),
        )
        for value in (snapshot, "cow"):
            for call in calls:
                with pytest.raises(
                    UnsupportedError, match=r"snapshot must be 'copy' or 'fork', not "
                ) as info:
                    call(snapshot=value)
                assert repr(value) in str(info.value)
        assert not snapshot.spent()  # refused before anything used it
    finally:
        snapshot.discard()
    assert _gone(snapshot.pid) and os.listdir(tmp_path) == []


# -- deadlines: a child that hangs fails its save by inflight.DEADLINE, killed and reaped ----


def _stopping(real, stopped: list[int]):  # type: ignore[no-untyped-def]
    """`real` (fork_write or hand_job) whose child hangs: held back before it writes (fault 3)
    and stopped (SIGSTOP) as soon as it is forked or handed its job; its pid goes to `stopped`."""

    def hang(*args, **kwargs):  # type: ignore[no-untyped-def]
        child = real(*args, **kwargs, _fault=3)
        os.kill(child.pid, signal.SIGSTOP)
        stopped.append(child.pid)
        return child

    return hang


@pytest.fixture
def stopped(monkeypatch):
    """A deadline of 2 s for every background wait; the children a test stops (pids appended
    here) are killed after it whatever happened, so code without a deadline fails, not hangs."""
    monkeypatch.setattr(inflight, "DEADLINE", 2.0)
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _within(seconds: float, call):  # type: ignore[no-untyped-def]
    """call() on a thread of its own: its result, or its error raised here; pytest.fail if it
    has not returned after `seconds` (a wait without a deadline)."""
    out: list[object] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:
            failed.append(e)

    t = threading.Thread(target=run, name="test-waiter", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still waiting after {seconds} s: the wait has no deadline")
    if failed:
        raise failed[0]
    return out[0]


def _late(exc: BaseException | None, pid: int, path: object) -> None:
    """`exc` is the deadline's SnapshotError for the child `pid` saving `path`, which is reaped."""
    assert isinstance(exc, SnapshotError), exc
    text = str(exc)
    assert text.startswith(f"{path}: ") and f"(pid {pid}) was not done within the deadline of 2 s" in text, (
        text
    )
    assert "it was killed and nothing was committed" in text, text
    assert _gone(pid)  # killed and reaped: not even a zombie


@pytest.mark.parametrize("staged", [False, True], ids=["forked-at-save", "staged"])
def test_a_child_that_hangs_fails_the_save_by_the_deadline_and_the_next_save_works(
    tmp_path, monkeypatch, stopped, staged
):
    p = tmp_path / "x.ckpt"
    ckptfmt.save({"a": torch.ones(10)}, p)
    a = torch.arange(100_000.0)
    real = (_native.fork_write, _native.hand_job)
    began = time.monotonic()
    if staged:
        monkeypatch.setattr(_native, "hand_job", _stopping(_native.hand_job, stopped))
        handle = _save_staged({"a": a}, p, forksave.take_snapshot([("a", a.untyped_storage())]))
    else:
        monkeypatch.setattr(_native, "fork_write", _stopping(_native.fork_write, stopped))
        handle = ckptfmt.save({"a": a}, p, blocking=False, snapshot="fork")
    exc = handle.exception(timeout=60)
    assert 2.0 <= time.monotonic() - began < 30
    _late(exc, stopped[0], p)
    assert os.listdir(tmp_path) == ["x.ckpt"]  # no temp file
    assert torch.equal(ckptfmt.load(p)["a"], torch.ones(10))  # the previous file
    _native.fork_write, _native.hand_job = real  # the next save's child is left alone
    ckptfmt.save({"a": a}, p, blocking=False, snapshot="fork").wait(60)
    assert torch.equal(ckptfmt.load(p)["a"], a)


def _waitable(pid: int) -> bool:
    """Whether the child `pid` has exited, every thread of it (so its descriptors are closed), and
    is not reaped yet (a zombie's main thread can show as one while another still exits)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def test_a_staged_child_whose_job_does_not_come_exits_and_the_late_save_fails(tmp_path, monkeypatch):
    """The child of a snapshot taken before its save was planned waits for its job until the
    deadline, then exits (it holds the process's memory as it was); a save that hands it one
    later fails naming that, and leaves nothing."""
    monkeypatch.setattr(inflight, "DEADLINE", 1.0)
    a = torch.arange(1000.0)
    snapshot = forksave.take_snapshot([("a", a.untyped_storage())])
    try:
        end = time.monotonic() + 30
        while not _waitable(snapshot.pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert _waitable(snapshot.pid), "the staged child still waits for its job past its deadline"
        with pytest.raises(SnapshotError) as info:
            _save_staged({"a": a}, tmp_path / "x.ckpt", snapshot)
    finally:
        snapshot.discard()
    text = str(info.value)
    assert text.startswith(f"{tmp_path / 'x.ckpt'}: ") and f"(pid {snapshot.pid}) could not be handed" in text
    assert "exited with status 6 (its job did not come within its deadline of 1 s)" in text, text
    assert _gone(snapshot.pid) and os.listdir(tmp_path) == []
    assert not inflight._in_flight


def test_a_manager_step_whose_child_hangs_fails_by_the_deadline_and_the_next_step_saves(
    tmp_path, monkeypatch, stopped
):
    mgr = ckptfmt.CheckpointManager(tmp_path / "run", blocking=False, snapshot="fork")
    mgr.save(1, {"v": torch.ones(10)})
    mgr.wait()
    real = _native.fork_write
    monkeypatch.setattr(_native, "fork_write", _stopping(real, stopped))
    mgr.save(2, {"v": torch.zeros(10)})
    with pytest.raises(CheckpointError, match="an earlier save of step 2 failed") as info:
        _within(60, mgr.wait)
    _late(info.value.__cause__, stopped[0], tmp_path / "run" / "step-000000002" / "state.ckpt")
    assert "deadline of 2 s" in str(info.value)
    assert not (tmp_path / "run" / "step-000000002").exists()  # the step and its temp file removed
    _native.fork_write = real
    mgr.save(3, {"v": torch.full((10,), 3.0)})
    mgr.wait()
    assert [c.step for c in mgr.checkpoints()] == [1, 3]
    assert torch.equal(mgr.load()["v"], torch.full((10,), 3.0))


@pytest.mark.parametrize(
    "before, now", [("fork", "fork"), ("copy", "fork"), ("fork", "copy")], ids=lambda v: str(v)
)
def test_a_dcp_save_waits_for_the_save_staged_before_it_until_the_deadline(
    tmp_path, monkeypatch, before, now
):
    """A background DCP save waits for the one staged before it (two would interleave their
    collectives): at most the deadline, then a CheckpointError naming both, with nothing
    forked or written; once that save is done, the next one runs."""
    import ckptfmt.dcp as cdcp
    from ckptfmt.dcp import api
    from ckptfmt.dcp.forkstage import ForkStager

    monkeypatch.setattr(inflight, "DEADLINE", 1.0)
    stuck: concurrent.futures.Future[object] = concurrent.futures.Future()  # a save stuck elsewhere
    stager = ForkStager if before == "fork" else api._DEFAULT_STAGER
    stager.track(stuck, str(tmp_path / "before"))
    state = {"w": torch.arange(256.0).reshape(16, 16), "n": 1}
    children = _children()
    try:
        began = time.monotonic()
        with pytest.raises(CheckpointError) as info:
            _within(60, lambda: cdcp.async_save(state, tmp_path / "next", snapshot=now))
        assert 1.0 <= time.monotonic() - began < 30
        assert str(info.value) == (
            f"{tmp_path / 'next'}: the background save of {tmp_path / 'before'} staged before this "
            "one is still running after the deadline of 1 s; this save was not started"
        )
        assert _children() <= children and not os.listdir(tmp_path)
    finally:
        stuck.set_result(None)
    cdcp.async_save(state, tmp_path / "next", snapshot=now).result()
    got = {"w": torch.zeros(16, 16), "n": 0}
    cdcp.load(got, tmp_path / "next")
    assert torch.equal(got["w"], state["w"]) and got["n"] == 1

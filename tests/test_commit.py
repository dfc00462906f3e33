"""The commit protocol (spec section 10) on the filesystems training runs on.

Saves must work where flock is not supported (Lustre without ``-o flock``, some
NFS), a temp file must be owned from the moment it exists (a concurrent cleanup
never removes a live one), and temp files that crashed saves left behind are
removed by the next save into the same directory, whatever their target name.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptfmt
from ckptfmt.engine import commit

NO_LOCK_ERRNOS = [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP]

# a child that creates a temp file for argv[1] (as a save does), writes to it, prints its
# path and waits: killed, it is a saver that crashed mid-save; alive, a save in progress
_HOLDER = r"""
import errno, fcntl, os, sys
if sys.argv[2] == "noflock":
    def _unsupported(*args, **kwargs):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = _unsupported
from ckptfmt.engine import commit
from ckptfmt.engine.commit import AtomicFile
with AtomicFile(sys.argv[1]) as f:
    os.write(f.fd, b"\0" * 65536)
    print(f.tmp, flush=True)
    sys.stdin.read()
"""


def _no_flock(monkeypatch: pytest.MonkeyPatch, code: int = errno.ENOLCK) -> None:
    def unsupported(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", unsupported)


def _holder(target: str, mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, target, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    tmp = proc.stdout.readline().strip()
    assert tmp and os.path.exists(tmp), proc.stderr
    return proc, tmp


def _state(v: float = 1.0) -> dict[str, object]:
    return {"t": torch.full((50_000,), v), "n": 3}


# -- saving where flock is not supported ---------------------------------------------------------


@pytest.mark.parametrize("code", NO_LOCK_ERRNOS)
@pytest.mark.parametrize("blocking", [True, False])
def test_save_without_flock_support(tmp_path, monkeypatch, code, blocking):
    _no_flock(monkeypatch, code)
    p = tmp_path / "x.ckpt"
    for v in (1.0, 2.0):
        h = ckptfmt.save(_state(v), p, blocking=blocking)
        if h is not None:
            h.wait()
        assert ckptfmt.load(p)["t"][0].item() == v
    assert os.listdir(tmp_path) == ["x.ckpt"]
    assert ckptfmt.verify(p).ok


_NO_FLOCK_CHILD = r"""
import errno, fcntl, os, sys
def _unsupported(*args, **kwargs):
    raise OSError(errno.ENOSYS, "Function not implemented")
fcntl.flock = _unsupported
import torch, ckptfmt
d = sys.argv[1]
ckptfmt.save({"v": torch.ones(10)}, os.path.join(d, "a.ckpt"))
ckptfmt.save({"v": torch.ones(20)}, os.path.join(d, "b.ckpt"), blocking=False).wait()
m = ckptfmt.CheckpointManager(os.path.join(d, "run"), keep_last=1)
m.save(1, {"w": torch.ones(3)})
m.save(2, {"w": torch.full((3,), 2.0)})
print("OK", m.latest().step, m.load()["w"].tolist())
"""


def test_save_without_flock_support_in_a_subprocess(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _NO_FLOCK_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["OK", "2", "[2.0,", "2.0,", "2.0]"], out.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "run"]
    assert ckptfmt.load(tmp_path / "a.ckpt")["v"].shape == (10,)
    assert ckptfmt.load(tmp_path / "b.ckpt")["v"].shape == (20,)


def test_a_failing_lock_removes_the_temp_file(tmp_path, monkeypatch):
    _no_flock(monkeypatch, errno.EIO)  # not "unsupported": a real error, raised
    with pytest.raises(OSError) as info:
        ckptfmt.save(_state(), tmp_path / "x.ckpt")
    assert info.value.errno == errno.EIO
    with pytest.raises(OSError):
        ckptfmt.save(_state(), tmp_path / "y.ckpt", blocking=False)
    assert os.listdir(tmp_path) == []


# -- a temp file is owned from the moment it exists --------------------------------------------


@pytest.mark.parametrize("other_name", [False, True])
def test_concurrent_cleanup_between_create_and_lock_keeps_the_temp(tmp_path, monkeypatch, other_name):
    """Another process saves (and so cleans up) in the instant between this save creating
    its temp file and locking it: the temp file must survive."""
    p = tmp_path / "x.ckpt"
    other = tmp_path / ("y.ckpt" if other_name else "x.ckpt")
    real_flock = fcntl.flock
    ran: list[int] = []

    def flock_after_a_concurrent_save(fd: int, op: int) -> None:
        if op == fcntl.LOCK_EX and not ran:  # the saver's own lock, just after creating the temp
            ran.append(fd)
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys, ckptfmt; ckptfmt.save({'v': 2}, sys.argv[1])",
                    str(other),
                ],
                check=True,
                timeout=120,
            )
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_concurrent_save)
    ckptfmt.save({"v": 1}, p)
    assert ran
    assert ckptfmt.load(p) == {"v": 1}
    if other_name:
        assert ckptfmt.load(other) == {"v": 2}
    assert sorted(os.listdir(tmp_path)) == sorted({p.name, other.name})


# -- temp files of crashed saves, whatever their name ------------------------------------------


@pytest.mark.parametrize("mode", ["flock", "noflock"])
def test_killed_savers_temp_is_removed_by_a_save_of_another_name(tmp_path, monkeypatch, mode):
    proc, tmp = _holder(str(tmp_path / "a.ckpt"), mode)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert os.path.exists(tmp)  # what a crashed save leaves
    if mode == "noflock":
        _no_flock(monkeypatch)
    ckptfmt.save(_state(), tmp_path / "b.ckpt")
    assert os.listdir(tmp_path) == ["b.ckpt"]


@pytest.mark.parametrize("mode", ["flock", "noflock"])
def test_live_savers_temp_survives_saves_in_its_directory(tmp_path, monkeypatch, mode):
    if mode == "noflock":
        _no_flock(monkeypatch)
    proc, tmp = _holder(str(tmp_path / "a.ckpt"), mode)
    try:
        ckptfmt.save(_state(), tmp_path / "b.ckpt")
        ckptfmt.save(_state(2.0), tmp_path / "a.ckpt")  # the same target: still not ours to remove
        ckptfmt.save(_state(3.0), tmp_path / "b.ckpt", blocking=False).wait()
        assert os.path.exists(tmp)
        assert sorted(os.listdir(tmp_path)) == sorted(["a.ckpt", "b.ckpt", os.path.basename(tmp)])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt"]  # the holder removed its own temp
    assert ckptfmt.load(tmp_path / "a.ckpt")["t"][0].item() == 2.0
    assert list(commit.iter_temp_files(str(tmp_path / "a.ckpt"))) == []


# -- the ownership rules, one by one --------------------------------------------------------------


def _temp(directory, target: str, owner: str, data: bytes = b"\0" * 1000) -> str:
    path = os.path.join(directory, f".{target}{commit.TEMP_MARKER}{owner}.0123abcd")
    with open(path, "wb") as f:
        f.write(data)
    return path


def _age(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_temp_names_carry_their_owner(tmp_path):
    with commit.AtomicFile(str(tmp_path / "x.ckpt")) as f:
        name = os.path.basename(f.tmp)
        assert name.startswith(".x.ckpt" + commit.TEMP_MARKER)
        target, owner = commit.parse_temp_name(name)
        assert target == "x.ckpt"
        assert owner == (commit.host_token(), os.getpid(), commit._start_of(os.getpid()))
        assert list(commit.iter_temp_files(str(tmp_path / "x.ckpt"))) == [f.tmp]
        assert list(commit.iter_temp_files(str(tmp_path / "y.ckpt"))) == []
    assert commit.parse_temp_name("x.ckpt") is None
    assert commit.parse_temp_name(".x.ckpt.ckptfmt-tmp.12.ab") == ("x.ckpt", None)  # an older name
    assert commit.parse_temp_name(".x.ckpt.ckptfmt-tmp.notours") is None


def test_this_processes_temps_live_exactly_while_their_save_runs(tmp_path, monkeypatch):
    """Under the lock-free protocol, this process's own saves in progress are told apart from
    temps that its failed saves could not remove."""
    _no_flock(monkeypatch)
    mine = commit.owner_token()
    left = _temp(tmp_path, "old.ckpt", mine)  # same owner, no save in progress: abandoned
    with commit.AtomicFile(str(tmp_path / "a.ckpt")) as running:
        assert not running.locked
        ckptfmt.save(_state(), tmp_path / "b.ckpt")
        h = ckptfmt.save(_state(), tmp_path / "c.ckpt", blocking=False)
        assert os.path.exists(running.tmp)
        assert not os.path.exists(left)
        h.wait()
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt", "c.ckpt"]


def test_a_reused_pid_does_not_keep_a_temp_alive(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    ppid = os.getppid()  # alive, but not the process that started at time 1
    stale = _temp(tmp_path, "a.ckpt", f"{commit.host_token()}.{ppid}.1")
    unknown_start = _temp(tmp_path, "b.ckpt", f"{commit.host_token()}.{ppid}.0")  # start not known: alive
    live = _temp(tmp_path, "c.ckpt", f"{commit.host_token()}.{ppid}.{commit._start_of(ppid)}")
    ckptfmt.save(_state(), tmp_path / "x.ckpt")
    assert not os.path.exists(stale)
    assert os.path.exists(unknown_start) and os.path.exists(live)


def _zombie(pid: int) -> bool:
    """Dead, not reaped, and every thread gone (the leader shows "Z" while others still exit)."""
    st = commit._proc_stat(pid)
    try:
        return st is not None and st[0] == "Z" and len(os.listdir(f"/proc/{pid}/task")) == 1
    except OSError:
        return False


def test_a_dead_saver_not_yet_reaped_owns_nothing(tmp_path):
    code = (
        "import os, sys\nfrom ckptfmt.engine import commit\n"
        "f = commit.AtomicFile(sys.argv[1]).__enter__()\nprint(f.tmp, flush=True)\nos._exit(0)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "a.ckpt")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    tmp = proc.stdout.readline().strip()
    deadline = time.time() + 60
    while not _zombie(proc.pid):
        assert time.time() < deadline
        time.sleep(0.01)
    assert os.path.exists(tmp)  # its pid still exists
    ckptfmt.save(_state(), tmp_path / "b.ckpt")
    assert os.listdir(tmp_path) == ["b.ckpt"]
    proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["flock", "noflock"])
def test_temps_of_other_hosts_go_only_once_old(tmp_path, monkeypatch, mode):
    """A free lock does not prove a save on another host (or pid namespace) dead: it may not
    have locked yet, or its locks may not reach this host.  Only age does."""
    if mode == "noflock":
        _no_flock(monkeypatch)
    other_host = "00000000deadbeef" if commit.host_token() != "00000000deadbeef" else "00000000feedface"
    young = _temp(tmp_path, "a.ckpt", f"{other_host}.{os.getpid()}.0")
    old = _temp(tmp_path, "b.ckpt", f"{other_host}.12345.678")
    _age(old, commit.FOREIGN_GRACE_S + 60)
    legacy_old = str(tmp_path / ".c.ckpt.ckptfmt-tmp.1.abc")
    open(legacy_old, "wb").close()
    _age(legacy_old, commit.FOREIGN_GRACE_S + 60)
    ckptfmt.save(_state(), tmp_path / "x.ckpt")
    assert os.path.exists(young)
    assert not os.path.exists(old)
    assert not os.path.exists(legacy_old)


def test_only_regular_files_are_removed(tmp_path):
    dead = f"{commit.host_token()}.99999999.1"
    as_dir = tmp_path / f".step-000000001{commit.TEMP_MARKER}{dead}.0123abcd"
    as_dir.mkdir()  # the manager's temporary step directories share the marker
    victim = tmp_path / "precious"
    victim.write_bytes(b"keep")
    link = tmp_path / f".a.ckpt{commit.TEMP_MARKER}{dead}.0123abcd"
    link.symlink_to(victim)
    fifo = tmp_path / f".b.ckpt{commit.TEMP_MARKER}{dead}.0123abcd"
    os.mkfifo(fifo)
    stale = _temp(tmp_path, "c.ckpt", dead)
    assert commit.remove_abandoned_temps(str(tmp_path)) == [os.path.basename(stale)]
    assert as_dir.is_dir() and link.is_symlink() and victim.read_bytes() == b"keep" and fifo.exists()


_FORKING_OWNER = r"""
import os, sys, time
from ckptfmt.engine import commit
f = commit.AtomicFile(sys.argv[1]).__enter__()
child = os.fork()
if child == 0:  # a data loader worker, say: it inherits the locked descriptor
    time.sleep(600)
    os._exit(0)
print(f.tmp, child, flush=True)
os._exit(0)  # the owner dies mid-save
"""


def test_a_dead_owners_temp_goes_even_while_a_forked_child_holds_its_lock(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKING_OWNER, str(tmp_path / "a.ckpt")],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    tmp, child = proc.stdout.readline().split()
    proc.wait(timeout=30)
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the child still holds the lock
        finally:
            os.close(fd)
        ckptfmt.save(_state(), tmp_path / "b.ckpt")
        assert os.listdir(tmp_path) == ["b.ckpt"]
    finally:
        os.kill(int(child), signal.SIGKILL)
        proc.stdout.close()


def test_replacing_a_file_frees_it_off_the_callers_path_without_leaking(tmp_path):
    """A commit over an existing file holds the old one open across the rename and closes
    it on a thread: the new content is there at once, and no descriptor is left behind."""
    import threading

    import torch

    import ckptfmt

    path = tmp_path / "a.ckpt"
    ckptfmt.save({"v": torch.zeros(1000)}, path)
    fds_before = len(os.listdir("/proc/self/fd"))
    for i in range(1, 6):
        ckptfmt.save({"v": torch.full((1000,), float(i))}, path)
        assert torch.equal(ckptfmt.load(path)["v"], torch.full((1000,), float(i)))
    for t in threading.enumerate():
        if t.name == "ckptfmt-free-replaced":
            t.join(10)
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]

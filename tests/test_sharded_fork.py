"""Fork snapshots in a run of several ranks: CheckpointManager(blocking=False, snapshot="fork") and
ckptfmt.dcp.async_save(snapshot="fork") on 2 ranks under gloo.  Each rank forks when save() is
called; its child writes the rank's file once DCP has planned the save, from the memory as it
was at the call (the tests change every tensor right after save() returns, while the child is
held back before writing).  A child killed mid-save fails the save on every rank, nothing of it
is committed or left behind, and the previous step still loads."""

from __future__ import annotations

import functools
import os

import torch
from helpers import run_ranks

import ckptfmt

FULL = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
BUFFER = torch.arange(100, dtype=torch.float64)


def _children() -> list[int]:
    """The processes (zombies too) whose parent is this one."""
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as fh:
                if any(line.split() == ["PPid:", me] for line in fh):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _held_back(fault: int):  # type: ignore[no-untyped-def]
    """Make every staged child of this process take `fault` once handed its job (3: sleep 2 s
    before writing, so what the rank changes after save() returns lands first; 1: die)."""
    from ckptfmt.engine import native

    real = getattr(native.hand_job, "func", native.hand_job)
    native.hand_job = functools.partial(real, _fault=fault)


def _rank_main(rank: int, world: int, base: str) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptfmt.dcp as cdcp

    results: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (world,))
    buffer = BUFFER.clone()  # "view" is a slice of it: written from its bytes, without a copy

    def state_at(step: int) -> dict[str, object]:
        buffer.copy_(BUFFER * step)
        return {"w": distribute_tensor(FULL * step, mesh, [Shard(0)]), "view": buffer[16:48], "n": step}

    def change(state: dict[str, object]) -> None:
        state["w"].to_local().add_(1000.0)  # type: ignore[attr-defined]
        buffer.add_(1000.0)
        state["n"] = -1

    _held_back(3)
    m = ckptfmt.CheckpointManager(os.path.join(base, "run"), keep_last=3, blocking=False, snapshot="fork")
    for step in (1, 2):
        state = state_at(step)
        handle = m.save(step, state)
        change(state)  # right after save() returned, before the child writes
        results[f"handle-{step}"] = type(handle).__name__
    m.wait()
    results["steps"] = [c.step for c in m.checkpoints()]

    # a child killed once handed its job (rank 1's only): the save fails on every rank
    if rank == 1:
        _held_back(1)
    m.save(3, state_at(3))
    try:
        m.wait()
        results["wait"] = None
    except ckptfmt.CheckpointError as e:
        results["wait"] = f"{type(e).__name__}: {e}"
    _held_back(3)
    dist.barrier()
    results["after_failure"] = [c.step for c in m.checkpoints()]
    target = {
        "w": distribute_tensor(torch.zeros_like(FULL), mesh, [Shard(0)]),
        "view": torch.zeros(32),
        "n": 0,
    }
    report = m.load_into(target)
    results["resumed"] = [
        report.step,
        bool(torch.equal(target["w"].full_tensor(), FULL * 2)),  # type: ignore[attr-defined]
        bool(torch.equal(target["view"], (BUFFER * 2)[16:48])),  # type: ignore[arg-type]
        target["n"],
    ]

    # ckptfmt.dcp.async_save itself
    state = state_at(5)
    future = cdcp.async_save(state, os.path.join(base, "direct"), snapshot="fork")
    change(state)
    future.result()
    target = {
        "w": distribute_tensor(torch.zeros_like(FULL), mesh, [Shard(0)]),
        "view": torch.zeros(32),
        "n": 0,
    }
    cdcp.load(target, os.path.join(base, "direct"))
    results["direct"] = [
        bool(torch.equal(target["w"].full_tensor(), FULL * 5)),  # type: ignore[attr-defined]
        bool(torch.equal(target["view"], (BUFFER * 5)[16:48])),  # type: ignore[arg-type]
        target["n"],
    ]
    # a child killed on rank 0: the future fails with SnapshotError on every rank
    if rank == 0:
        _held_back(1)
    try:
        cdcp.async_save(state_at(6), os.path.join(base, "killed"), snapshot="fork").result()
        results["killed"] = None
    except ckptfmt.CheckpointError as e:
        results["killed"] = f"{type(e).__name__}: {e}"
    _held_back(3)
    # a save that fails while DCP plans (overwrite=False onto a checkpoint): its child, never
    # handed a file, is killed and reaped (results["children"] below)
    try:
        cdcp.async_save(state, os.path.join(base, "direct"), snapshot="fork", overwrite=False).result()
        results["refused"] = None
    except ckptfmt.CheckpointError as e:
        results["refused"] = str(e)
    # memory another process shares cannot be snapshotted by fork: refused before anything runs
    try:
        cdcp.async_save({"s": torch.zeros(8).share_memory_()}, os.path.join(base, "shared"), snapshot="fork")
        results["shared"] = None
    except ValueError as e:
        results["shared"] = str(e)
    results["children"] = _children()
    return results


def test_fork_snapshots_of_two_ranks(tmp_path):
    for got in run_ranks(_rank_main, 2, tmp_path, str(tmp_path)):
        assert "error" not in got, got
        assert got["handle-1"] == got["handle-2"] == "SaveHandle", got
        assert got["steps"] == [1, 2], got
        wait = got["wait"]
        assert wait is not None and "step 3" in wait and "rank 1" in wait, got
        assert "snapshot (pid" in wait and "killed by signal 9" in wait and "nothing was committed" in wait, (
            got
        )
        assert got["after_failure"] == [1, 2], got
        assert got["resumed"] == [2, True, True, 2], got  # the values at the call, not the later change
        assert got["direct"] == [True, True, 5], got
        killed = got["killed"]
        assert killed is not None and killed.startswith("SnapshotError") and "rank 0" in killed, got
        assert "killed by signal 9" in killed and "no commit record was written" in killed, got
        assert got["refused"] is not None and "overwrite=False" in got["refused"], got
        assert got["shared"] is not None and "snapshot='fork' is not possible" in got["shared"], got
        assert "shared with other processes" in got["shared"], got
        assert got["children"] == [], got  # every child reaped, the killed one too
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["step-000000001", "step-000000002"]  # step 3 removed
    m = ckptfmt.CheckpointManager(run)
    assert m.verify().ok
    assert m.latest().step == 2
    for step in ("step-000000001", "step-000000002"):  # nothing but what a committed step holds
        assert all(
            n == "COMMIT" or n.startswith("rank-") or n.startswith(".ckptfmt") for n in os.listdir(run / step)
        )
    assert not (tmp_path / "shared").exists() or not os.listdir(tmp_path / "shared")
    # the killed save: no commit record, no temp file of rank 0's child (rank 1's file, committed
    # before the failure, lies in a directory that is no checkpoint, as after any failed rank)
    left = os.listdir(tmp_path / "killed")
    assert "COMMIT" not in left and not any(".ckptfmt-tmp." in n for n in left), left
    assert "rank-00000.ckpt" not in left, left


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _hanging_rank_main(rank: int, world: int, base: str) -> dict[str, object]:
    """A manager of 2 ranks with fork snapshots whose step 2 child hangs on rank 1 (stopped with
    SIGSTOP once handed its job): every rank's wait() fails by the deadline (5 s: the staged
    children wait for their jobs that long too, while the ranks plan), the child is killed and
    reaped, and step 3 saves.  The test bounds the wait itself: code without a deadline fails."""
    import signal
    import threading
    import time

    import torch.distributed as dist

    from ckptfmt.background import inflight
    from ckptfmt.engine import native

    inflight.DEADLINE = 5.0
    results: dict[str, object] = {}
    m = ckptfmt.CheckpointManager(os.path.join(base, "run"), blocking=False, snapshot="fork")
    m.save(1, {"w": torch.full((64,), float(rank)), "n": 1})
    m.wait()

    real, stopped = native.hand_job, []

    def hang(*args, **kwargs):  # type: ignore[no-untyped-def]
        child = real(*args, **kwargs, _fault=3)  # held back before it writes, then stopped
        os.kill(child.pid, signal.SIGSTOP)
        stopped.append(child.pid)
        return child

    if rank == 1:
        native.hand_job = hang
    m.save(2, {"w": torch.zeros(64), "n": 2})
    failed: list[str] = []

    def wait() -> None:
        try:
            m.wait()
        except ckptfmt.CheckpointError as e:
            failed.append(str(e))

    began = time.monotonic()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(90)
    results["hung"] = waiter.is_alive()
    results["elapsed"] = time.monotonic() - began
    for pid in stopped:  # no deadline: the test ends the hang itself
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    waiter.join(60)
    results["wait"] = failed[0] if failed else None
    results["stopped_reaped"] = bool(stopped) and all(_gone(pid) for pid in stopped)
    native.hand_job = real
    dist.barrier()
    m.save(3, {"w": torch.full((64,), 3.0 + rank), "n": 3})
    m.wait()
    results["steps"] = [c.step for c in m.checkpoints()]
    # step 3's child is reaped after its commit, once its exit has unmapped its memory
    end = time.monotonic() + 60
    while _children() and time.monotonic() < end:
        time.sleep(0.05)
    results["children"] = _children()
    return results


def test_a_rank_whose_child_hangs_fails_the_step_on_every_rank_by_the_deadline(tmp_path):
    for rank, got in enumerate(run_ranks(_hanging_rank_main, 2, tmp_path, str(tmp_path))):
        assert "error" not in got, got
        assert got["hung"] is False, got  # the wait ended by itself
        assert 5.0 <= got["elapsed"] < 60, got
        wait = got["wait"]
        assert wait is not None and "an earlier save of step 2 failed" in wait and "rank 1" in wait, got
        assert "was not done within the deadline of 5 s" in wait and "nothing was committed" in wait, got
        if rank == 1:
            assert got["stopped_reaped"], got
        assert got["steps"] == [1, 3], got
        assert got["children"] == [], got
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["step-000000001", "step-000000003"]  # step 2 removed
    assert ckptfmt.CheckpointManager(run).verify().ok

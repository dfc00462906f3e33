"""Non-blocking saves of a run of several ranks: CheckpointManager(blocking=False) on 2 ranks
returns after the snapshot, as a single process does; the step commits in the background (DCP's
coordinator writes its record), rank 0 rotates after the commit, wait() reports a failure on
every rank, and a failed step is removed, never left to look like a checkpoint."""

from __future__ import annotations

import os
import resource
import signal

import torch
from helpers import run_ranks

import ckptfmt

FULL = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)


def _rank_main(rank: int, world: int, base: str, options: dict[str, str]) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    results: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (world,))

    def sharded(t: torch.Tensor, n: int) -> dict[str, object]:
        return {"w": distribute_tensor(t.clone(), mesh, [Shard(0)]), "n": n}

    m = ckptfmt.CheckpointManager(os.path.join(base, "run"), keep_last=2, blocking=False)
    handles = []
    for step in (1, 2, 3):
        state = sharded(FULL * step, step)
        handles.append(m.save(step, state))
        state["w"].to_local().add_(1000.0)  # type: ignore[attr-defined]  # after the snapshot
    m.wait()
    results["handles"] = [type(h).__name__ for h in handles]
    results["done"] = all(h.done() for h in handles)
    results["steps"] = [c.step for c in m.checkpoints()]
    # a save whose writes fail on rank 1 (EFBIG): every rank's wait() raises, the step is removed
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, previous[1]))
    failed = m.save(4, sharded(FULL * 4, 4))
    try:
        m.wait()
        results["wait"] = None
    except ckptfmt.CheckpointError as e:
        results["wait"] = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
    results["failed_done"] = failed is not None and failed.done()
    dist.barrier()
    results["after_failure"] = [c.step for c in m.checkpoints()]
    target = sharded(torch.zeros_like(FULL), 0)
    report = m.load_into(target)
    got = target["w"].full_tensor()  # type: ignore[attr-defined]
    results["resumed"] = [report.step, bool(torch.equal(got, FULL * 3)), target["n"]]
    # the same on an object store: each rank's upload and the record in the background
    url = options.pop("url")
    remote = ckptfmt.CheckpointManager(url, storage_options=options, keep_last=1, blocking=False)
    for step in (1, 2):
        state = sharded(FULL * step, step)
        results[f"remote-{step}"] = type(remote.save(step, state)).__name__
        state["w"].to_local().add_(1000.0)  # type: ignore[attr-defined]
    remote.wait()
    dist.barrier()
    target = sharded(torch.zeros_like(FULL), 0)
    report = remote.load_into(target)
    got = target["w"].full_tensor()  # type: ignore[attr-defined]
    results["remote"] = [
        report.step,
        bool(torch.equal(got, FULL * 2)),
        [c.step for c in remote.checkpoints()],
    ]
    return results


def test_nonblocking_saves_of_two_ranks(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    for rank, got in enumerate(run_ranks(_rank_main, 2, tmp_path, str(tmp_path), {**options, "url": url})):
        assert "error" not in got, got
        assert got["handles"] == ["SaveHandle"] * 3 and got["done"], got
        # rank 0 rotates after each commit (keep_last=2); another rank's wait() does not wait
        # for that rotation, so it may still list step 1
        assert got["steps"][-2:] == [2, 3] and (rank == 1 or got["steps"] == [2, 3]), got
        assert got["wait"] is not None and "step 4" in got["wait"], got
        assert got["failed_done"] and got["after_failure"] == [2, 3], got
        assert got["resumed"] == [3, True, 3], got  # the values at the call, not the later change
        assert got["remote-1"] == got["remote-2"] == "SaveHandle", got
        assert got["remote"] == [2, True, [2]], got
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["step-000000002", "step-000000003"]  # step 4 removed
    m = ckptfmt.CheckpointManager(run)
    assert m.verify().ok
    assert torch.equal(m.load()["w"], FULL * 3)
    assert torch.equal(ckptfmt.CheckpointManager(url, storage_options=options).load()["w"], FULL * 2)

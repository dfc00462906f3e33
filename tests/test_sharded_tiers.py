"""A tiered run of several ranks: CheckpointManager(dir, archive="s3://...") on 2 ranks copies
every step to the archive (rank 0 copies, the others only read it), rotates each tier by its
own rules, and a job restarted on a fresh node (its local directory gone) resumes from the
archive bit for bit; encrypted, incremental and non-blocking together."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import run_ranks

import ckptfmt

FROZEN = torch.arange(1 << 18, dtype=torch.float32).reshape(512, 512)
KEY = bytes(range(32))


def _rank_main(
    rank: int, world: int, base: str, options: dict[str, str], phase: str, blocking: bool
) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    results: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict[str, object]:
        return {
            "frozen": distribute_tensor(FROZEN.clone(), mesh, [Shard(0)]),
            "adapter": distribute_tensor(torch.full((64, 8), float(step)), mesh, [Shard(0)]),
            "step": step,
        }

    archive = options.pop("url")
    m = ckptfmt.CheckpointManager(
        os.path.join(base, "node"),
        keep_last=1,
        archive=archive,
        archive_keep_last=2,
        storage_options=options,
        encrypt_with=KEY,
        incremental=True,
        blocking=blocking,
    )
    if phase == "save":
        for step in (1, 2, 3):
            m.save(step, state(step))
        m.wait()  # the saves, and on rank 0 the archive copies
        dist.barrier()
        results["archived"] = [c.step for c in m.archive.checkpoints()] if m.archive else None
    else:  # a fresh node: nothing local, the archive only
        latest = m.latest()
        target = {k: (v * 0 if isinstance(v, torch.Tensor) else 0) for k, v in state(0).items()}
        report = m.load_into(target)
        results["resumed"] = [
            None if latest is None else latest.step,
            report.step,
            bool(torch.equal(target["frozen"].full_tensor(), FROZEN)),  # type: ignore[union-attr]
            bool(torch.equal(target["adapter"].full_tensor(), torch.full((64, 8), 3.0))),  # type: ignore[union-attr]
            target["step"],
        ]
        m.save(4, state(4))  # the run goes on, on the new node
        m.wait()
        dist.barrier()
        results["archived"] = [c.step for c in m.archive.checkpoints()] if m.archive else None
    return results


def _run(phase: str, tmp_path, options: dict[str, str], blocking: bool) -> list[dict[str, object]]:
    return run_ranks(_rank_main, 2, tmp_path, str(tmp_path), options, phase, blocking)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_tiered_run_of_two_ranks_resumes_on_a_fresh_node(tmp_path, s3_bucket, blocking):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    saved = _run("save", tmp_path, {**options, "url": url}, blocking)
    for got in saved:
        assert "error" not in got, got
        # the newest step archived; a lagging archive may skip a step no rule keeps (runs/archiver.py)
        assert got["archived"][-1] == 3 and len(got["archived"]) <= 2, got  # archive_keep_last=2
    assert sorted(os.listdir(tmp_path / "node"))[-1] == "step-000000003"
    shutil.rmtree(tmp_path / "node")  # the node is lost
    resumed = _run("resume", tmp_path, {**options, "url": url}, blocking)
    for got in resumed:
        assert "error" not in got, got
        assert got["resumed"] == [3, 3, True, True, 3], got
        assert got["archived"] == [3, 4], got  # the new node's step beside the one it resumed from
    reader = ckptfmt.CheckpointManager(f"s3://{bucket}/run", storage_options=options, decrypt_with=KEY)
    assert reader.verify(4).ok
    full = reader.load(4)  # resharded into one process
    assert torch.equal(full["frozen"], FROZEN) and torch.equal(full["adapter"], torch.full((64, 8), 4.0))

"""Incremental saves of a run of several ranks: CheckpointManager(incremental=True) on 2 ranks
saves each rank file against the same rank's file of the previous step (LoRA-style: a frozen
base, a small changing adapter), so later steps write only what changed; the step's commit
record names the earlier files it reads from, rotation keeps them, and the run resumes on 2
ranks and resharded into one process, locally and encrypted on a store, blocking or not."""

from __future__ import annotations

import os
from typing import Any

import torch
from helpers import run_ranks

import ckptfmt
from ckptfmt.files import multifile

FROZEN = torch.arange(1 << 18, dtype=torch.float32).reshape(512, 512)  # 1 MiB, 512 KiB a rank
KEY = bytes(range(32))


def _rank_main(rank: int, world: int, base: str, options: dict[str, str]) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    results: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict[str, object]:
        adapter = torch.full((64, 8), float(step))
        return {
            "frozen": distribute_tensor(FROZEN.clone(), mesh, [Shard(0)]),
            "adapter": distribute_tensor(adapter, mesh, [Shard(0)]),
            "step": step,
        }

    url = options.pop("url")
    runs = {
        "local": (os.path.join(base, "run"), {"blocking": True, "incremental": True}),
        "store": (
            url,
            {"storage_options": options, "encrypt_with": KEY, "incremental": True, "blocking": False},
        ),
        "full": (os.path.join(base, "full"), {"blocking": True}),  # not incremental: for contrast
    }
    for name, (where, extra) in runs.items():
        m = ckptfmt.CheckpointManager(where, keep_last=1, **extra)
        for step in (1, 2, 3):
            m.save(step, state(step))
        m.wait()
        dist.barrier()
        target = {k: (v * 0 if isinstance(v, torch.Tensor) else 0) for k, v in state(0).items()}
        report = m.load_into(target)
        results[name] = [
            report.step,
            bool(torch.equal(target["frozen"].full_tensor(), FROZEN)),  # type: ignore[union-attr]
            bool(torch.equal(target["adapter"].full_tensor(), torch.full((64, 8), 3.0))),  # type: ignore[union-attr]
            target["step"],
        ]
    return results


def test_incremental_saves_of_two_ranks(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/run"
    for got in run_ranks(_rank_main, 2, tmp_path, str(tmp_path), {**options, "url": url}):
        assert got == {name: [3, True, True, 3] for name in ("local", "store", "full")}, got
    run = tmp_path / "run"
    first = sum(f.stat().st_size for f in (run / "step-000000001").glob("rank-*.ckpt"))
    last = sum(f.stat().st_size for f in (run / "step-000000003").glob("rank-*.ckpt"))
    assert first > FROZEN.numel() * 4 and last < 64 << 10, (first, last)  # the frozen half refers back
    record = multifile.check_complete(str(run / "step-000000003"))
    assert record.layout == "dcp"
    assert sorted(p.name for p in record.references) == [
        "../step-000000001/rank-00000.ckpt",
        "../step-000000001/rank-00001.ckpt",
    ]
    # keep_last=1: step 2 is gone, step 1 stays only for the files step 3 reads from
    assert sorted(os.listdir(run)) == ["step-000000001", "step-000000003"]
    # a run that is not incremental writes every chunk of every step and refers to nothing
    full = tmp_path / "full"
    assert sorted(os.listdir(full)) == ["step-000000003"]
    assert multifile.check_complete(str(full / "step-000000003")).references == ()
    assert sum(f.stat().st_size for f in (full / "step-000000003").glob("rank-*.ckpt")) > FROZEN.numel() * 4
    # on the store each save names its rank files with digits of its own (spec 13.7): step 3's
    # still read from step 1's file of the same rank
    from ckptfmt.files.names import rank_of

    store = ckptfmt.CheckpointManager(url, storage_options=options, decrypt_with=KEY)
    refs = [r.name.rsplit("/", 1) for r in store.run.record(3).references]
    assert sorted((d, rank_of(n)) for d, n in refs) == [("../step-000000001", 0), ("../step-000000001", 1)]
    assert all(n.count(".") == 2 for _, n in refs), refs
    for m in (
        ckptfmt.CheckpointManager(run),
        ckptfmt.CheckpointManager(url, storage_options=options, decrypt_with=KEY),
    ):
        assert [c.step for c in m.checkpoints()] == [3]
        assert m.verify().ok
        full = m.load()  # resharded into one process
        assert torch.equal(full["frozen"], FROZEN) and torch.equal(full["adapter"], torch.full((64, 8), 3.0))


_PAD = bytes(range(32))


def _wrap(key: bytes) -> bytes:
    """A key service's wrapping, as a test stands one in: any callable pair that round-trips."""
    return b"W" + bytes(x ^ y for x, y in zip(key, _PAD))


def _unwrap(wrapped: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(wrapped[1:], _PAD))


def _keyservice_rank(rank: int, world: int, run: str) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    m = ckptfmt.CheckpointManager(
        run, keep_last=2, incremental=True, encrypt_with=_wrap, decrypt_with=_unwrap
    )
    frozen = torch.arange(1 << 18, dtype=torch.float32)
    for step in (1, 2):
        m.save(step, {"w": distribute_tensor(frozen, mesh, [Shard(0)]), "step": step})
    m.wait()
    target = {"w": distribute_tensor(torch.zeros_like(frozen), mesh, [Shard(0)]), "step": 0}
    got = m.load_into(target)
    return {"step": got.step, "w": bool(torch.equal(target["w"].full_tensor(), frozen))}


def test_a_sharded_incremental_run_encrypted_by_a_key_service_saves_and_loads(tmp_path: Any) -> None:
    """The base of each rank's file is read with the manager's decrypt_with: a key service
    that encrypts cannot read, so the rank files' saves must be given the unwrapping key."""
    got = run_ranks(_keyservice_rank, 2, tmp_path, str(tmp_path / "run"))
    assert got == [{"step": 2, "w": True}, {"step": 2, "w": True}]

"""Incremental saves of a run of 2 ranks: a LoRA-style state (a frozen base sharded over the
ranks, a small adapter that changes every step) saved by CheckpointManager on 2 gloo ranks,
full (incremental=False) against incremental (incremental=True), in one run.

Each mode runs in fresh processes (a group of 2 spawned ranks per mode and round, the modes
alternating round by round) and saves `--steps` steps, each blocking and durable; reported:
the bytes each step writes (all rank files, the first step excluded for the incremental run,
which writes everything), and the median seconds a save takes on rank 0 (the first step
excluded from both), with the incremental save's ratios to the full one.

    python bench/sharded_incremental.py [--size 512M] [--adapter 4M] [--steps 5] [--rounds 3] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import command_line, machine_state, parse_size, summarise, write_json  # noqa: E402

MODES = ("full", "incremental")


def _rank(rank: int, world: int, store: str, run: str, cfg: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptfmt

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    base = torch.randn(max(2, cfg["size"] // (4 << 14)), 1 << 14, generator=g) * 0.02  # rows of 64 KiB
    adapter = torch.zeros(max(2, cfg["adapter"] // (4 << 10)), 1 << 10)
    state = {
        "base": distribute_tensor(base, mesh, [Shard(0)]),
        "adapter": distribute_tensor(adapter, mesh, [Shard(0)]),
    }
    m = ckptfmt.CheckpointManager(run, keep_last=2, incremental=cfg["mode"] == "incremental")
    seconds, sizes = [], []
    for step in range(1, cfg["steps"] + 1):
        state["adapter"].to_local().add_(1.0)  # type: ignore[attr-defined]
        dist.barrier()
        t = time.perf_counter()
        m.save(step, state)
        seconds.append(time.perf_counter() - t)
        step_dir = os.path.join(run, f"step-{step:09d}")
        sizes.append(sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir)))
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"seconds": seconds, "bytes": sizes}, fh)
    dist.destroy_process_group()


def run_mode(mode: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix=f"ckptfmt-bench-{mode}-", dir=where)
    try:
        out = os.path.join(work, "result.json")
        args = (2, os.path.join(work, "store"), os.path.join(work, "run"), {**cfg, "mode": mode}, out)
        mp.start_processes(_rank, args=args, nprocs=2, join=True, start_method="spawn")
        with open(out) as fh:
            return json.load(fh)  # type: ignore[no-any-return]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512M", help="the frozen base, all ranks together")
    ap.add_argument("--adapter", default="4M", help="the adapter that changes every step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sharded_incremental.json"))
    a = ap.parse_args()
    cfg = {"size": parse_size(a.size), "adapter": parse_size(a.adapter), "steps": a.steps}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            runs[mode].append(run_mode(mode, cfg, a.dir))
    later = {m: [s for res in runs[m] for s in res["seconds"][1:]] for m in MODES}
    written = {m: [b for res in runs[m] for b in res["bytes"][1:]] for m in MODES}
    report = {
        "command": command_line(__file__, sys.argv[1:]),
        "machine": machine_state({"dir": a.dir}),
        "config": cfg,
        "seconds": {m: summarise(later[m]) for m in MODES},
        "bytes_per_step": {m: statistics.median(written[m]) for m in MODES},
        "first_step_bytes": {m: runs[m][0]["bytes"][0] for m in MODES},
        "ratios": {
            "time": statistics.median(later["incremental"]) / statistics.median(later["full"]),
            "bytes": statistics.median(written["incremental"]) / statistics.median(written["full"]),
        },
        "runs": runs,
    }
    write_json(a.out, report, echo=False)
    print(json.dumps({k: report[k] for k in ("seconds", "bytes_per_step", "ratios")}, indent=1))


if __name__ == "__main__":
    main()

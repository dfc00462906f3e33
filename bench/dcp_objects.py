"""A two-rank torch.distributed.checkpoint save and load on an object store: ckptfmt's DCP
storage layer on ``s3://`` (cdcp.save / cdcp.load) against DCP's own FsspecWriter /
FsspecReader over s3fs, on one local moto S3 server, in the same process group, interleaved
rounds, medians.

Two ranks (gloo, a FileStore) each hold half of a state of SIZE bytes: fp32 DTensor
parameters sharded by rows on a mesh of both ranks, so each rank writes and reads its own
shard.  Every round saves with each tool into a fresh prefix and loads it back into a
preallocated state of the same sharding (timed between barriers: the slowest rank's time),
then checks the loaded shards against the saved ones.  A small save and load with each tool
first take the imports and first connections off the clock.

    python bench/dcp_objects.py [--size 256M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from common import parse_size  # noqa: E402

TOOLS = ["ckptfmt", "dcp-s3fs"]
WORLD = 2
#: each parameter's rows (fp32): 16 MiB a parameter
COLS = 4096
ROWS = 1024


def fsspec_options(opts: dict[str, str]) -> dict[str, Any]:
    return {
        "key": opts["aws_access_key_id"],
        "secret": opts["aws_secret_access_key"],
        "endpoint_url": opts["endpoint_url"],
        "client_kwargs": {"region_name": opts["region"]},
    }


def build_state(size: int, mesh: Any, seed: int) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    n = max(1, size // (ROWS * COLS * 4))
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}.weight": distribute_tensor(torch.randn(ROWS, COLS, generator=g), mesh, [Shard(0)])
        for i in range(n)
    }


def save(tool: str, state: dict[str, Any], url: str, opts: dict[str, str]) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptfmt import dcp as cdcp

    if tool == "ckptfmt":
        cdcp.save(state, url, storage_options=opts)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(state, storage_writer=FsspecWriter(url, **fsspec_options(opts)))


def load(tool: str, state: dict[str, Any], url: str, opts: dict[str, str]) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptfmt import dcp as cdcp

    if tool == "ckptfmt":
        cdcp.load(state, url, storage_options=opts)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(state, storage_reader=FsspecReader(url, **fsspec_options(opts)))


def timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def rank_main(rank: int, store: str, cfg: dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    state = build_state(cfg["size"], mesh, 1)
    into = build_state(cfg["size"], mesh, 2)
    opts = cfg["opts"]
    times: dict[str, dict[str, list[float]]] = {t: {"save": [], "load": []} for t in TOOLS}
    small, small_into = build_state(1, mesh, 3), build_state(1, mesh, 4)
    for tool in TOOLS:  # imports and first connections, off the clock
        save(tool, small, f"s3://{cfg['bucket']}/warm-{tool}", opts)
        load(tool, small_into, f"s3://{cfg['bucket']}/warm-{tool}", opts)
    for r in range(cfg["rounds"]):
        order = TOOLS if r % 2 == 0 else TOOLS[::-1]
        for tool in order:
            url = f"s3://{cfg['bucket']}/{tool}-{r}"
            times[tool]["save"].append(timed(functools.partial(save, tool, state, url, opts)))
            for v in into.values():
                v.to_local().zero_()
            times[tool]["load"].append(timed(functools.partial(load, tool, into, url, opts)))
            for k, v in state.items():
                if not torch.equal(v.to_local(), into[k].to_local()):
                    raise AssertionError(f"{tool}: {k} loaded differs from the saved shard")
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from s3_server import S3Server

    size = parse_size(args.size)
    with S3Server() as server, tempfile.TemporaryDirectory() as work:
        cfg = {
            "size": size,
            "rounds": args.rounds,
            "bucket": server.new_bucket(),
            "opts": server.storage_options(),
            "out": os.path.join(work, "times.json"),
        }
        store = os.path.join(work, "store")
        procs = [
            subprocess.Popen([sys.executable, __file__, "--rank", str(r), store, json.dumps(cfg)])
            for r in range(WORLD)
        ]
        if any(p.wait() for p in procs):
            raise SystemExit("a rank failed")
        with open(cfg["out"]) as f:
            times = json.load(f)
    nbytes = max(1, size // (ROWS * COLS * 4)) * ROWS * COLS * 4
    print(
        f"{WORLD} ranks, {nbytes / 2**20:.0f} MiB of fp32 DTensor shards, {args.rounds} rounds, moto on 127.0.0.1"
    )
    print("| tool | save s (median) | load s (median) | save MiB/s | load MiB/s |")
    print("|---|---|---|---|---|")
    for tool in TOOLS:
        s, ld = statistics.median(times[tool]["save"]), statistics.median(times[tool]["load"])
        print(f"| {tool} | {s:.2f} | {ld:.2f} | {nbytes / 2**20 / s:.0f} | {nbytes / 2**20 / ld:.0f} |")
    print("raw:", json.dumps(times))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        import warnings

        warnings.filterwarnings("ignore")
        rank_main(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
    else:
        main(sys.argv[1:])

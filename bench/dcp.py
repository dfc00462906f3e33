"""Sharded checkpoints: DCP's FileSystemWriter against ckptfmt's DCP backend, same state, same run.

    python bench/dcp.py                       # 1 GiB state, 2 and 4 ranks, tmpfs and disk, 5 rounds
    python bench/dcp.py --quick               # 256 MiB, 3 rounds
    python bench/dcp.py --size 2G --worlds 2,4 --rounds 7 --targets tmpfs

One gloo group per world size (spawned processes, FileStore).  Every rank holds its
FSDP2 (``fully_shard``) shard of the same training state: a stack of linear layers
and AdamW's two moments, plus the optimizer's plain values.  Within a group the
tools alternate (ABBA by round) on each target directory:

* save: ``dcp.save`` with ``FileSystemWriter(thread_count=cores)`` vs ``cdcp.save``;
* load: ``dcp.load`` with ``FileSystemReader`` vs ``cdcp.load``, into the same sharded
  state (pages already cached: both read what was just written);
* async: ``dcp.async_save`` (its default staging) vs ``cdcp.async_save``: the time the
  call blocks the training loop, and until the checkpoint is durable;
* floor: each rank writes its bytes to a file of its own with plain writes and an fsync,
  then reads them back into its buffers: what the storage allows, with no format, no
  checksums and no planning (right after ckptfmt's turn, every round).

Each figure is the slowest rank's time (the job waits for it), median over rounds;
ratios are taken within a round, then their median.  Writes results/dcp.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import parse_size, walk_tensors  # noqa: E402

TOOLS = ("dcp", "ckptfmt")


# -- one rank -----------------------------------------------------------------------------------


def build_state(total: int, dtype_name: str, world: int) -> tuple[Any, Any, dict[str, Any]]:
    """This rank's FSDP2 shard of a state of about `total` bytes (weights + two AdamW moments)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    width = 1024
    layers = max(1, total // (3 * itemsize * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=True) for _ in range(layers))).to(dtype)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for p in model.parameters():
        local = torch.randn(p.to_local().shape, generator=g).to(dtype)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optim": osd, "step": 1}


def local_tensors(state: Any) -> list[Any]:
    """This rank's tensors (the local shard of each DTensor), in state order."""
    from torch.distributed.tensor import DTensor

    return list(walk_tensors(state, lambda o: o.to_local() if isinstance(o, DTensor) else o))


def local_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(state))


def _byte_views(tensors: list[Any]) -> list[memoryview]:
    from ckptfmt.engine.bytesview import storage_bytes

    return [storage_bytes(t.untyped_storage()) for t in tensors if t.numel()]


def floor_save(state: dict[str, Any], path: str) -> None:
    """The hardware floor of a save: this rank's bytes written to one file by plain writes, fsync'd
    (no format, no checksums, no planning, one thread)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in _byte_views(local_tensors(state)):
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def floor_load(state: dict[str, Any], path: str) -> None:
    """The floor of a load: the same bytes read back into the state's own buffers (no checks)."""
    with open(path, "rb", buffering=0) as f:
        for view in _byte_views(local_tensors(state)):
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise EOFError(path)
                done += n


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptfmt import dcp as cdcp

    warnings.filterwarnings("ignore")
    cfg = json.loads(args.config)
    rank, world = args.rank, args.world
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(args.store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    ckpt_group = dist.new_group(backend="gloo")  # DCP's advice for async saves
    _, _, state = build_state(cfg["size"], cfg["dtype"], world)
    _, _, dest = build_state(cfg["size"], cfg["dtype"], world)
    mine = torch.tensor([float(local_bytes(state))])
    dist.all_reduce(mine)
    cores = os.cpu_count() or 1

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the job waits for its slowest rank
        return float(took.item())

    def clear(path: str) -> None:
        dist.barrier()
        if rank == 0 and os.path.exists(path):
            shutil.rmtree(path)
        dist.barrier()

    rows: list[dict[str, Any]] = []
    for target_name, target in cfg["targets"].items():
        for rnd in range(cfg["rounds"]):
            order = TOOLS if rnd % 2 == 0 else TOOLS[::-1]
            for tool in order:
                path = os.path.join(target, f"w{world}-{tool}")
                row: dict[str, Any] = {"target": target_name, "round": rnd, "tool": tool}
                clear(path)
                if tool == "dcp":
                    row["save"] = timed(
                        lambda p=path: dcp.save(
                            state, storage_writer=dcp.FileSystemWriter(p, thread_count=cores)
                        )
                    )
                    row["load"] = timed(lambda p=path: dcp.load(dest, storage_reader=dcp.FileSystemReader(p)))
                else:
                    row["save"] = timed(lambda p=path: cdcp.save(state, p))
                    row["load"] = timed(lambda p=path: cdcp.load(dest, p))
                row["bytes_on_disk"] = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
                clear(path)
                if tool == "ckptfmt":  # the floor, in the same round, right after ckptfmt's turn
                    floor_dir = os.path.join(target, f"w{world}-floor")
                    clear(floor_dir)
                    if rank == 0:
                        os.makedirs(floor_dir, exist_ok=True)
                    dist.barrier()
                    mine_file = os.path.join(floor_dir, f"rank-{rank}.bin")
                    floor = {"target": target_name, "round": rnd, "tool": "floor"}
                    floor["save"] = timed(lambda f=mine_file: floor_save(state, f))
                    floor["load"] = timed(lambda f=mine_file: floor_load(dest, f))
                    rows.append(floor)
                    clear(floor_dir)
                futures: list[Any] = []

                def start_async(p: str = path, t: str = tool, out: list[Any] = futures) -> None:
                    if t == "dcp":
                        w = dcp.FileSystemWriter(p, thread_count=cores)
                        out.append(dcp.async_save(state, storage_writer=w, process_group=ckpt_group))
                    else:
                        out.append(cdcp.async_save(state, p))

                row["async_blocked"] = timed(start_async)
                row["async_total"] = row["async_blocked"] + timed(lambda f=futures: f[0].result())
                clear(path)
                rows.append(row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "state_bytes": int(mine.item()), "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------------


def summarize(world_result: dict[str, Any]) -> dict[str, Any]:
    rows = world_result["rows"]
    out: dict[str, Any] = {
        "world": world_result["world"],
        "state_bytes": world_result["state_bytes"],
        "targets": {},
    }
    for target in sorted({r["target"] for r in rows}):
        mine = [r for r in rows if r["target"] == target]
        by = {t: {r["round"]: r for r in mine if r["tool"] == t} for t in TOOLS}
        rounds = sorted(set(by["dcp"]) & set(by["ckptfmt"]))
        entry: dict[str, Any] = {}
        for op in ("save", "load", "async_blocked", "async_total"):
            for t in TOOLS:
                vals = [by[t][n][op] for n in rounds]
                entry[f"{t}_{op}_s"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            ratios = [by["dcp"][n][op] / by["ckptfmt"][n][op] for n in rounds]
            entry[f"speedup_{op}"] = statistics.median(ratios)  # DCP's time / ckptfmt's, per round
        for t in TOOLS:
            entry[f"{t}_bytes_on_disk"] = by[t][rounds[0]]["bytes_on_disk"]
        floor = {r["round"]: r for r in mine if r["tool"] == "floor"}
        for op in ("save", "load"):
            vals = [floor[n][op] for n in rounds if n in floor]
            if vals:
                entry[f"floor_{op}_s"] = {
                    "median": statistics.median(vals),
                    "min": min(vals),
                    "max": max(vals),
                }
        out["targets"][target] = entry
    return out


def table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | target | state | op | DCP FileSystemWriter | ckptfmt | DCP / ckptfmt | floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        gib = s["state_bytes"] / (1 << 30)
        for target, e in s["targets"].items():
            for op, label in (
                ("save", "save"),
                ("load", "load"),
                ("async_blocked", "async_save blocked"),
                ("async_total", "async_save until durable"),
            ):
                a, b = e[f"dcp_{op}_s"]["median"], e[f"ckptfmt_{op}_s"]["median"]
                floor = e.get(f"floor_{op}_s")
                floor_text = f"{floor['median']:.3f} s" if floor else ""
                lines.append(
                    f"| {s['world']} | {target} | {gib:.2f} GiB | {label} | {a:.3f} s | {b:.3f} s "
                    f"| {e[f'speedup_{op}']:.2f}x | {floor_text} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G", help="total state bytes across ranks (weights + AdamW moments)")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--targets", default="tmpfs,disk", help="tmpfs (/dev/shm) and/or disk (--disk-dir)")
    ap.add_argument(
        "--disk-dir", default=tempfile.gettempdir(), help="a directory on disk (default: the temp dir)"
    )
    ap.add_argument("--quick", action="store_true", help="256 MiB, 3 rounds")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dcp.json"))
    # internal: one rank
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--world", type=int, default=0)
    ap.add_argument("--store", default="")
    ap.add_argument("--config", default="")
    args = ap.parse_args()
    if args.rank >= 0:
        rank_main(args)
        return
    if args.quick:
        args.size, args.rounds = "256M", 3
    roots = {"tmpfs": "/dev/shm", "disk": args.disk_dir}
    names = [t for t in args.targets.split(",") if t]
    work = {n: tempfile.mkdtemp(prefix="ckptfmt-dcp-bench-", dir=_mkdir(roots[n])) for n in names}
    summaries = []
    raw = []
    try:
        for world in [int(w) for w in args.worlds.split(",")]:
            cfg = {"size": parse_size(args.size), "dtype": args.dtype, "rounds": args.rounds, "targets": work}
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                store = os.path.join(tmp, "store")
                cmd = [sys.executable, os.path.abspath(__file__), "--world", str(world), "--store", store]
                cmd += ["--config", json.dumps(cfg), "--out", out]
                procs = [subprocess.Popen(cmd + ["--rank", str(r)]) for r in range(world)]
                if any(p.wait() != 0 for p in procs):
                    sys.exit(f"a rank of the {world}-rank group failed")
                with open(out) as f:
                    result = json.load(f)
            raw.append(result)
            summaries.append(summarize(result))
            print(table(summaries[-1:]), flush=True)
    finally:
        for path in work.values():
            shutil.rmtree(path, ignore_errors=True)
    import torch

    import ckptfmt

    doc = {
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cores": os.cpu_count(),
        "versions": {
            "torch": torch.__version__,
            "ckptfmt": ckptfmt.__version__,
            "backend": ckptfmt.backend(),
        },
        "config": {"size": args.size, "dtype": args.dtype, "rounds": args.rounds, "targets": names},
        "summary": summaries,
        "rows": raw,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print()
    print(table(summaries))
    print(f"\nwritten: {args.out}")


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


if __name__ == "__main__":
    main()

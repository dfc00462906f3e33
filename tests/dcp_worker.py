"""One rank of a multi-process DCP test (tests/test_dcp.py spawns WORLD of these).

    python tests/dcp_worker.py RANK WORLD STORE_FILE TASKS_JSON RESULT_DIR

Joins a gloo group through a FileStore, runs the tasks in order and writes
``RESULT_DIR/rank-R.json``: for each task "ok" with details, or the error.  Tasks:

* ``save``: build scenario state (seed, world), save it with cdcp.save into ``dir``; rank 0
  also writes ``ref``: every value of the flattened state, full tensors, with ckptfmt.save
  (the bit-exact reference), and optionally consolidates ``dir`` into ``file``;
* ``load``: build the scenario with another seed (so every value differs), cdcp.load from
  ``src`` (a directory or a single file), push it into the model and optimizer, take the
  state again and compare every value with ``ref``, bit for bit;
* ``async``: cdcp.async_save, change the parameters at once, wait, load back and compare
  with the values at call time;
* ``kill``: save into ``dir`` with rank ``victim`` SIGKILLed half way through writing its file;
* ``fail``: a save that is expected to fail (the store refuses it); its error is reported.

``dir`` and ``src`` may be object-store URLs, with the task's ``storage_options``.

Scenarios: ``ddp`` (DistributedDataParallel, replicated), ``dtensor`` (DTensor parameters
sharded on dim 0 and dim 1, one replicated; a 1 MiB tensor saved with 64 KiB chunks),
``fsdp`` (FSDP2 fully_shard); all with fp32 and bf16 parameters and Adam state.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptfmt
from ckptfmt import dcp as cdcp

SMALL_CHUNKS = 64 << 10


class Net(torch.nn.Module):
    """fp32 layers, then a bf16 layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 24)
        self.b = torch.nn.Linear(24, 12)
        self.c = torch.nn.Linear(12, 6).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))).to(torch.bfloat16)).float()


class Sharded(torch.nn.Module):
    """Parameters given as DTensors: rows, columns, replicated, and a bigger one."""

    def __init__(self, mesh: Any, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        full = {
            "rows": (torch.randn(13, 6, generator=g), [Shard(0)]),
            "cols": (torch.randn(5, 12, generator=g).to(torch.bfloat16), [Shard(1)]),
            "rep": (torch.randn(7, generator=g), [Replicate()]),
            "big": (torch.randn(512, 512, generator=g), [Shard(0)]),
        }
        for name, (t, placements) in full.items():
            self.register_parameter(name, torch.nn.Parameter(distribute_tensor(t, mesh, placements)))


def build(scenario: str, seed: int, world: int) -> tuple[Any, Any, dict[str, Any]]:
    """(model, optimizer, extra values) after one deterministic training step."""
    torch.manual_seed(seed)
    x = torch.randn(8, 16)
    if scenario in ("ddp", "fsdp", "plain"):
        model: Any = Net()
        if scenario == "plain":  # one process, no process group: DCP's no_dist mode
            pass
        elif scenario == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in (model.a, model.b, model.c):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(x).sum().backward()
    else:
        mesh = init_device_mesh("cpu", (world,))
        model = Sharded(mesh, seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for p in model.parameters():
            p.grad = distribute_tensor(torch.ones(p.shape, dtype=p.dtype) * 0.5, mesh, p.placements)
    opt.step()
    opt.zero_grad()
    extra = {"step": seed, "name": f"run-{seed}", "sizes": (1, 2.5, None), "flags": [True, False]}
    return model, opt, extra


def state_of(model: Any, opt: Any, extra: dict[str, Any]) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": extra}


def full_flat(state: dict[str, Any]) -> dict[str, Any]:
    """Every value of the flattened state, DTensors gathered to full tensors (collective)."""
    flat, _ = flatten_state_dict(state)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}


def compare(state: dict[str, Any], ref_path: str) -> int:
    ref = ckptfmt.load(ref_path)
    got = full_flat(state)
    if set(got) != set(ref):
        raise AssertionError(f"keys differ: {sorted(set(got) ^ set(ref))[:5]}")
    for k, v in got.items():
        r = ref[k]
        if isinstance(v, torch.Tensor):
            if v.dtype != r.dtype or v.shape != r.shape or not torch.equal(v, r):
                raise AssertionError(f"{k}: loaded {v.dtype}{list(v.shape)} differs from the saved one")
        elif v != r:
            raise AssertionError(f"{k}: loaded {v!r}, saved {r!r}")
    return len(got)


def do_save(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    model, opt, extra = build(t["scenario"], t["seed"], world)
    state = state_of(model, opt, extra)
    chunk = SMALL_CHUNKS if t["scenario"] == "dtensor" else None
    start = time.perf_counter()
    cdcp.save(state, t["dir"], chunk_size=chunk, storage_options=t.get("storage_options"))
    took = time.perf_counter() - start
    flat = full_flat(state)
    if rank == 0:
        ckptfmt.save(flat, t["ref"])
        if t.get("file"):
            cdcp.consolidate(t["dir"], t["file"], chunk_size=SMALL_CHUNKS)
    dist.barrier()
    return {"seconds": took, "values": len(flat)}


def do_load(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    model, opt, extra = build(t["scenario"], t["seed"], world)
    state = state_of(model, opt, extra)
    reader = cdcp.Reader(t["src"], storage_options=t.get("storage_options"))
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=reader, planner=cdcp.LoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    again = state_of(model, opt, state["extra"])  # what the model and optimizer now hold
    n = compare(again, t["ref"])
    return {"values": n, "bytes_read": reader.stats.bytes, "chunks_read": reader.stats.chunks}


def do_async(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    model, opt, extra = build(t["scenario"], t["seed"], world)
    state = state_of(model, opt, extra)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in full_flat(state).items()}
    start = time.perf_counter()
    fut = cdcp.async_save(state, t["dir"], storage_options=t.get("storage_options"))
    blocked = time.perf_counter() - start
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on: the checkpoint must hold the values at call time
    fut.result(timeout=120)
    total = time.perf_counter() - start
    model2, opt2, extra2 = build(t["scenario"], t["seed"] + 1000, world)
    loaded = state_of(model2, opt2, extra2)
    cdcp.load(loaded, t["dir"], storage_options=t.get("storage_options"))
    got = full_flat(loaded)
    for k, v in expected.items():
        w = got[k]
        same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
        if not same:
            raise AssertionError(f"{k}: the async checkpoint does not hold the values at call time")
    return {"blocked": blocked, "total": total}


def die_at_first_fsync() -> None:
    """SIGKILL this rank when its save first fsyncs: its file is written, not yet committed."""

    def die(fd: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    os.fsync = die  # type: ignore[assignment]


def do_kill(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    model, opt, extra = build(t["scenario"], t["seed"], world)
    state = state_of(model, opt, extra)
    if rank == t["victim"]:
        die_at_first_fsync()
    else:
        time.sleep(0.2)
    start = time.perf_counter()
    try:
        cdcp.save(state, t["dir"])
    except ckptfmt.CheckpointError as e:
        return {"error": str(e), "error_type": type(e).__name__, "seconds": time.perf_counter() - start}
    return {"error": None}


def do_fail(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    """A save the store refuses (the test's fault proxy answers its uploads with errors), with
    `pad_mib` MiB more state so that a rank file is a multipart upload."""
    model, opt, extra = build(t["scenario"], t["seed"], world)
    state = state_of(model, opt, extra)
    state["pad"] = torch.ones(t["pad_mib"] << 18)
    try:
        cdcp.save(state, t["dir"], storage_options=t["storage_options"])
    except ckptfmt.CheckpointError as e:
        return {"error": str(e), "error_type": type(e).__name__}
    return {"error": None}


def _objects_state(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def do_manager_save(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    """CheckpointManager.save on every rank (the sharded backend); a victim may be killed."""
    model, opt, _ = build(t["scenario"], t["seed"], world)
    flat = full_flat(_objects_state(model, opt))
    if rank == 0 and t.get("ref"):
        ckptfmt.save(flat, t["ref"])
    if rank == t.get("victim"):
        die_at_first_fsync()
    manager = ckptfmt.CheckpointManager(
        t["run"], keep_last=t.get("keep_last"), storage_options=t.get("storage_options")
    )
    torch.manual_seed(1234 + rank)  # per-rank generators, restored by load_into
    expected_draw = torch.rand(3).tolist()
    torch.manual_seed(1234 + rank)
    try:
        manager.save(t["step"], {"model": model, "optim": opt}, metrics={"loss": 1.0 / t["step"]})
    except ckptfmt.CheckpointError as e:
        return {"error": str(e)}
    return {"error": None, "draw": expected_draw, "steps": [c.step for c in manager.checkpoints()]}


def do_manager_load(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    model, opt, _ = build(t["scenario"], t["seed"], world)
    manager = ckptfmt.CheckpointManager(t["run"], storage_options=t.get("storage_options"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        latest = manager.latest()
    assert latest is not None
    report = manager.load_into({"model": model, "optim": opt})
    n = compare(_objects_state(model, opt), t["ref"])
    return {
        "latest": latest.step,
        "layout": latest.layout,
        "values": n,
        "rng_restored": report.rng_restored,
        "draw": torch.rand(3).tolist(),
        "skipped_warnings": [str(w.message) for w in seen],
    }


TASKS = {
    "save": do_save,
    "load": do_load,
    "async": do_async,
    "kill": do_kill,
    "fail": do_fail,
    "msave": do_manager_save,
    "mload": do_manager_load,
}


def main() -> None:
    rank, world, store, tasks_json, out_dir = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
    )
    tasks = json.loads(tasks_json)
    warnings.filterwarnings("ignore")  # DCP's and torch's notices would drown the reports
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    results: list[dict[str, Any]] = []
    out = os.path.join(out_dir, f"rank-{rank}.json")
    for t in tasks:
        try:
            results.append({"ok": True, **TASKS[t["op"]](rank, world, t)})
        except BaseException as e:  # reported to the test, which names the task
            results.append(
                {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            )
            if t["op"] == "kill" or t.get("victim") is not None:
                break
        with open(out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out + ".tmp", out)
    if not any(t["op"] == "kill" or t.get("victim") is not None for t in tasks):
        gc.collect()  # free what holds the groups (FSDP modules are cycles) before they go
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Incremental checkpoints: a full save vs the next save against it, in one interleaved run.

The state is fp32 weights drawn like trained ones (normal, std 0.02); 95% of its
bytes are frozen (base weights under LoRA, embedding tables) and 5% change before
every save.  Each round measures, in rotating order (the incremental save after its base):

* plain:       ckptfmt.save, the ordinary full save (no digests), for reference;
* full:        ckptfmt.files.incremental.save without a base (every chunk, with digests);
* incremental: ckptfmt.files.incremental.save against that round's full file;
* incremental_again: the next step saved against the same full file, in the same process
  (the base's chunks were checked before the first reference to them: not read again);
* manager_full, manager_incremental, manager_incremental_again: steps 1, 2 and 3 through
  CheckpointManager(incremental=True), commit record and RNG capture included.

Every save is blocking and durable (fsync, rename, directory fsync).  Reported:
bytes written (file size), time (median, min, max over the rounds after a warm-up),
the process's CPU time (all its threads) for each save, and the incremental save's ratios to
both full saves.  Targets: the incremental
save writes <= 10% of the bytes and takes <= 20% of a full save's time.

    python bench/incremental.py [--size 1G] [--rounds 7] [--dirs /dev/shm,/tmp]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import machine_state, parse_size, timed  # noqa: E402
from common import summarise as med  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.files import incremental  # noqa: E402

TENSOR_BYTES = 16 << 20  # each frozen tensor; trainable ones are smaller
TARGET_BYTES, TARGET_TIME = 0.10, 0.20
NAMES = (
    "plain",
    "full",
    "incremental",
    "incremental_again",
    "manager_full",
    "manager_incremental",
    "manager_incremental_again",
)
#: the order of the saves in a round, rotated (the incremental saves need their base first)
ORDERS = (
    ("full", "plain", "incremental", "incremental_again"),
    ("plain", "full", "incremental", "incremental_again"),
    ("full", "incremental", "incremental_again", "plain"),
)
MANAGED = ("manager_full", "manager_incremental", "manager_incremental_again")


def make_state(size: int, trainable_share: float = 0.05) -> dict[str, Any]:
    """~size bytes of fp32 weights: frozen tensors and trainable ones (trainable_share of the bytes)."""
    g = torch.Generator().manual_seed(0)
    train_bytes = int(size * trainable_share)
    frozen_bytes = size - train_bytes
    frozen = {}
    for i in range(max(1, frozen_bytes // TENSOR_BYTES)):
        n = min(TENSOR_BYTES, frozen_bytes - i * TENSOR_BYTES) // 4
        frozen[f"base.{i}"] = torch.randn(n, generator=g) * 0.02
    trainable = {}
    per = max(4096, TENSOR_BYTES // 8)
    for i in range(max(1, train_bytes // per)):
        trainable[f"lora.{i}"] = torch.randn(per // 4, generator=g) * 0.02
    return {"frozen": frozen, "trainable": trainable, "step": 0}


def step(state: dict[str, Any], g: torch.Generator) -> None:
    """One optimizer step on the trainable part only."""
    with torch.no_grad():
        for t in state["trainable"].values():
            t.add_(torch.randn(t.shape, generator=g) * 1e-4)
    state["step"] += 1


def timed_cpu(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, every thread) that fn() takes."""
    cpu = time.process_time()
    wall = timed(fn)
    return wall, time.process_time() - cpu


def run_target(directory: str, state: dict[str, Any], rounds: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    work = tempfile.mkdtemp(prefix="ckptfmt-bench-inc-", dir=directory)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    cpus: dict[str, list[float]] = {n: [] for n in NAMES}
    sizes: dict[str, int] = {}
    try:
        for r in range(rounds + 1):  # round 0 warms the page cache and the allocator
            d = os.path.join(work, f"r{r}")
            for sub in ("full", "inc", "plain"):
                os.makedirs(os.path.join(d, sub))
            mgr = ckptfmt.CheckpointManager(os.path.join(d, "run"), incremental=True)
            full = os.path.join(d, "full", "state.ckpt")
            inc = os.path.join(d, "inc", "state.ckpt")
            again = os.path.join(d, "inc", "again.ckpt")
            plain = os.path.join(d, "plain", "state.ckpt")
            step(state, g)
            jobs: dict[str, Callable[[], Any]] = {
                "plain": functools.partial(ckptfmt.save, state, plain),
                "full": functools.partial(incremental.save, state, full),
                "incremental": functools.partial(incremental.save, state, inc, base=full),
                "incremental_again": functools.partial(incremental.save, state, again, base=full),
                "manager_full": functools.partial(mgr.save, 1, state),
                "manager_incremental": functools.partial(mgr.save, 2, state),
                "manager_incremental_again": functools.partial(mgr.save, 3, state),
            }
            got = {}
            manager_first = r % 2 == 1
            order = list(ORDERS[r % len(ORDERS)])
            managed = list(MANAGED)
            for name in managed + order if manager_first else order + managed:
                if name not in ("plain", "full", "manager_full"):
                    step(state, g)  # the next step: 5% of the bytes changed since the last save
                got[name] = timed_cpu(jobs[name])
            assert incremental.referenced_files(inc) == [os.path.abspath(full)]
            if r > 0:
                for name, (t, c) in got.items():
                    times[name].append(t)
                    cpus[name].append(c)
            steps = {c.step: c for c in mgr.checkpoints()}
            sizes = {
                "plain": os.path.getsize(plain),
                "full": os.path.getsize(full),
                "incremental": os.path.getsize(inc),
                "manager_full": steps[1].size,
                "manager_incremental": steps[2].size,
                "incremental_again": os.path.getsize(again),
                "manager_incremental_again": steps[3].size,
            }
            shutil.rmtree(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {
        "directory": directory,
        "bytes": sizes,
        "seconds": {k: med(v) for k, v in times.items()},
        "cpu_seconds": {k: med(v) for k, v in cpus.items()},
        "samples": {"seconds": times, "cpu_seconds": cpus},
    }
    inc_t = out["seconds"]["incremental"]["median"]
    out["ratios"] = {
        "bytes_vs_full": sizes["incremental"] / sizes["full"],
        "time_vs_full": inc_t / out["seconds"]["full"]["median"],
        "time_vs_plain": inc_t / out["seconds"]["plain"]["median"],
        "manager_bytes_vs_full": sizes["manager_incremental"] / sizes["manager_full"],
        "manager_time_vs_full": out["seconds"]["manager_incremental"]["median"]
        / out["seconds"]["manager_full"]["median"],
    }
    # the targets compare with the full save of an incremental run (a); the plain save is shown too
    q = out["ratios"]
    out["targets_met"] = all(
        (
            q["bytes_vs_full"] <= TARGET_BYTES,
            q["time_vs_full"] <= TARGET_TIME,
            q["manager_bytes_vs_full"] <= TARGET_BYTES,
            q["manager_time_vs_full"] <= TARGET_TIME,
        )
    )
    return out


def markdown(results: list[dict[str, Any]], size: int) -> str:
    lines = [
        f"State: {size / (1 << 30):.2f} GiB fp32 (std 0.02), 95% frozen, 5% changed per step; "
        f"backend {ckptfmt.backend()}; blocking, durable saves; medians over "
        f"{results[0]['seconds']['full']['n']} rounds (min-max).",
        "",
        "| target | save | bytes written | time, s | CPU, s | bytes vs full | time vs full | time vs plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for name in NAMES:
            s = res["seconds"][name]
            row = [
                res["directory"],
                name,
                f"{res['bytes'][name] / (1 << 20):.1f} MiB",
                f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})",
                f"{res['cpu_seconds'][name]['median']:.3f}",
            ]
            q = res["ratios"]
            if name == "incremental":
                row += [f"{q['bytes_vs_full']:.1%}", f"{q['time_vs_full']:.1%}", f"{q['time_vs_plain']:.1%}"]
            elif name == "manager_incremental":
                row += [f"{q['manager_bytes_vs_full']:.1%}", f"{q['manager_time_vs_full']:.1%}", ""]
            else:
                row += ["", "", ""]
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append(
        f"Targets: incremental bytes <= {TARGET_BYTES:.0%} and time <= {TARGET_TIME:.0%} of a full save: "
        + ", ".join(f"{r['directory']} {'met' if r['targets_met'] else 'NOT met'}" for r in results)
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="state size, e.g. 256M or 1G")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--dirs",
        default=f"/dev/shm,{tempfile.gettempdir()}",
        help="comma-separated directories to save into (tmpfs and a disk)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results", "incremental.json"))
    args = ap.parse_args()
    size = parse_size(args.size)
    print(f"building a {size >> 20} MiB state ...", file=sys.stderr, flush=True)
    state = make_state(size)
    # The process's heap (torch's modules) makes a full garbage collection cost ~80 ms
    # here, and one lands in whichever save allocates at that moment: move what exists
    # now out of the collector's way, for every save alike.
    gc.collect()
    gc.freeze()
    results = []
    for directory in args.dirs.split(","):
        print(f"measuring in {directory} ...", file=sys.stderr, flush=True)
        results.append(run_target(directory, state, args.rounds))
    report = {
        "size_bytes": size,
        "rounds": args.rounds,
        "backend": ckptfmt.backend(),
        "machine": machine_state({d: d for d in args.dirs.split(",")}),
        "results": results,
        "markdown": markdown(results, size),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine figures the main benchmark does not show, measured in one interleaved run:

* the price of checksums: the C writer with XXH3 on and off (tmpfs, same chunks);
* zstd + byte-shuffle on trained-like weights (normal, std 0.02): size ratio and
  compression speed per core, bf16 and fp32, and on real AdamW moments;
* non-blocking saves: time the caller is blocked vs a blocking save of the same
  state (staging pool warm), and time until durable.

    python bench/engine.py [--size 1G] [--rounds 5] [--dir DIR]
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

import state as bench_state  # noqa: E402
import torch  # noqa: E402
from run import parse_size  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import _native, tree, writer  # noqa: E402


def med(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def pieces_of(st: Any, chunk: int = 4 << 20) -> list[tuple[memoryview, int]]:
    enc = tree.encode(st)
    out = []
    for plan in enc.storages:
        data = writer.storage_bytes(plan)
        for s in range(0, plan.nbytes, chunk):
            out.append((data[s : s + chunk], plan.width))
    return out


def write_raw(
    path: str,
    pieces: list[tuple[memoryview, int]],
    checksums: bool,
    threads: int,
    compression: str | None = None,
) -> tuple[float, int]:
    # no O_TRUNC: rewriting the file in place reuses its pages, so tmpfs page
    # allocation does not drown the difference being measured
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        t = time.perf_counter()
        records, end = _native.write_chunks(
            fd, bytes(16), 0, 64, pieces, compression, None, threads, path, _checksums=checksums
        )
        elapsed = time.perf_counter() - t
    finally:
        os.close(fd)
    return elapsed, sum(r[1] for r in records)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="local-disk directory for the non-blocking test")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "engine.json"))
    args = ap.parse_args()
    if not _native.available():
        print("the C engine is not built: nothing to measure")
        return 1
    size = parse_size(args.size)
    threads = _native.default_threads()
    shm = tempfile.mkdtemp(prefix="ckptfmt-engine-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="ckptfmt-engine-", dir=args.dir or HERE)
    result: dict[str, Any] = {
        "command": " ".join(["python", "bench/engine.py", *sys.argv[1:]]),
        "threads": threads,
        "cores": os.cpu_count(),
    }
    try:
        print(f"building a {size >> 20} MiB fp32 training state ...", flush=True)
        st, _ = bench_state.build(size)
        nbytes = bench_state.tensor_bytes(st)
        result["state_bytes"] = nbytes
        pieces = pieces_of(st)

        # 1. checksums on vs off, interleaved, tmpfs
        on, off = [], []
        for r in range(args.rounds):
            order = ((True, on), (False, off)) if r % 2 == 0 else ((False, off), (True, on))  # ABBA
            for flag, sink in order:
                t, _ = write_raw(os.path.join(shm, "c.bin"), pieces, flag, threads)
                sink.append(t)
            print(
                f"checksums round {r + 1}: on {nbytes / on[-1] / 1e9:.2f} GB/s, off {nbytes / off[-1] / 1e9:.2f} GB/s",
                flush=True,
            )
        cost = [a / b - 1 for a, b in zip(on, off)]
        result["checksums"] = {
            "on_gbps": med([nbytes / t / 1e9 for t in on]),
            "off_gbps": med([nbytes / t / 1e9 for t in off]),
            "cost_fraction": med(cost),
        }

        # 2. compression of trained-like weights and real AdamW moments, one thread
        g = torch.Generator().manual_seed(0)
        n = min(size // 4, 256 << 20) // 4
        weights = torch.randn(n, generator=g) * 0.02
        moments = [t for t in (st["optim"]["state"][k]["exp_avg_sq"] for k in st["optim"]["state"])]
        samples = {
            "bf16 weights": {"w": weights.bfloat16()},
            "fp32 weights": {"w": weights},
            "fp32 AdamW exp_avg_sq": {"m": moments},
        }
        comp: dict[str, Any] = {}
        for name, sample in samples.items():
            pcs = pieces_of(sample)
            raw = sum(len(v) for v, _ in pcs)
            times, stored = [], 0
            for _ in range(args.rounds):
                t, stored = write_raw(os.path.join(shm, "z.bin"), pcs, True, 1, "zstd")
                times.append(t)
            comp[name] = {
                "raw_bytes": raw,
                "ratio": stored / raw,
                "mbps_per_core": med([raw / t / 1e6 for t in times]),
            }
            print(
                f"{name}: ratio {stored / raw:.3f}, {statistics.median(raw / t / 1e6 for t in times):.0f} MB/s "
                "on one core",
                flush=True,
            )
        result["compression"] = comp

        # 3. non-blocking vs blocking, staging pool warm
        for target, folder in (("tmpfs", shm), ("disk", disk)):
            p = os.path.join(folder, "nb.ckpt")
            ckptfmt.save(st, p, blocking=False).wait()  # warm the staging pool
            blocking, blocked, durable = [], [], []
            for r in range(args.rounds):
                t = time.perf_counter()
                ckptfmt.save(st, p)
                blocking.append(time.perf_counter() - t)
                t = time.perf_counter()
                h = ckptfmt.save(st, p, blocking=False)
                blocked.append(time.perf_counter() - t)
                h.wait()
                durable.append(time.perf_counter() - t)
                print(
                    f"non-blocking {target} round {r + 1}: blocking save {blocking[-1]:.3f}s, caller blocked "
                    f"{blocked[-1]:.3f}s, durable after {durable[-1]:.3f}s",
                    flush=True,
                )
            result[f"nonblocking_{target}"] = {
                "blocking_save_s": med(blocking),
                "caller_blocked_s": med(blocked),
                "durable_s": med(durable),
                "blocked_fraction": med([b / a for a, b in zip(blocking, blocked)]),
            }
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

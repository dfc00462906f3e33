"""Whether more writers make a new tmpfs file faster: the ceiling a durable save to tmpfs can
reach, apart from any checkpoint tool.

Each way writes the same bytes (already in memory, touched before the clock) into a new file
under --folder, fsyncs and closes it, then the file is removed:

* write x1: one thread, os.pwrite 8 MiB at a time (what dd and a single-writer save do)
* write x2: two threads, each pwriting its half (tmpfs takes the inode's lock per write)
* mapped x2: the file sized with ftruncate, mapped shared, each of two threads copying its half
  in (page faults on two cores, no inode lock; each page is zeroed by the fault, then filled)
* 2M pages x1: the file given 2 MiB pages first (ckptfmt's engine, `native.huge_file`:
  MADV_COLLAPSE of each region), then one thread's pwrite, which then only copies
* 2M pages x1, reused: the same after an untimed one in the same process whose file was
  removed just before: the 2 MiB blocks it freed are taken again, as on a host that keeps
  every free block backed (a VM whose balloon reports free 2 MiB blocks to the host makes the
  first way fault them in from the host)

A fresh process per way and round (so no way inherits another's freed pages), the ways rotated
round by round; medians of wall and CPU seconds, and GB/s.  If two writers are no faster than
one, the limit is the memory that the kernel allocates and fills, not a writer's thread.

    python bench/tmpfs_writers.py [--size 1G] [--rounds 5] [--folder /dev/shm]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import parse_size, rotated  # noqa: E402

PIECE = 8 << 20
WAYS = ["write x1", "write x2", "mapped x2", "2M pages x1", "2M pages x1, reused"]


def _pwrite_range(fd: int, data: memoryview, lo: int, hi: int) -> None:
    while lo < hi:
        lo += os.pwrite(fd, data[lo : min(hi, lo + PIECE)], lo)


def _halves(size: int) -> list[tuple[int, int]]:
    mid = (size // 2) & ~(mmap.PAGESIZE - 1)
    return [(0, mid), (mid, size)]


def _in_threads(fn: object, ranges: list[tuple[int, int]]) -> None:
    threads = [threading.Thread(target=fn, args=r) for r in ranges]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_way(way: str, size: int, folder: str) -> dict[str, float]:
    """Write `size` bytes the `way` said into a new file in `folder`: wall and CPU seconds."""
    import numpy as np

    source = np.ones(size, dtype=np.uint8)  # touched: its pages are not the way's cost
    data = memoryview(source.data).cast("B")
    if way.startswith("2M"):
        from ckptfmt.engine import native  # imported before the clock

    if way.endswith(", reused"):
        one_way(way.removesuffix(", reused"), size, folder)  # its file removed: blocks freed
        way = way.removesuffix(", reused")
    path = os.path.join(folder, f"tmpfs-writers-{os.getpid()}.bin")
    cpu0, t0 = time.process_time(), time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        if way == "write x1":
            _pwrite_range(fd, data, 0, size)
        elif way == "2M pages x1":
            native.huge_file(fd, size)
            _pwrite_range(fd, data, 0, size)
        elif way == "write x2":
            _in_threads(lambda lo, hi: _pwrite_range(fd, data, lo, hi), _halves(size))
        else:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size, mmap.MAP_SHARED) as mapped:
                target = np.frombuffer(mapped, dtype=np.uint8)
                to, src = target.ctypes.data, source.ctypes.data

                def copy(lo: int, hi: int) -> None:
                    ctypes.memmove(to + lo, src + lo, hi - lo)  # a foreign call: the GIL let go

                _in_threads(copy, _halves(size))
                del target
        os.fsync(fd)
    finally:
        os.close(fd)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    os.unlink(path)
    return {"wall_s": wall, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--folder", default="/dev/shm")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one way, its figures as JSON
    args = ap.parse_args()
    size = parse_size(args.size)
    if args.one:
        print(json.dumps(one_way(args.one, size, args.folder)))
        return
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way in rotated(WAYS, r):
            argv = [sys.executable, __file__, "--size", args.size, "--folder", args.folder, "--one", way]
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            runs[way].append(json.loads(out))
    print(
        f"{size / 2**20:.0f} MiB into {args.folder}, {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}"
    )
    for way, samples in runs.items():
        wall = statistics.median(s["wall_s"] for s in samples)
        cpu = statistics.median(s["cpu_s"] for s in samples)
        print(f"  {way:20s} wall {wall:.3f} s  CPU {cpu:.3f} s  {size / wall / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()

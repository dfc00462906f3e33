"""What putting a raw save's bytes into an upload's spool costs, apart from any store: the CPU
time of each way of handling the same bytes, 4 MiB (a default chunk) at a time.

* hash in place: the checksums' xxh3 pass over the bytes where they lie (what a save that sent
  raw chunks from the tensors' own memory would still pay)
* spool: hashed, then written with pwrite into a fresh memfd spool (storage/spool.py) at their
  offsets, each 16 MiB part's pages released once written, the spool closed (what a store save
  pays now: the engine's writes, the page faults that allocate and zero shared memory, and
  freeing the pages)
* reused buffer: hashed, then copied into one buffer of 8 parts written before the clock and
  reused round the ring (the copy alone, into memory already mapped)
* client blocks: the bytes read as the store clients read a body, 128 KiB bytes objects at a
  time (botocore's; requests reads 16 KiB), which every upload pays, the floor's too

One process, rounds interleaved, median CPU (this process's) and wall milliseconds.

    python bench/spool_cost.py [--size 256M] [--rounds 5]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import parse_size  # noqa: E402

CHUNK = 4 << 20
PART = 16 << 20
RING = 8 * PART
CLIENT_BLOCK = 128 << 10


def hashed_into_spool(fd: int, data: memoryview, part_written: Callable[[int], None]) -> None:
    """The bytes into a spool as the engine writes a raw save's: each CHUNK hashed (the
    checksums' xxh3), then written with pwrite into the spool `fd` at its offset;
    `part_written(end)` told as each PART ends (the spool's pages released, or an upload's
    part sent).  bench/stores.py's `spool up` row writes its upload's spool with it too."""
    import xxhash

    for a in range(0, len(data), CHUNK):
        piece = data[a : a + CHUNK]
        xxhash.xxh3_64_intdigest(piece, seed=a)
        os.pwrite(fd, piece, a)
        if (a + len(piece)) % PART == 0:
            part_written(a + len(piece))


def ways(data: memoryview) -> dict[str, Callable[[], None]]:
    import xxhash

    from ckptfmt.storage.spool import Spool

    size = len(data)
    ring = mmap.mmap(-1, RING)
    ring_view = memoryview(ring)
    ring_view[:] = b"\1" * RING  # mapped and touched before any clock

    def hash_in_place() -> None:
        for a in range(0, size, CHUNK):
            xxhash.xxh3_64_intdigest(data[a : a + CHUNK], seed=a)

    def spool() -> None:
        s = Spool("spool-cost", size)
        hashed_into_spool(s.fd, data, lambda end: s.release(end - PART, end))
        s.close()

    def reused_buffer() -> None:
        for a in range(0, size, CHUNK):
            piece = data[a : a + CHUNK]
            xxhash.xxh3_64_intdigest(piece, seed=a)
            at = a % RING
            ring_view[at : at + len(piece)] = piece

    def client_blocks() -> None:
        for a in range(0, size, CLIENT_BLOCK):
            bytes(data[a : a + CLIENT_BLOCK])

    return {
        "hash in place": hash_in_place,
        "spool": spool,
        "reused buffer": reused_buffer,
        "client blocks": client_blocks,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256M")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    size = parse_size(args.size) // CHUNK * CHUNK
    calls = ways(memoryview(os.urandom(size)))
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    wall: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    with open("/proc/loadavg") as f:
        print(f"{size >> 20} MiB, {args.rounds} rounds, load average {f.read().split()[:3]}")
    for name in calls:
        print(
            f"{name:14s} CPU {statistics.median(cpu[name]) * 1e3:7.1f} ms"
            f"  wall {statistics.median(wall[name]) * 1e3:7.1f} ms"
        )


if __name__ == "__main__":
    main(sys.argv[1:])

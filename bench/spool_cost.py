"""What putting a raw save's bytes into an upload's spool costs, apart from any store: the CPU
time of each way of handling the same bytes, 4 MiB (a default chunk) at a time.

* hash in place: the checksums' xxh3 pass over the bytes where they lie (what a save that sent
  raw chunks from the tensors' own memory would still pay)
* spool: hashed, then written with pwrite into a fresh memfd spool (storage/spool.py) at their
  offsets, each 16 MiB part's pages released once written, the spool closed (what a store save
  pays now: the engine's writes, the page faults that allocate and zero shared memory, and
  freeing the pages)
* page pool N: hashed, then written with pwrite into a spool of part-sized slots kept for the
  whole save (the prototype of a spool that keeps its pages for the next parts): part 1 (the
  prologue's, uploaded last) in a slot of its own, each later part in the next of N slots round
  the ring, as if the part N before it had been uploaded by then; nothing released before the
  spool is closed.  N = 9: the 8 parts an upload keeps in flight and the one being written (a
  save on the emulators, whose uploads lag behind the writer, needs 10 or 11); N = 4: uploads
  that keep up
* page pool kept: page pool 9 whose slots a save before had filled (a pool kept from one save
  to the next, not given back at each save's end): the pwrite into pages already there alone
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


def pwrite_pooled(fd: int, piece: memoryview, at: int, slots: int) -> None:
    """`piece`, the file's bytes from `at`, written where a page pool of `slots` part-sized slots
    (and part 1's own) keeps them: cut at the parts' edges."""
    while len(piece):
        part, within = divmod(at, PART)
        slot = 0 if part == 0 else 1 + (part - 1) % slots
        n = min(len(piece), PART - within)
        os.pwrite(fd, piece[:n], slot * PART + within)
        piece, at = piece[n:], at + n


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

    def page_pool(slots: int) -> Callable[[], None]:
        def run() -> None:
            s = Spool("spool-cost-pool", (1 + slots) * PART)
            for a in range(0, size, CHUNK):
                piece = data[a : a + CHUNK]
                xxhash.xxh3_64_intdigest(piece, seed=a)
                pwrite_pooled(s.fd, piece, a, slots)
            s.close()

        return run

    kept = Spool("spool-cost-kept", 10 * PART)
    kept_view = kept.view(0, kept.size)
    kept_view[:] = b"\1" * kept.size  # its pages allocated before any clock
    del kept_view

    def page_pool_kept() -> None:
        for a in range(0, size, CHUNK):
            piece = data[a : a + CHUNK]
            xxhash.xxh3_64_intdigest(piece, seed=a)
            pwrite_pooled(kept.fd, piece, a, 9)

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
        "page pool 9": page_pool(9),
        "page pool 4": page_pool(4),
        "page pool kept": page_pool_kept,
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

"""bench/stores.py compares ckptfmt's rows with their floor's on equal terms: the two rows of a
pair alternate from round to round, and every load's tensors are fresh memory, as the floor's
buffer is (no timing is asserted: only what the comparison rests on)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH)

import stores  # noqa: E402


def test_the_floor_runs_first_in_odd_rounds():
    ours, floor = object(), object()
    orders = [stores.pair_order([ours, floor], n) for n in range(4)]
    assert orders == [[ours, floor], [floor, ours], [ours, floor], [floor, ours]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_every_round_of_large_blocks_faults_its_pages_anew():
    """Blocks of 4 MiB (a load's tensors at 64 MiB) malloc'ed, filled and freed round after
    round, with a block allocated after them each round (as the rest of a round's memory is),
    fault in every page each round once fresh_memory has fixed malloc's threshold: left to
    itself, glibc raises the threshold to the first such block freed and hands later rounds
    heap pages already faulted in, and a load then paid fewer faults than the floor's fresh
    mmap, which pays them all."""
    script = textwrap.dedent(
        f"""
        import ctypes, resource, sys
        sys.path.insert(0, {BENCH!r})
        import stores
        assert stores.fresh_memory()
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]

        def one_round():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [libc.malloc(4 << 20) for _ in range(16)]
            libc.malloc(1 << 20)  # kept: the heap's top stays above the blocks
            for b in blocks:
                ctypes.memset(b, 1, 4 << 20)
            for b in blocks:
                libc.free(b)
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        print(*[one_round() for _ in range(4)])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    faults = [int(n) for n in out.stdout.split()]
    pages = 16 * (4 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert all(f >= 0.95 * pages for f in faults), (faults, pages)

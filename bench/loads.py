"""One load, as a resumed run makes it: the first thing a fresh process does, every byte then read.

    python bench/loads.py TOOL PATH        # prints one JSON line

The process imports torch (every tool returns torch tensors, and the consumer is
torch's integer sum) and the library of the tool under test only: nothing else is
loaded, allocated or faulted in before the clock starts.  The clock covers the load
and the consumer (common.read_every_byte: every byte of every tensor, summed as
int64 on all cores).  For a copy ("ckptfmt", "torch"), the consumer then runs a second
time over the now-resident tensors: that is the consumer's own cost ("consumer
alone"), measured in the same process and run.  After a verified mapping
("ckptfmt-mmap") the process also times one XXH3 pass over the same, now resident,
bytes on all cores ("verification pass"): the work that verifying adds to a mapping,
which a mapping that verifies nothing does not do.  bench/run.py adds it to each
peer's mapping time to state the limit a verified mapping can reach.

    python bench/loads.py fresh-memory NBYTES      # also fresh-memory-1

times what any copy into fresh memory pays, in a process as fresh as a load's: faulting
in NBYTES of fresh memory on all cores ("fresh-memory") or on one ("fresh-memory-1"), no
file read.

Each tool says what its load is: a copy into memory the process owns, or a zero-copy
mapping of the file, whose pages the consumer faults in.  Only like is compared
with like (bench/run.py).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import common

HERE = os.path.dirname(os.path.abspath(__file__))

# tool -> (what the load is, the file format it reads, what it calls)
LOADS: dict[str, tuple[str, str, str]] = {
    "ckptfmt": ("copy", "ckpt", "ckptfmt.load(path), every chunk verified"),
    "torch": ("copy", "pt", "torch.load(path, weights_only=True)"),
    "ckptfmt-mmap": ("mapping", "ckpt", "ckptfmt.load(path, mmap=True), every chunk verified"),
    "torch-mmap": ("mapping", "pt", "torch.load(path, weights_only=True, mmap=True)"),
    "safetensors": ("mapping", "safetensors", "safetensors.torch.load_file(path)"),
    # bench/resume.py's variants: ckptfmt.load with the huge-page choice forced either way
    "ckptfmt-huge-pages": ("copy", "ckpt", "ckptfmt.load(path), huge pages wherever free 2 MiB blocks allow"),
    "ckptfmt-4k-pages": ("copy", "ckpt", "ckptfmt.load(path), 4 KiB pages only"),
}
HUGE_PAGES = {"ckptfmt-huge-pages": "on", "ckptfmt-4k-pages": "off"}
# the floor of a copy (no file: the argument is a byte count) -> the threads that fault
FRESH = {"fresh-memory": 0, "fresh-memory-1": 1}
FRESH_CALLS = {
    "fresh-memory": "the state's bytes of fresh memory faulted in on all cores (MADV_POPULATE_WRITE), no file read",
    "fresh-memory-1": "the same on one core",
}
MAIN = ("ckptfmt", "torch", "ckptfmt-mmap", "torch-mmap", "safetensors")


def loader(tool: str) -> Callable[[str], Any]:
    """Import the tool's library (only it) and return its load function."""
    if tool in ("torch", "torch-mmap"):
        import torch

        mmap = tool == "torch-mmap"
        return lambda p: torch.load(p, weights_only=True, mmap=mmap)
    if tool == "safetensors":
        from safetensors.torch import load_file

        return load_file  # type: ignore[no-any-return]
    if tool in HUGE_PAGES:  # before ckptfmt is imported: its switch, read at each allocation
        os.environ["CKPTFMT_HUGE_PAGES"] = HUGE_PAGES[tool]
    # `from ckptfmt import load`, as `from safetensors.torch import load_file` above: the load
    # function's module is imported before the clock starts, for every tool alike (ckptfmt's
    # public names are imported on first use, so `import ckptfmt` alone left ckptfmt's
    # reader to be imported inside the timed load, 15-25 ms of CPU here, and no peer's)
    from ckptfmt import load

    mmap = tool == "ckptfmt-mmap"
    return lambda p: load(p, mmap=mmap)


def regions(state: Any) -> list[Any]:
    """Every tensor's bytes once (tied weights once), as uint8 tensors."""
    import torch

    out, seen = [], set()
    for t in common.walk_tensors(state):
        if t.numel() and t.is_contiguous():
            flat = t.detach().reshape(-1).view(torch.uint8)
            if (flat.data_ptr(), flat.numel()) not in seen:
                seen.add((flat.data_ptr(), flat.numel()))
                out.append(flat)
    return out


def verification_views(state: Any) -> list[Any]:
    """Every byte of `state` once, as 4 MiB numpy views, so that the engine's threads share the
    verification pass evenly."""
    piece = 4 << 20
    return [r[i : i + piece].numpy() for r in regions(state) for i in range(0, r.numel(), piece)]


def verification_pass(views: list[Any]) -> None:
    """One XXH3 pass over the views with ckptfmt's engine on all its threads."""
    from ckptfmt.engine import native

    native.content_digests(views, native.default_threads())


MADV_POPULATE_WRITE = 23  # Linux 5.14 and later


def fault_in(nbytes: int, threads: int) -> float:
    """Seconds to fault in `nbytes` of fresh anonymous memory on `threads` threads, each faulting
    its share 256 KiB at a time with MADV_POPULATE_WRITE (a write of one byte per page where the
    kernel lacks it): what a copy into fresh memory cannot avoid paying.  The memory is unmapped
    after the clock stops."""
    import ctypes
    import mmap
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc maps it
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    step = 256 << 10
    share = -(-nbytes // threads // page) * page

    def fault(lo: int, hi: int) -> None:
        for at in range(lo, hi, step):
            n = min(step, hi - at)
            if libc.madvise(base + at, n, MADV_POPULATE_WRITE) != 0:
                ctypes.memset(base + at, 0, n)  # old kernel: touch the pages instead

    workers = [
        threading.Thread(target=fault, args=(lo, min(lo + share, nbytes))) for lo in range(0, nbytes, share)
    ]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    took = time.perf_counter() - t
    m.close()
    return took


def _cpu() -> float:
    """CPU seconds this process has used, its threads' included (user and system)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(tool: str, path: str) -> dict[str, Any]:
    """The measurement itself, in this (fresh) process."""
    import torch

    if tool in FRESH:  # `path` is the byte count
        threads = FRESH[tool] or os.cpu_count() or 1
        return {"tool": tool, "seconds": fault_in(int(path), threads), "threads": threads}

    torch.set_num_threads(os.cpu_count() or 1)
    load = loader(tool)
    c0 = _cpu()
    t0 = time.perf_counter()
    state = load(path)
    t1 = time.perf_counter()
    common.read_every_byte(state)
    t2 = time.perf_counter()
    out: dict[str, Any] = {"tool": tool, "seconds": t2 - t0, "load_seconds": t1 - t0, "read_seconds": t2 - t1}
    # the CPU time of the load and consumer, this process's threads included: on a machine
    # shared with other work it moves less than the clock
    out["cpu_seconds"] = _cpu() - c0
    if LOADS[tool][0] == "copy":
        out["consumer_seconds"] = common.timed(common.read_every_byte, state)
    if tool == "ckptfmt-mmap":
        # the views are made, and the collector's pending work done, before the clock starts:
        # the pass times hashing only
        views = verification_views(state)
        gc.collect()
        c = _cpu()
        out["hash_seconds"] = common.timed(verification_pass, views)
        out["hash_cpu_seconds"] = _cpu() - c
    out["peak_rss"] = common.status_bytes("VmHWM")
    return out


def measure(tool: str, path: str, timeout: float = 900) -> dict[str, Any]:
    """Run one load in a fresh process; its measurement."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), tool, path],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=common.installed_env(),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"load {tool} of {path} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def dd_read(path: str) -> dict[str, Any]:
    """dd reading a file to /dev/null (4 MiB blocks): what the storage gives a plain reader."""
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    return {"tool": "dd", "seconds": time.perf_counter() - t, "bytes": os.path.getsize(path)}


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))

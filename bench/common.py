"""What every benchmark script shares: sizes, summaries, files, the consumer, the machine's state.

Imports nothing but the standard library at module level, so that a measurement
process (bench/loads.py) can use it and still import only the tool it measures;
torch is imported inside the functions that need it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# -- sizes, clocks and summaries ------------------------------------------------------------


def parse_size(text: str) -> int:
    """'256M', '1G', '1GiB', '4096' -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def normal_state(nbytes: int) -> dict[str, object]:
    """A model-like state of `nbytes` of fp32 in 8 tensors, normal with std 0.02, from a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = nbytes // 4
    parts = 8
    return {f"layer{i}.weight": torch.empty(n // parts).normal_(0, 0.02, generator=g) for i in range(parts)}


def summarise(values: list[float]) -> dict[str, float]:
    """Median, min, max and count of a list of measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds that fn(*args) takes; its result is freed after the clock stops."""
    t = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - t
    del out
    return took


def rotated(items: list[Any], turn: int) -> list[Any]:
    """items started at position `turn` (mod len): each round meets the machine in another order."""
    k = turn % len(items) if items else 0
    return items[k:] + items[:k]


def command_line(script: str, argv: list[str]) -> str:
    """The command that reproduces a run, as one would type it from the repository root."""
    rel = os.path.relpath(
        os.path.abspath(script), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    return " ".join(shlex.quote(a) for a in ["python", rel, *argv])


def write_json(path: str, doc: Any, echo: bool = True) -> None:
    """Write a result document (its folder made if need be), and echo it unless told not to."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if echo:
        print(json.dumps(doc, indent=1))


# -- fresh processes -------------------------------------------------------------------------

#: where fresh measurement processes keep the bytecode of the modules they import
PYCACHE = os.path.join(tempfile.gettempdir(), "ckptfmt-bench-pycache")


def installed_env(pycache: str = PYCACHE) -> dict[str, str]:
    """The environment of a fresh measurement process: its modules' bytecode cached (under
    `pycache`, out of the source tree) as an installed package's is.  Where
    PYTHONDONTWRITEBYTECODE is set, ckptfmt's modules (imported by the first save or load)
    would otherwise be compiled anew in every process, while torch's and safetensors' were
    compiled when they were installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def cache_bytecode(pycache: str = PYCACHE) -> None:
    """Compile ckptfmt's modules into `pycache` before any process is timed, as installing a
    wheel does."""
    import ckptfmt

    package = os.path.dirname(os.path.abspath(ckptfmt.__file__))
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", package],
        check=True,
        capture_output=True,
        env=installed_env(pycache),
    )


# -- files -----------------------------------------------------------------------------------


def fsync_path(path: str) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(path: str) -> list[str]:
    """The file itself, or every file below a directory."""
    if os.path.isdir(path):
        return [os.path.join(r, f) for r, _d, fs in os.walk(path) for f in fs]
    return [path]


def fsync_tree(path: str) -> None:
    """fsync a file, or every file under a directory, and the directory holding it."""
    for p in [*files_under(path), os.path.dirname(os.path.abspath(path))]:
        fsync_path(p)


def tree_size(path: str) -> int:
    """Bytes of a file, or of every file under a directory."""
    return sum(os.path.getsize(p) for p in files_under(path))


def evict(path: str) -> None:
    """Drop one file's pages from the page cache: fsync, then posix_fadvise(DONTNEED).

    Per file, unlike writing /proc/sys/vm/drop_caches, which empties every cache of
    the machine and leaves it slow to fault pages for a while afterwards; that would
    bias whatever row comes next.
    """
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path: str) -> float | None:
    """Share of a file's pages in the page cache (mincore over a mapping of it); None if unknown."""
    size = os.path.getsize(path)
    libc_name = ctypes.util.find_library("c")
    if not libc_name or size == 0:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(b & 1 for b in bytes(vec)) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


# -- this process's memory -------------------------------------------------------------------


def status_bytes(field: str) -> int:
    """A /proc/self/status memory figure (VmRSS, VmHWM, ...) in bytes."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    """Restart the kernel's RSS high-water mark (VmHWM) from the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# -- this process's CPU time ---------------------------------------------------------------


def _thread_schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of the calling thread, from
    /proc/thread-self/schedstat (zeros where the kernel does not keep scheduler statistics)."""
    fields = _read("/proc/thread-self/schedstat").split()
    if len(fields) < 2:
        return 0.0, 0.0
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9


def cpu_snapshot() -> dict[str, float]:
    """This process's CPU time so far (every thread, ended ones included: getrusage), the
    calling thread's own, and how long the calling thread has waited for a CPU; with
    cpu_spent, what an operation cost besides its clock."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    thread = resource.getrusage(resource.RUSAGE_THREAD)
    _, waited = _thread_schedstat()
    return {
        "user": me.ru_utime,
        "sys": me.ru_stime,
        "caller": thread.ru_utime + thread.ru_stime,
        "caller_runq_wait": waited,
        "voluntary_switches": float(me.ru_nvcsw),
        "preempted": float(me.ru_nivcsw),
    }


def children_cpu() -> dict[str, float]:
    """CPU time of this process's waited-for children so far (dd), shaped as cpu_snapshot's."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "user": ch.ru_utime,
        "sys": ch.ru_stime,
        "caller": ch.ru_utime + ch.ru_stime,
        "caller_runq_wait": 0.0,
        "voluntary_switches": float(ch.ru_nvcsw),
        "preempted": float(ch.ru_nivcsw),
    }


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What happened between two snapshots, as a sample's fields: CPU seconds of the process
    (`cpu_s` = user + sys), of the calling thread and of every other thread, the calling
    thread's wait for a CPU, and the context switches (voluntary: it blocked; preempted: the
    scheduler gave its CPU to another task)."""
    d = {k: after[k] - before[k] for k in before}
    cpu = d["user"] + d["sys"]
    return {
        "cpu_s": cpu,
        "user_s": d["user"],
        "sys_s": d["sys"],
        "caller_cpu_s": d["caller"],
        "other_threads_cpu_s": max(0.0, cpu - d["caller"]),
        "caller_runq_wait_s": d["caller_runq_wait"],
        "voluntary_switches": d["voluntary_switches"],
        "preempted": d["preempted"],
    }


# -- states ----------------------------------------------------------------------------------


def walk_tensors(obj: Any, unwrap: Callable[[Any], Any] = lambda o: o) -> Iterator[Any]:
    """Every tensor of a nested state (dicts, lists, tuples), in order; `unwrap` applied first."""
    import torch

    obj = unwrap(obj)
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from walk_tensors(v, unwrap)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from walk_tensors(v, unwrap)


def empty_like_state(obj: Any, device: str | None = None) -> Any:
    """The state with every tensor replaced by zeros like it (on `device`: default, its own)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj, device=device)
    if isinstance(obj, dict):
        return type(obj)((k, empty_like_state(v, device)) for k, v in obj.items())
    if isinstance(obj, list):
        return [empty_like_state(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(empty_like_state(v, device) for v in obj)
    return obj


def read_every_byte(state: Any) -> int:
    """The consumer: a multi-threaded integer sum over every byte of every tensor, once per region.

    Each tensor's bytes are summed as int64 where they are 8-byte aligned and as uint8
    at the unaligned head and tail, so any dtype, size and offset is read whole.  A
    region shared by several tensors (tied weights) is read once, as a consumer that
    walks a model's parameters would.
    """
    import torch

    total = 0
    seen: set[tuple[int, int]] = set()
    for t in walk_tensors(state):
        if not t.numel():
            continue
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        flat = t.reshape(-1).view(torch.uint8)
        key = (flat.data_ptr(), flat.numel())
        if key in seen:
            continue
        seen.add(key)
        head = min((-flat.storage_offset()) % 8, flat.numel())  # torch views int64 at offsets of 8
        body = (flat.numel() - head) // 8 * 8
        if head:
            total += int(flat[:head].sum())
        if body:
            total += int(flat[head : head + body].view(torch.int64).sum())
        if head + body < flat.numel():
            total += int(flat[head + body :].sum())
    return total


# -- the machine -----------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def meminfo() -> dict[str, int]:
    """MemTotal, MemFree, MemAvailable, Cached, Dirty and the huge-page counters, in bytes."""
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemFree", "MemAvailable", "Cached", "Dirty", "AnonHugePages", "Shmem"):
            out[name] = int(rest.split()[0]) * 1024
    return out


# virtio-balloon feature bits (virtio spec 5.5.3): what the host may take back from the guest
BALLOON_FEATURES = {
    0: "must_tell_host",
    1: "stats_vq",
    2: "deflate_on_oom",
    3: "free_page_hint",
    4: "page_poison",
    5: "free_page_reporting",
}


def balloon_state() -> dict[str, Any]:
    """Whether a virtio balloon is bound, and the features it negotiated (free page reporting above all)."""
    driver = "/sys/bus/virtio/drivers/virtio_balloon"
    if not os.path.isdir(driver):
        return {"present": False}
    devices = [d for d in os.listdir(driver) if d.startswith("virtio")]
    features = {}
    for d in devices:
        bits = _read(os.path.join(driver, d, "features"))
        features[d] = {
            "bits": bits,
            "named": [name for bit, name in BALLOON_FEATURES.items() if len(bits) > bit and bits[bit] == "1"],
        }
    reporting = any("free_page_reporting" in f["named"] for f in features.values())
    return {"present": bool(devices), "devices": features, "free_page_reporting": reporting}


def filesystem_of(path: str) -> dict[str, str]:
    """The filesystem type and device a path lives on (df -T)."""
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
    fields = out[-1].split() if len(out) > 1 else []
    return {
        "path": path,
        "device": fields[0] if fields else "?",
        "type": fields[1] if len(fields) > 1 else "?",
    }


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def machine_state(targets: dict[str, str] | None = None) -> dict[str, Any]:
    """What the figures depend on: CPUs, memory free and available, THP, the balloon, filesystems."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory": meminfo(),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "balloon": balloon_state(),
        "kernel": platform.release(),
        "loadavg": _read("/proc/loadavg"),
        "python": platform.python_version(),
        "ckptfmt_env": {k: v for k, v in os.environ.items() if k.startswith("CKPTFMT_")},
        "targets": {name: filesystem_of(path) for name, path in (targets or {}).items()},
    }


def versions() -> dict[str, str]:
    """Versions of everything measured (a library that is not installed says so)."""
    out = {}
    for mod in ("ckptfmt", "torch", "numpy", "safetensors", "zstandard"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except ImportError:
            out[mod] = "not installed"
    if out["ckptfmt"] != "not installed":
        import ckptfmt

        out["ckptfmt_backend"] = ckptfmt.backend()
    dd = subprocess.run(["dd", "--version"], capture_output=True, text=True).stdout.splitlines()
    out["dd"] = dd[0] if dd else "?"
    out["python_executable"] = sys.executable
    return out

"""One benchmark process: one tool, one target, all its operations, in order.

    python bench/worker.py '{"tool": ..., "dir": ..., "cache": ..., "cold": true}'

Prints one JSON document: per operation the seconds, the peak extra RSS (the
high-water mark during the operation minus the RSS before it; the kernel's
high-water mark is reset before each operation) and the file size.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tools  # noqa: E402

import ckptfmt  # noqa: E402


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def drop_cache(path: str) -> str:
    """Evict `path` from the page cache: drop_caches as root, else fadvise per file."""
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        pass
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def measure(fn: Any, *args: Any) -> tuple[float, int, Any]:
    gc.collect()
    _reset_peak()
    before = _status("VmRSS")
    t = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t
    peak = _status("VmHWM")
    return seconds, max(0, peak - before), out


def run_dd(spec: dict[str, Any]) -> list[dict[str, Any]]:
    path = os.path.join(spec["dir"], "dd.bin")
    nbytes = spec["bytes"]
    count = max(1, nbytes // (4 << 20))
    res = []
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    res.append({"op": "save", "seconds": time.perf_counter() - t, "rss": 0, "bytes": os.path.getsize(path)})
    for op, cold in (("load_cold", True), ("load_warm", False)):
        if cold:
            drop_cache(path)
        t = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
        res.append({"op": op, "seconds": time.perf_counter() - t, "rss": 0})
    os.unlink(path)
    return res


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["tool"] == "dd":
        print(json.dumps({"results": run_dd(spec)}))
        return
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    tool = tools.TOOLS[spec["tool"]]()
    state = ckptfmt.load(spec["cache"])
    # the template for load_into is made only where it is used: holding it all along
    # would need a third copy of the state's memory, which an 8 GiB state does not have
    skeleton = tools.empty_like_state(state, "meta")
    path = tool.path(spec["dir"])
    tool.remove(path)
    results: list[dict[str, Any]] = []
    evict = ""

    def record(op: str, fn: Any, *args: Any) -> None:
        seconds, rss, out = measure(fn, *args)
        results.append({"op": op, "seconds": seconds, "rss": rss})
        del out

    record("save", tool.save, state, path)
    results[-1]["bytes"] = tool.size(path)
    if spec["tool"] == "ckptfmt":
        # non-blocking: warm the staging pool once, then time the caller and the commit
        ckptfmt.save(state, path, blocking=False).wait()
        gc.collect()
        _reset_peak()
        before = _status("VmRSS")
        t = time.perf_counter()
        handle = ckptfmt.save(state, path, blocking=False)
        blocked = time.perf_counter() - t
        handle.wait()
        durable = time.perf_counter() - t
        rss = max(0, _status("VmHWM") - before)
        results.append({"op": "save_nb_blocked", "seconds": blocked, "rss": rss})
        results.append({"op": "save_nb_durable", "seconds": durable, "rss": rss})
    del state
    gc.collect()
    loads = [op for op in tool.ops if op in ("load", "load_mmap")]
    for op in loads:
        for temp in ("cold", "warm"):
            if temp == "cold":
                evict = drop_cache(path)
            if spec["tool"] == "dcp":
                record(
                    f"{op}_{temp}", lambda p: tool.load_into(p, tools.empty_like_state(skeleton, "cpu")), path
                )
            else:
                record(f"{op}_{temp}", getattr(tool, op), path)
    if "lazy" in tool.ops:
        drop_cache(path)
        record("lazy", tool.lazy, path)
    if "load_into" in tool.ops:
        template = tools.empty_like_state(skeleton, "cpu")  # zero-filled: resident, as a live model is
        drop_cache(path)
        record("load_into", tool.load_into, path, template)
        del template
    if "verify" in tool.ops:
        for temp in ("cold", "warm"):
            if temp == "cold":
                drop_cache(path)
            record(f"verify_{temp}", tool.verify, path)
    tool.remove(path)
    print(json.dumps({"results": results, "evict": evict}))


if __name__ == "__main__":
    main()

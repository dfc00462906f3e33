"""Save measurements: a fresh process loads the state with torch, then one tool saves it to each folder.

    python bench/worker.py '{"tool": ..., "dirs": [...], "source": STATE.pt}'

The state comes from a torch file (torch.load, a copy), so the process imports
torch and the saving tool's library only.  It saves to each folder in the order
given (bench/run.py rotates it from round to round).  Prints one JSON document: per operation
the seconds, the peak extra RSS (the high-water mark during the operation minus
the RSS before it; the kernel's high-water mark is reset before each operation),
the file size and, for blocking saves, the CPU time (common.cpu_spent: the process's,
the calling thread's and its wait for a CPU, the other threads', context switches), so a
run on a busy machine shows whether a tool works more per byte or waits more.  For ckptfmt also the non-blocking save: how long the caller is
blocked, and how long until the checkpoint is durable (staging pool warmed once).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import common
import tools


def measure(fn: Any, *args: Any) -> dict[str, Any]:
    """Seconds, peak extra RSS and CPU time (common.cpu_spent) of fn(*args)."""
    gc.collect()
    common.reset_peak_rss()
    before = common.status_bytes("VmRSS")
    cpu = common.cpu_snapshot()
    t = time.perf_counter()
    fn(*args)
    seconds = time.perf_counter() - t
    spent = common.cpu_spent(cpu, common.cpu_snapshot())
    return {"seconds": seconds, "rss": max(0, common.status_bytes("VmHWM") - before), **spent}


def nonblocking(state: Any, path: str) -> list[dict[str, Any]]:
    """ckptfmt's non-blocking save: the caller's stall, and the time until durable."""
    import ckptfmt

    ckptfmt.save(state, path, blocking=False).wait()  # the staging pool, as after a first save
    gc.collect()
    common.reset_peak_rss()
    before = common.status_bytes("VmRSS")
    t = time.perf_counter()
    handle = ckptfmt.save(state, path, blocking=False)
    blocked = time.perf_counter() - t
    handle.wait()
    durable = time.perf_counter() - t
    rss = max(0, common.status_bytes("VmHWM") - before)
    return [
        {"op": "save_nb_blocked", "seconds": blocked, "rss": rss},
        {"op": "save_nb_durable", "seconds": durable, "rss": rss},
    ]


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    state = torch.load(spec["source"], weights_only=True)
    tool = tools.TOOLS[spec["tool"]]()
    tool.prepare()  # its imports, before the clock
    results: dict[str, list[dict[str, Any]]] = {}
    for folder in spec["dirs"]:
        path = tool.path(folder)
        tool.remove(path)
        results[folder] = [{"op": "save", **measure(tool.save, state, path), "bytes": tool.size(path)}]
        if spec["tool"] == "ckptfmt":
            results[folder] += nonblocking(state, path)
        tool.remove(path)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()

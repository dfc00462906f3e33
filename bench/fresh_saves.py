"""Durable saves of one state by several ways, each in fresh processes, interleaved round by round:
the first save of a fresh process (as bench/run.py's save rows) and a second one right after it
(the first file removed in between, so the memory it freed is taken again).

    python bench/fresh_saves.py --state STATE.pt --folder /dev/shm/x --rounds 7 \\
        main=ckptfmt@/path/to/main-checkout branch=ckptfmt@. on=ckptfmt@.+CKPTFMT_HUGE_PAGES=on \\
        safetensors torch

A way is NAME=TOOL[@CHECKOUT][+VAR=VALUE...]: a tool of bench/tools.py, the checkout whose
ckptfmt it imports (PYTHONPATH; default: as installed) and environment variables; a bare TOOL
names itself.  The state is a torch file (bench/run.py writes one: state.pt in its folders).
Prints each process's figures as JSON lines, then per way the medians (min-max) of wall and
CPU seconds (user + system, every thread: on a shared machine the steadier figure).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def child(tool_name: str, state_path: str, folder: str, saves: int) -> None:
    """Load the state, then `saves` saves of it to `folder`, each timed; JSON lines out."""
    sys.path.insert(0, HERE)
    import tools
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    state = torch.load(state_path, weights_only=True)
    tool = tools.TOOLS[tool_name]()
    tool.prepare()
    for _ in range(saves):
        path = tool.path(folder)
        tool.remove(path)
        gc.collect()
        before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        tool.save(state, path)
        wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(json.dumps({"wall_s": wall, "cpu_s": cpu, "sys_s": after.ru_stime - before.ru_stime}))
        tool.remove(path)


def parse_way(text: str) -> tuple[str, str, str | None, dict[str, str]]:
    """NAME=TOOL[@CHECKOUT][+VAR=VALUE...] -> (name, tool, checkout, environment)."""
    head, *assignments = text.split("+")
    name, _, spec = head.partition("=") if "=" in head else (head, "", head)
    tool, _, checkout = spec.partition("@")
    env = dict(a.split("=", 1) for a in assignments)
    return name, tool, os.path.abspath(checkout) if checkout else None, env


def run_way(
    way: tuple[str, str, str | None, dict[str, str]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    _name, tool, checkout, extra = way
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CKPTFMT_HUGE_PAGES")}
    env.update(extra)
    if checkout:
        env["PYTHONPATH"] = checkout
    argv = [sys.executable, __file__, "--child", tool, "--state", args.state, "--folder", args.folder]
    out = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{way}: {out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ways", nargs="*")
    ap.add_argument("--state", required=True)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.state, args.folder, 2)
        return
    ways = [parse_way(w) for w in args.ways]
    runs: dict[str, list[list[dict[str, Any]]]] = {w[0]: [] for w in ways}
    load_before = open("/proc/loadavg").read().split()[:3]
    for r in range(args.rounds):
        k = r % len(ways)
        for way in ways[k:] + ways[:k]:
            saves = run_way(way, args)
            runs[way[0]].append(saves)
            print(json.dumps({"round": r, "way": way[0], "saves": saves}), flush=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"# {args.folder}, {args.rounds} rounds, load average before {load_before}, after {load_after}")
    for i, label in ((0, "first save of a fresh process"), (1, "second save, right after the first")):
        print(f"## {label}: median (min-max)")
        for name, samples in runs.items():
            wall = [s[i]["wall_s"] for s in samples]
            cpu = [s[i]["cpu_s"] for s in samples]
            print(
                f"  {name:14s} wall {statistics.median(wall):.3f} ({min(wall):.3f}-{max(wall):.3f}) s"
                f"  CPU {statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) s"
            )


if __name__ == "__main__":
    main()

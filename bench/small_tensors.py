"""Many small tensors: the cost per tensor of a load, ckptfmt against safetensors and torch.

    python bench/small_tensors.py                          # 10^3, 10^4, 10^5 tensors, 3 rounds
    python bench/small_tensors.py --counts 1000,10000 --rounds 5
    python bench/small_tensors.py --groups into              # only the load_into rows and their peers

The state is N fp32 tensors of 32x32 (4 KiB each; MoE experts, per-parameter optimizer
states and LoRA adapters look like this), saved once per tool on tmpfs (`--dir`, default
/dev/shm).  Each measurement runs in a fresh process that imports torch and the tool's entry
point (`from ckptfmt import load`, `from safetensors.torch import load_file`), builds the targets of the `into` rows, and then times one call; the clock covers the
call alone, and so does a second figure, the CPU time the process used during it (threads
included), which a busy machine moves less than the clock.  A round runs every tool at every count once, in an order rotated from round to
round, after one untimed warm-up process per tool (which caches bytecode as an installed
package has it); figures are medians over rounds, and each ratio (peer time / ckptfmt time) is taken
within a round, then its median reported.

What each row does:

- copies: ckptfmt.load (every chunk read and its checksum verified), torch.load;
- mappings: ckptfmt.load(mmap=True) (every chunk verified through the mapping), safetensors
  load_file and torch.load(mmap=True), which map the file and read nothing until used;
- into existing tensors: ckptfmt.load_into (atomic: every chunk verified, then read into the
  targets), safetensors load_file then copy_ into the targets (what safetensors'
  load_model does), torch.load then copy_.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import command_line, installed_env, machine_state, rotated, versions, write_json  # noqa: E402

#: tool -> (peer group, the file it reads)
TOOLS = {
    "ckptfmt.load": ("copy", "ckpt"),
    "torch.load": ("copy", "pt"),
    "ckptfmt.load(mmap=True)": ("map", "ckpt"),
    "safetensors.load_file": ("map", "safetensors"),
    "torch.load(mmap=True)": ("map", "pt"),
    "ckptfmt.load_into": ("into", "ckpt"),
    "safetensors.load_file+copy_": ("into", "safetensors"),
    "torch.load+copy_": ("into", "pt"),
}
#: the ckptfmt row each peer row is compared with
OURS = {"copy": "ckptfmt.load", "map": "ckptfmt.load(mmap=True)", "into": "ckptfmt.load_into"}


def key_of(i: int) -> str:
    return f"layers.{i // 64}.experts.{i % 64}.w"


def make_files(folder: str, n: int) -> dict[str, str]:
    """The state of `n` tensors saved by each tool (once: kept for later runs)."""
    import safetensors.torch
    import torch

    import ckptfmt

    paths = {ext: os.path.join(folder, f"small-{n}.{ext}") for ext in ("ckpt", "safetensors", "pt")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    g = torch.Generator().manual_seed(0)
    state = {key_of(i): torch.randn(32, 32, generator=g) for i in range(n)}
    ckptfmt.save(state, paths["ckpt"])
    safetensors.torch.save_file(state, paths["safetensors"])
    torch.save(state, paths["pt"])
    return paths


def _cpu() -> float:
    """CPU seconds this process has used, its threads' included (user and system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(tool: str, path: str, n: int) -> tuple[float, float]:
    """Seconds one call of `tool` takes on `path`, and the CPU seconds the process used meanwhile
    (run in a fresh process: --measure).  On a machine shared with other work the CPU time
    moves less than the clock: it does not count the time others' work held the cores."""
    import torch

    targets = {key_of(i): torch.zeros(32, 32) for i in range(n)} if TOOLS[tool][0] == "into" else {}
    # each tool's entry point imported before the clock, as a user's `from ... import` does:
    # ckptfmt's public names are imported on first use, so `import ckptfmt` alone would leave
    # its reader's modules to be imported inside the timed call, and no peer's
    if tool.startswith("ckptfmt"):
        from ckptfmt import load, load_into
    elif tool.startswith("safetensors"):
        from safetensors.torch import load_file
    cpu = _cpu()
    t = time.perf_counter()
    if tool == "ckptfmt.load":
        out: Any = load(path)
    elif tool == "ckptfmt.load(mmap=True)":
        out = load(path, mmap=True)
    elif tool == "ckptfmt.load_into":
        out = load_into(path, targets)
    elif tool == "safetensors.load_file":
        out = load_file(path)
    elif tool == "safetensors.load_file+copy_":
        out = load_file(path)
        for k, v in out.items():
            targets[k].copy_(v)
    elif tool == "torch.load":
        out = torch.load(path)
    elif tool == "torch.load(mmap=True)":
        out = torch.load(path, mmap=True)
    else:  # torch.load+copy_
        out = torch.load(path)
        for k, v in out.items():
            targets[k].copy_(v)
    took = time.perf_counter() - t
    used = _cpu() - cpu
    assert out is not None
    return took, used


def run_one(tool: str, path: str, n: int, pycache: str) -> tuple[float, float]:
    """One measurement in a fresh process.  Its modules' bytecode is cached (under `pycache`,
    out of the source tree) as an installed package's is: where PYTHONDONTWRITEBYTECODE is
    set, ckptfmt's modules (lazily imported by the first load) would otherwise be compiled
    anew in every process, while torch's and safetensors' were compiled when installed."""
    env = installed_env(pycache)
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", tool, path, str(n)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["seconds"]), float(result["cpu_seconds"])


#: the safetensors row each ckptfmt row is also compared with
SAFETENSORS = {
    "copy": "safetensors.load_file",
    "map": "safetensors.load_file",
    "into": "safetensors.load_file+copy_",
}


def _ratio(times: dict[tuple[str, int], list[float]], peer: str, ours: str, n: int) -> float:
    """The median over rounds of peer time / ckptfmt time (above 1: ckptfmt is faster)."""
    return statistics.median(p / o for p, o in zip(times[(peer, n)], times[(ours, n)]))


def report(counts: list[int], times: dict[tuple[str, int], list[float]], tools: list[str]) -> list[str]:
    """The table: per-tensor microseconds (median) and ratios (peer time / ckptfmt time, the
    median of per-round ratios): each peer against ckptfmt's row of its group, and each
    ckptfmt row against safetensors' row (its load_file, or load_file + copy_ for `into`)."""
    lines = [
        "| tool | group | " + " | ".join(f"{n} tensors: us/tensor (ratio)" for n in counts) + " |",
        "|---|---|" + "---|" * len(counts),
    ]
    for tool in tools:
        group = TOOLS[tool][0]
        cells = []
        for n in counts:
            us = statistics.median(times[(tool, n)]) / n * 1e6
            if tool == OURS[group]:
                cells.append(f"{us:.1f} (safetensors {_ratio(times, SAFETENSORS[group], tool, n):.2f}x)")
            else:
                cells.append(f"{us:.1f} ({_ratio(times, tool, OURS[group], n):.2f}x)")
        lines.append(f"| {tool} | {group} | " + " | ".join(cells) + " |")
    return lines


def reprint(path: str) -> None:
    """The table of a saved result (--table)."""
    with open(path) as f:
        doc = json.load(f)
    for field in ("seconds", "cpu_seconds"):
        times: dict[tuple[str, int], list[float]] = {}
        for name, ts in doc.get(field, {}).items():
            tool, n = name.rsplit(" @ ", 1)
            times[(tool, int(n))] = ts
        if times:
            print("CPU time:" if field == "cpu_seconds" else "Time:")
            tools = [tool for tool in TOOLS if any(t == tool for t, _ in times)]
            print("\n".join(report(sorted({n for _, n in times}), times, tools)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1000,10000,100000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", default="copy,map,into", help="peer groups to run: copy, map, into")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "small_tensors.json"))
    ap.add_argument("--table", metavar="JSON", help="print the table of a saved result and exit")
    ap.add_argument("--measure", nargs=3, metavar=("TOOL", "PATH", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        tool, path, n = args.measure
        took, used = measure(tool, path, int(n))
        print(json.dumps({"seconds": took, "cpu_seconds": used}))
        return
    if args.table:
        reprint(args.table)
        return
    counts = [int(c) for c in args.counts.split(",")]
    groups = set(args.groups.split(","))
    if not groups <= set(OURS):
        ap.error(f"--groups takes {', '.join(OURS)}, not {args.groups!r}")
    tools = [tool for tool, (group, _) in TOOLS.items() if group in groups]
    folder = os.path.join(args.dir, "ckptfmt-small-tensors")
    os.makedirs(folder, exist_ok=True)
    files = {n: make_files(folder, n) for n in counts}
    before = machine_state({"files": folder})
    runs = [(tool, n) for n in counts for tool in tools]
    times: dict[tuple[str, int], list[float]] = {r: [] for r in runs}
    cpus: dict[tuple[str, int], list[float]] = {r: [] for r in runs}
    pycache = os.path.join(folder, "pycache")
    for tool in tools:  # a warm-up, not timed: bytecode compiled and cached
        run_one(tool, files[counts[0]][TOOLS[tool][1]], counts[0], pycache)
    for r in range(args.rounds):
        for tool, n in rotated(runs, r * (len(tools) + 1)):
            took, used = run_one(tool, files[n][TOOLS[tool][1]], n, pycache)
            times[(tool, n)].append(took)
            cpus[(tool, n)].append(used)
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    lines = report(counts, times, tools)
    cpu_lines = ["CPU time of the measuring process (threads included):", *report(counts, cpus, tools)]
    print("\n".join([*lines, "", *cpu_lines]))
    write_json(
        args.out,
        {
            "command": command_line(__file__, sys.argv[1:]),
            "versions": versions(),
            "machine_before": before,
            "machine_after": machine_state({"files": folder}),
            "seconds": {f"{tool} @ {n}": ts for (tool, n), ts in times.items()},
            "cpu_seconds": {f"{tool} @ {n}": ts for (tool, n), ts in cpus.items()},
            "table": lines,
            "cpu_table": cpu_lines,
        },
        echo=False,
    )


if __name__ == "__main__":
    main()

"""Where a verified mapping's time goes: ckptfmt.load(mmap=True) phase by phase beside
safetensors' load_file, the consumer and one hash pass (issue 36's limit row, taken apart).

    python bench/mmap_phases.py --files A.ckpt,A.safetensors [--files B.ckpt,B.safetensors] --rounds 7

Each measurement runs in a fresh process as bench/loads.py's does (torch and the tool's load
function imported before the clock, the consumer common.read_every_byte on all cores), and
times, clock and CPU (this process's threads included), for ckptfmt: each phase of the load
(the functions named in PHASES, timed by wrapping them: a profiling aid, not a measurement the
README's table depends on), then the consumer; for both tools: the load, the consumer (for
safetensors it faults the mapping in), the consumer again over the now-resident pages, and one
XXH3 pass over the same bytes (bench/loads.py's verification pass).  A round runs both tools
once, alternating which goes first.

Before each round both files are copied afresh (--recopy, the default): on this VM the same
bytes read 10-15% slower or faster depending on which physical pages hold the file (one 32 MiB
tensor 0.6x to 1.7x another file's copy of it), so a run that reads one fixed copy of each file
compares the pages as much as the tools; fresh copies each round average that out, and the
resident re-read shows it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402
import loads  # noqa: E402

#: (label, module, attribute path) of the ckptfmt functions a mapped load passes through, in
#: the order it calls them (those a version lacks are left out); none calls another, except
#: the check's inside "mapping + tensors" (NESTED: subtracted from it)
PHASES = [
    ("open the file", "ckptfmt.files.reader", "open_regular"),
    ("index: prologue, footer and index read", "ckptfmt.format.index", "pread_exact"),
    ("index: JSON parse", "ckptfmt.format.index", "parse_index_json"),
    ("index: storage records", "ckptfmt.format.index", "_IndexParser._parse_storages"),
    ("index: chunk records", "ckptfmt.format.index", "_IndexParser._parse_chunks"),
    ("index: tree check", "ckptfmt.format.validate", "validate_tree"),
    ("placement", "ckptfmt.files.reader", "CheckpointFile._placement"),
    ("engine: records + check of every chunk", "ckptfmt.engine.chunkread", "ChunkReader.check_mapped"),
    ("engine: records, check started", "ckptfmt.files.reader", "CheckpointFile._start_mapped_check"),
    (
        "engine: records, check started (or made, below the thread's threshold)",
        "ckptfmt.engine.chunkread",
        "ChunkReader.start_check_mapped",
    ),
    ("engine: waiting for the check", "ckptfmt.engine.chunkrecords", "MappedCheck.wait"),
    ("mapping + tensors", "ckptfmt.files.reader", "CheckpointFile._mapped_storages"),
    ("decode (the objects)", "ckptfmt.files.reader", "decode"),
]
TENSORS = "mapping + tensors"
NESTED = [label for label, _, _ in PHASES if label.startswith("engine:")]


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), loads._cpu()


def _wrap_phases(spent: dict[str, list[float]]) -> None:
    """Wrap each function of PHASES to add its clock and CPU seconds to `spent`."""
    import importlib

    for label, module, attr in PHASES:
        owner: Any = importlib.import_module(module)
        *outer, name = attr.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        def timed(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
            c0, p0 = _clocks()
            try:
                return _fn(*a, **k)
            finally:
                c1, p1 = _clocks()
                acc = spent.setdefault(_label, [0.0, 0.0])
                acc[0] += c1 - c0
                acc[1] += p1 - p0

        setattr(owner, name, functools.wraps(fn)(timed))


def child(tool: str, path: str) -> dict[str, Any]:
    """One measurement, in this fresh process."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    load = loads.loader(tool)
    spent: dict[str, list[float]] = {}
    if tool == "ckptfmt-mmap":
        _wrap_phases(spent)
    c0, p0 = _clocks()
    state = load(path)
    c1, p1 = _clocks()
    common.read_every_byte(state)
    c2, p2 = _clocks()
    out: dict[str, Any] = {"tool": tool, "load": [c1 - c0, p1 - p0], "consumer": [c2 - c1, p2 - p1]}
    if spent:
        tensors = spent.get(TENSORS, [0.0, 0.0])
        inner = [spent[label] for label in NESTED if label in spent]
        spent[TENSORS] = [tensors[i] - sum(v[i] for v in inner) for i in (0, 1)]
        spent["the rest of the load"] = [out["load"][i] - sum(v[i] for v in spent.values()) for i in (0, 1)]
        out["phases"] = spent
    gc.collect()
    c3, p3 = _clocks()
    common.read_every_byte(state)
    c4, p4 = _clocks()
    out["consumer, pages resident"] = [c4 - c3, p4 - p3]
    views = loads.verification_views(state)
    gc.collect()
    c5, p5 = _clocks()
    loads.verification_pass(views)
    c6, p6 = _clocks()
    out["hash pass, pages resident"] = [c6 - c5, p6 - p5]
    return out


def run_child(tool: str, path: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tool, path]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=common.installed_env())
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(pair: list[str], rounds: int, recopy: bool) -> list[dict[str, Any]]:
    """`rounds` rounds of both tools on the pair (ckpt, safetensors), copies made afresh each round."""
    rows = []
    with tempfile.TemporaryDirectory(dir=os.path.dirname(pair[0])) as folder:
        for r in range(rounds):
            paths = list(pair)
            if recopy:
                paths = [shutil.copyfile(p, os.path.join(folder, os.path.basename(p))) for p in pair]
            tools = [("ckptfmt-mmap", paths[0]), ("safetensors", paths[1])]
            for tool, path in common.rotated(tools, r):
                rows.append({**run_child(tool, path), "round": r, "loadavg": os.getloadavg()[0]})
    return rows


def med(rows: list[dict[str, Any]], key: str, i: int, phase: bool = False) -> float:
    values = [(row["phases"] if phase else row)[key][i] for row in rows]
    return 1e3 * statistics.median(values)


def table(rows: list[dict[str, Any]]) -> str:
    """The medians (ms, clock and CPU) of every phase and measure, and the limit ratio."""
    ck = [r for r in rows if r["tool"] == "ckptfmt-mmap"]
    st = [r for r in rows if r["tool"] == "safetensors"]
    lines = [
        "| measure | ckptfmt clock | ckptfmt CPU | safetensors clock | safetensors CPU |",
        "|---|---|---|---|---|",
    ]
    for label in [p[0] for p in PHASES if p[0] in ck[0]["phases"]] + ["the rest of the load"]:
        lines.append(f"| {label} | {med(ck, label, 0, True):.2f} | {med(ck, label, 1, True):.2f} | | |")
    for key in ("load", "consumer", "consumer, pages resident", "hash pass, pages resident"):
        cells = [f"{med(rs, key, i):.1f}" for rs in (ck, st) for i in (0, 1)]
        lines.append(f"| **{key}** | " + " | ".join(cells) + " |")
    by_round = {(r["round"], r["tool"]): r for r in rows}
    for i, what in ((0, "clock"), (1, "CPU")):
        ratios = []
        for r in sorted({row["round"] for row in rows}):
            a, b = by_round[(r, "ckptfmt-mmap")], by_round[(r, "safetensors")]
            ours = a["load"][i] + a["consumer"][i]
            ratios.append((b["load"][i] + b["consumer"][i] + a["hash pass, pages resident"][i]) / ours)
        lines.append(
            f"\nlimit ratio by {what} (safetensors + consumer + ckptfmt's pass, over ckptfmt + consumer): "
            f"median {statistics.median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds"
        )
    loadavg = [r["loadavg"] for r in rows]
    lines.append(f"load average during the run: {min(loadavg):.1f}-{max(loadavg):.1f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", action="append", required=True, help="CKPT,SAFETENSORS of one state")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--no-recopy", dest="recopy", action="store_false", help="read the given files every round"
    )
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    common.cache_bytecode()
    everything = {}
    for spec in args.files:
        pair = spec.split(",")
        rows = measure(pair, args.rounds, args.recopy)
        everything[spec] = rows
        print(f"\n{pair[0]} ({os.path.getsize(pair[0]) >> 20} MiB), {args.rounds} rounds, ms, medians\n")
        print(table(rows), flush=True)
    if args.json:
        common.write_json(args.json, everything, echo=False)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        sys.exit(main(sys.argv[1:]))

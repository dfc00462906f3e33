"""How ckptfmt's costs grow with the state: throughput and peak extra memory against size.

    python bench/scaling.py                        # 256M,1G,4G fp32 states on disk, 3 rounds
    python bench/scaling.py --sizes 256M,1G,4G,8G --rounds 5 --disk-dir /mnt/big

Runs the main benchmark (bench/run.py: every measurement in a fresh process, dd in
the same rounds as the disk's limit) for ckptfmt alone at each size, then plots
GB/s and peak extra RSS against the state's size.  Throughput that stays level and
memory that stays flat as the state grows are what this shows; load and the
non-blocking save allocate the state (or its staging) by design, so their memory
grows with it.  Writes results/scaling.json, .md and .png.

Memory: a measurement process holds the state and its staging while it saves, then
a loaded copy or load_into's template: a size needs about twice its bytes of RAM
(the states the workers start from move from /dev/shm to the disk when large).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402

THROUGHPUT = {
    "save": "durable save",
    "save_nb_durable": "non-blocking save, until durable",
    "load_cold": "load, cold cache",
    "load_warm": "load, warm cache",
    "load_into": "load_into existing tensors",
    "verify_cold": "verify, cold cache",
    "verify_warm": "verify, warm cache",
}
FLAT_MEMORY = {"save": "durable save", "load_into": "load_into", "verify_cold": "verify"}


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per size: GB/s and peak extra RSS per operation, and dd's GB/s."""
    out = []
    for case in sorted(report["cases"], key=lambda c: c["state_bytes"]):
        ours, dd = case["stats"]["ckptfmt"], case["stats"].get("dd", {})
        row: dict[str, Any] = {"state_bytes": case["state_bytes"], "gbps": {}, "rss_bytes": {}}
        for op in THROUGHPUT:
            if op in ours:
                row["gbps"][op] = ours[op]["gbps"]["median"]
                row["rss_bytes"][op] = ours[op]["rss_extra_bytes"]["median"]
        for op in ("save", "load_cold", "load_warm"):
            if op in dd:
                row["gbps"][f"dd_{op}"] = dd[op]["gbps"]["median"]
        out.append(row)
    return out


def markdown(table: list[dict[str, Any]], command: str) -> str:
    sizes = [f"{r['state_bytes'] / 2**20:.0f} MiB" for r in table]
    lines = [f"Command: `{command}` (every figure a median of rounds).", ""]
    lines.append("| GB/s | " + " | ".join(sizes) + " |")
    lines.append("|---|" + "---|" * len(sizes))
    for op, label in [
        *THROUGHPUT.items(),
        ("dd_save", "dd write (fsync)"),
        ("dd_load_cold", "dd read, cold"),
    ]:
        cells = [f"{r['gbps'][op]:.2f}" if op in r["gbps"] else "" for r in table]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| peak extra RSS, MiB (share of the state) | " + " | ".join(sizes) + " |")
    lines.append("|---|" + "---|" * len(sizes))
    for op, label in FLAT_MEMORY.items():
        cells = [
            f"{r['rss_bytes'][op] / 2**20:.0f} ({r['rss_bytes'][op] / r['state_bytes']:.1%})"
            if op in r["rss_bytes"]
            else ""
            for r in table
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(table: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    mib = [r["state_bytes"] / 2**20 for r in table]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for op, label in [*THROUGHPUT.items(), ("dd_save", "dd write (fsync)")]:
        pts = [(m, r["gbps"][op]) for m, r in zip(mib, table) if op in r["gbps"]]
        if pts:
            style = "--" if op.startswith("dd") else "-"
            left.plot(*zip(*pts), style, marker="o", label=label)
    left.set_xscale("log", base=2)
    left.set_xlabel("state size, MiB")
    left.set_ylabel("GB/s (median)")
    left.set_title("throughput against state size (disk)")
    left.legend(fontsize=7)
    for op, label in FLAT_MEMORY.items():
        pts = [(m, r["rss_bytes"][op] / 2**20) for m, r in zip(mib, table) if op in r["rss_bytes"]]
        if pts:
            right.plot(*zip(*pts), marker="o", label=label)
    right.plot(mib, mib, ":", color="grey", label="the state's size")
    right.set_xscale("log", base=2)
    right.set_yscale("symlog", base=2, linthresh=1)  # 0 MiB stays on the chart
    right.set_ylim(bottom=0)
    right.set_xlabel("state size, MiB")
    right.set_ylabel("peak extra RSS, MiB")
    right.set_title("memory beyond the state")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256M,1G,4G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    bench_args = ["--sizes", args.sizes, "--tools", "ckptfmt", "--dtypes", "fp32", "--targets", "disk"]
    bench_args += ["--rounds", str(args.rounds), "--out", args.out, "--name", "scaling-raw", "--no-chart"]
    if args.disk_dir:
        bench_args += ["--disk-dir", args.disk_dir]
    if run.main(bench_args) != 0:
        return 1
    with open(os.path.join(args.out, "scaling-raw.json")) as f:
        report = json.load(f)
    command = "python bench/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = rows(report)
    stem = os.path.join(args.out, "scaling")
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "machine": report["machine"], "rows": table}, f, indent=1)
    md = markdown(table, command.strip())
    with open(stem + ".md", "w") as f:
        f.write(md)
    chart(table, stem + ".png")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

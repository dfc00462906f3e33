"""How ckptfmt's costs grow with the state: throughput and peak extra memory against size.

    python bench/scaling.py                        # 256M,1G,4G fp32 states on disk, 3 rounds
    python bench/scaling.py --sizes 256M,1G,4G,8G --rounds 5 --disk-dir /mnt/big

Runs the main benchmark (bench/run.py: every measurement in a fresh process, dd in
the same rounds as the disk's limit) for ckptfmt alone on the disk at each size, then
plots GB/s and peak extra RSS against the state's size.  Throughput that stays level and
memory that stays flat as the state grows are what this shows; load and the
non-blocking save allocate the state (or its staging) by design, so their memory
grows with it.  Writes results/scaling.json, .md and .png.

Memory: a save process holds the state and its staging; the disk's page cache holds
the checkpoint files: a size needs about three times its bytes of RAM.
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
    "saves/disk/ckptfmt/save": "durable save",
    "saves/disk/ckptfmt/save_nb_durable": "non-blocking save, until durable",
    "cold/disk/ckptfmt/load": "load, cold cache",
    "warm/disk/ckptfmt/load": "load, page cache",
    "warm/disk/ckptfmt-mmap/load": "load(mmap=True), page cache",
}
DD = {"saves/disk/dd/save": "dd write (fsync)", "cold/disk/dd/load": "dd read, cold"}
FLAT_MEMORY = {"saves/disk/ckptfmt/save": "durable save"}


def rows(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size: GB/s and peak extra RSS per operation, and dd's GB/s."""
    out = []
    for report in sorted(reports, key=lambda r: r["state"]["bytes"]):
        found = {r["id"]: r for r in report["rows"]}
        row: dict[str, Any] = {"state_bytes": report["state"]["bytes"], "gbps": {}, "rss_bytes": {}}
        for key in [*THROUGHPUT, *DD]:
            if key in found:
                row["gbps"][key] = found[key]["gbps"]["median"]
                if "rss" in found[key]:
                    row["rss_bytes"][key] = found[key]["rss"]["median"]
        out.append(row)
    return out


def markdown(table: list[dict[str, Any]], command: str) -> str:
    sizes = [f"{r['state_bytes'] / 2**20:.0f} MiB" for r in table]
    lines = [f"Command: `{command}` (every figure a median of rounds).", ""]
    lines.append("| GB/s | " + " | ".join(sizes) + " |")
    lines.append("|---|" + "---|" * len(sizes))
    for op, label in [*THROUGHPUT.items(), *DD.items()]:
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
    for op, label in [*THROUGHPUT.items(), *DD.items()]:
        pts = [(m, r["gbps"][op]) for m, r in zip(mib, table) if op in r["gbps"]]
        if pts:
            style = "--" if op in DD else "-"
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
    reports = []
    for size in args.sizes.split(","):
        bench_args = [
            "--size",
            size,
            "--locations",
            "disk",
            "--loads",
            "ckptfmt,ckptfmt-mmap",
            "--spread-rounds",
            "0",
        ]
        bench_args += [
            "--save-tools",
            "ckptfmt",
            "--rounds",
            str(args.rounds),
            "--save-rounds",
            str(args.rounds),
        ]
        bench_args += ["--out", args.out, "--name", f"scaling-raw-{size}"]
        if args.disk_dir:
            bench_args += ["--disk-dir", args.disk_dir]
        if run.main(bench_args) != 0:
            return 1
        with open(os.path.join(args.out, f"scaling-raw-{size}.json")) as f:
            reports.append(json.load(f))
    command = "python bench/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = rows(reports)
    stem = os.path.join(args.out, "scaling")
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "machine": reports[0]["machine_before"], "rows": table}, f, indent=1)
    md = markdown(table, command.strip())
    with open(stem + ".md", "w") as f:
        f.write(md)
    chart(table, stem + ".png")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

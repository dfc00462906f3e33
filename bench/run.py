"""ckptfmt against the tools people use, on the same states, machine and run.

    python bench/run.py --quick                  # 256 MiB fp32 state, disk and tmpfs, 3 rounds
    python bench/run.py --sizes 1G,4G --dtypes fp32,bf16 --rounds 5

Every figure is a median over rounds (min and max kept). Rounds interleave the
tools (A B C ... A B C ...), each measurement runs in a fresh process, and every
comparison is a ratio computed within a round and then reduced to its median.
dd writing (conv=fsync) and reading the same number of bytes is measured in the
same rounds as the physical limit.  Writes results/<name>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import state as bench_state  # noqa: E402
import tools  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# operations that are compared across tools (ours -> peers' names for the same thing)
COMPARE = {
    "save": "save",
    "load_cold": "load_cold",
    "load_warm": "load_warm",
    "load_into": "load_into",
}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("IB")
    if text[-1:] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def machine_info(targets: dict[str, str]) -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fs = {}
    for name, path in targets.items():
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
        fs[name] = {"path": path, "df": out[-1] if out else ""}
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "targets": fs,
    }


def versions() -> dict[str, str]:
    import numpy
    import torch

    import ckptfmt

    out = {
        "ckptfmt": ckptfmt.__version__,
        "ckptfmt_backend": ckptfmt.backend(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }
    for mod in ("safetensors", "tensorizer", "zstandard", "xxhash"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except ImportError:
            out[mod] = "not installed"
    dd = subprocess.run(["dd", "--version"], capture_output=True, text=True).stdout.splitlines()
    out["dd"] = dd[0] if dd else "?"
    return out


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "worker.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {spec['tool']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def timed(fn: Any, *args: Any) -> float:
    """Seconds that fn(*args) takes; its result is freed after the clock stops."""
    t = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - t
    del out
    return took


def build_cache(size: int, dtype: str, folder: str) -> tuple[str, int]:
    import torch

    import ckptfmt

    st, _ = bench_state.build(size, getattr(torch, DTYPES[dtype]))
    path = os.path.join(folder, f"state-{size}-{dtype}.ckpt")
    ckptfmt.save(st, path)
    return path, bench_state.tensor_bytes(st)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256M fp32, 3 rounds (a few minutes on 2 cores)")
    ap.add_argument("--sizes", default=None, help="state sizes, e.g. 256M,1G,4G (default 1G)")
    ap.add_argument("--dtypes", default=None, help="fp32,bf16 (default fp32,bf16; quick: fp32)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5; quick: 3)")
    ap.add_argument("--targets", default="disk,tmpfs", help="disk,tmpfs")
    ap.add_argument(
        "--disk-dir", default=None, help="directory on the local disk (default: a temp dir under bench/)"
    )
    ap.add_argument("--tools", default=None, help="comma-separated subset of: " + ",".join(tools.TOOLS))
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where to write the report")
    ap.add_argument("--name", default=None, help="report file name stem (default: latest)")
    ap.add_argument("--no-chart", action="store_true")
    args = ap.parse_args(argv)

    sizes = [parse_size(s) for s in (args.sizes or ("256M" if args.quick else "1G")).split(",")]
    dtypes = (args.dtypes or ("fp32" if args.quick else "fp32,bf16")).split(",")
    rounds = args.rounds or (3 if args.quick else 5)
    names = args.tools.split(",") if args.tools else tools.available()
    unknown = [n for n in names if n not in tools.TOOLS]
    if unknown:
        ap.error(f"unknown tools: {unknown}")
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="ckptfmt-bench-", dir=args.disk_dir or HERE)
    shm = tempfile.mkdtemp(prefix="ckptfmt-bench-", dir="/dev/shm") if os.path.isdir("/dev/shm") else scratch
    targets = {"disk": scratch, "tmpfs": shm}
    targets = {t: targets[t] for t in args.targets.split(",")}
    # the states the workers start from live in /dev/shm unless that would take more than
    # a quarter of it or of memory: a worker holds the state and staging or a loaded copy,
    # and the tmpfs target writes its checkpoints there too
    room = 0
    if os.path.isdir("/dev/shm"):
        shm_fs = os.statvfs("/dev/shm")
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        room = min(phys, shm_fs.f_bavail * shm_fs.f_frsize)
    in_memory = 4 * max(sizes) <= room
    cache_dir = tempfile.mkdtemp(
        prefix="ckptfmt-bench-cache-", dir="/dev/shm" if in_memory else args.disk_dir or HERE
    )
    report: dict[str, Any] = {
        "command": "python "
        + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + (argv or sys.argv[1:])),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(targets),
        "versions": versions(),
        "notes": {n: tools.TOOLS[n]().note for n in names},
        "cache_eviction": "",
        "cases": [],
    }
    if "tensorizer" not in names:
        report["notes"]["tensorizer"] = "not installed, not measured"
    t_start = time.perf_counter()
    try:
        for size in sizes:
            for dtype in dtypes:
                print(f"building a {size >> 20} MiB {dtype} training state ...", flush=True)
                cache, nbytes = build_cache(size, dtype, cache_dir)
                for target, folder in targets.items():
                    case = {"size": size, "dtype": dtype, "target": target, "state_bytes": nbytes, "runs": {}}
                    for r in range(rounds):
                        for name in ["dd", *names]:
                            spec = {"tool": name, "dir": folder, "cache": cache, "bytes": nbytes}
                            t = time.perf_counter()
                            out = run_worker(spec)
                            report["cache_eviction"] = out.get("evict") or report["cache_eviction"]
                            for res in out["results"]:
                                case["runs"].setdefault(name, {}).setdefault(res["op"], []).append(res)
                            print(
                                f"  [{size >> 20}M {dtype} {target}] round {r + 1}/{rounds} {name:13s} "
                                f"{time.perf_counter() - t:6.1f}s  ({time.perf_counter() - t_start:5.0f}s total)",
                                flush=True,
                            )
                    report["cases"].append(finish_case(case))
                os.unlink(cache)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if shm != scratch:
            shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
    report["seconds"] = time.perf_counter() - t_start
    stem = os.path.join(args.out, args.name or "latest")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print("\n" + md)
    if not args.no_chart:
        chart(report, stem + ".png")
    print(f"wrote {stem}.json, {stem}.md" + ("" if args.no_chart else f", {stem}.png"))
    return 0


def finish_case(case: dict[str, Any]) -> dict[str, Any]:
    """Medians per tool and op, and ratios computed round by round."""
    nbytes = case["state_bytes"]
    stats: dict[str, dict[str, Any]] = {}
    for tool, ops in case["runs"].items():
        for op, runs in ops.items():
            secs = [r["seconds"] for r in runs]
            entry = {
                "seconds": summarise(secs),
                "gbps": summarise([nbytes / s / 1e9 for s in secs]),
                "rss_extra_bytes": summarise([r["rss"] for r in runs]),
            }
            if "bytes" in runs[0]:
                entry["file_bytes"] = runs[0]["bytes"]
            stats.setdefault(tool, {})[op] = entry
    ratios: dict[str, dict[str, Any]] = {}
    ours = case["runs"].get("ckptfmt", {})
    for peer, ops in case["runs"].items():
        if peer == "ckptfmt":
            continue
        for op, runs in ops.items():
            mine = ours.get(op)
            if not mine:
                continue
            # peer time / our time, per round: > 1 means ckptfmt is faster
            per_round = [p["seconds"] / m["seconds"] for p, m in zip(runs, mine)]
            ratios.setdefault(peer, {})[op] = summarise(per_round)
    case["stats"] = stats
    case["ratios"] = ratios
    del case["runs"]
    return case


OP_LABELS = {
    "save": "durable save",
    "save_nb_blocked": "non-blocking save: caller blocked",
    "save_nb_durable": "non-blocking save: until durable",
    "load_cold": "load, cold cache",
    "load_warm": "load, warm cache",
    "load_mmap_cold": "load mmap+touch, cold",
    "load_mmap_warm": "load mmap+touch, warm",
    "lazy": "lazy open (touches nothing)",
    "load_into": "load into existing tensors",
    "verify_cold": "verify, cold",
    "verify_warm": "verify, warm",
}


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB; "
        f"torch {report['versions']['torch']}, ckptfmt {report['versions']['ckptfmt']} "
        f"({report['versions']['ckptfmt_backend']} backend). Command: `{report['command']}`. "
        f"Cold cache by {report['cache_eviction'] or 'n/a'}.",
        "",
    ]
    for case in report["cases"]:
        stats, ratios = case["stats"], case["ratios"]
        tools_ = [t for t in stats if t != "dd"]
        lines.append(
            f"**{case['state_bytes'] / 2**20:.0f} MiB {case['dtype']} state on {case['target']}** — "
            "GB/s, median of rounds (min–max); `xN` = the tool's time / ckptfmt's time, per-round median "
            "(above 1: ckptfmt faster)"
        )
        lines.append("")
        lines.append("| operation | " + " | ".join(["dd", *tools_]) + " |")
        lines.append("|---|" + "---|" * (len(tools_) + 1))
        for op, label in OP_LABELS.items():
            dd_op = {
                "save": "save",
                "load_cold": "load_cold",
                "load_warm": "load_warm",
                "verify_cold": "load_cold",
                "verify_warm": "load_warm",
            }.get(op)
            row = [label]
            dd = stats.get("dd", {}).get(dd_op) if dd_op else None
            row.append(f"{dd['gbps']['median']:.2f}" if dd else "")
            any_cell = False
            for t in tools_:
                s = stats[t].get(op)
                if not s:
                    row.append("")
                    continue
                any_cell = True
                cell = f"{s['gbps']['median']:.2f} ({s['gbps']['min']:.2f}–{s['gbps']['max']:.2f})"
                r = ratios.get(t, {}).get(op)
                if r and t != "ckptfmt":
                    cell += f" x{r['median']:.2f}"
                row.append(cell)
            if any_cell:
                lines.append("| " + " | ".join(row) + " |")
        sizes = [
            f"{t} {stats[t]['save']['file_bytes'] / 2**20:.1f} MiB"
            for t in tools_
            if "file_bytes" in stats[t].get("save", {})
        ]
        lines.append("")
        lines.append("File sizes: " + ", ".join(sizes) + ".")
        rss = [
            f"{t} {stats[t][op]['rss_extra_bytes']['median'] / 2**20:.0f} MiB"
            for t in tools_
            for op in ("save",)
            if op in stats[t]
        ]
        lines.append("Peak extra RSS during save: " + ", ".join(rss) + ".")
        rss = [
            f"{t} {stats[t]['load_into']['rss_extra_bytes']['median'] / 2**20:.0f} MiB"
            for t in tools_
            if "load_into" in stats[t]
        ]
        lines.append("Peak extra RSS during load into existing tensors: " + ", ".join(rss) + ".")
        lines.append("")
    lines.append("Notes: " + "; ".join(f"**{k}**: {v}" for k, v in report["notes"].items()) + ".")
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return
    cases = report["cases"]
    fig, axes = plt.subplots(len(cases), 1, figsize=(11, 3.6 * len(cases)), squeeze=False)
    colours = {
        "dd": "#888888",
        "ckptfmt": "#d62728",
        "ckptfmt-zstd": "#ff9896",
        "torch": "#1f77b4",
        "safetensors": "#2ca02c",
        "dcp": "#9467bd",
        "tensorizer": "#8c564b",
    }
    ops = ["save", "load_cold", "load_warm", "load_into", "verify_cold", "verify_warm"]
    dd_for = {
        "save": "save",
        "load_cold": "load_cold",
        "load_warm": "load_warm",
        "verify_cold": "load_cold",
        "verify_warm": "load_warm",
    }
    for ax, case in zip(axes[:, 0], cases):
        stats = case["stats"]
        names = ["dd", *[t for t in stats if t != "dd"]]
        width = 0.8 / len(names)
        for i, t in enumerate(names):
            vals = []
            for op in ops:
                s = (
                    stats.get(t, {}).get(dd_for.get(op) if t == "dd" else op)
                    if (t != "dd" or op in dd_for)
                    else None
                )
                vals.append(s["gbps"]["median"] if s else 0.0)
            xs = [j + i * width for j in range(len(ops))]
            ax.bar(xs, vals, width, label=t, color=colours.get(t))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))])
        ax.set_xticklabels([OP_LABELS[o] for o in ops], fontsize=8)
        ax.set_ylabel("GB/s (median)")
        ax.set_title(
            f"{case['state_bytes'] / 2**20:.0f} MiB {case['dtype']} training state, {case['target']}"
        )
        ax.legend(fontsize=7, ncol=len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

"""What never half-loading costs: load_into() atomic (the default) against atomic=False.

    python bench/load_into.py                      # 1 GiB fp32 state, tmpfs and disk, 5 rounds
    python bench/load_into.py --size 256M --rounds 3

The same GPT-like training state (bench/state.py) is saved once per target; each
measurement runs in a fresh process that first builds and touches the target
tensors, then times one call.  Per round the modes run interleaved (their order
alternates); figures are medians over rounds, ratios are computed within a round.
Modes: "atomic" = ckptfmt.load_into(path, target) (verify pass, then the reads
into the targets), "fast" = load_into(..., atomic=False) (one verified read
straight into the targets), "verify pass" = the first pass alone
(inplace.verify_subtree, the bounded bounce buffer).  Targets: "tmpfs" (the file
in memory), "disk warm" (in the page cache) and "disk cold" (evicted first: by
drop_caches as root, else fadvise DONTNEED).  Peak extra RSS is the kernel's
high-water mark during the call minus the RSS before it.
"""

from __future__ import annotations

import argparse
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

from common import parse_size  # noqa: E402

MODES = ("fast", "atomic", "verify pass")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import common
    import torch

    import ckptfmt
    from ckptfmt.files import load_into as inplace
    from ckptfmt.files.reader import CheckpointFile

    torch.set_num_threads(os.cpu_count() or 1)
    path = spec["path"]
    template = common.empty_like_state(ckptfmt.load(path, map_location="meta"))
    template = _materialise(template)
    common.read_every_byte(template)
    if spec["cold"]:
        common.evict(path)
    gc.collect()
    common.reset_peak_rss()
    before = common.status_bytes("VmRSS")
    t = time.perf_counter()
    if spec["mode"] == "verify pass":
        with CheckpointFile(path) as f:
            inplace.verify_subtree(f, f.tree.root)
    else:
        ckptfmt.load_into(path, template, atomic=spec["mode"] == "atomic")
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "rss": max(0, common.status_bytes("VmHWM") - before)}


def _materialise(obj: Any) -> Any:
    """CPU tensors for the meta ones (the shapes and dtypes of the file, no read of its data)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return type(obj)((k, _materialise(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_materialise(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_materialise(v) for v in obj)
    return obj


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['mode']} failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--targets", default="tmpfs,disk warm,disk cold")
    ap.add_argument("--disk-dir", default=None, help="a directory on the local disk (default: under bench/)")
    ap.add_argument("--compression", default=None, choices=[None, "zstd"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    import state as bench_state
    import torch

    import ckptfmt

    size = parse_size(args.size)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    st, _ = bench_state.build(size, dtype)
    nbytes = bench_state.tensor_bytes(st)
    disk = tempfile.mkdtemp(prefix="ckptfmt-bench-li-", dir=args.disk_dir or HERE)
    shm = tempfile.mkdtemp(prefix="ckptfmt-bench-li-", dir="/dev/shm") if os.path.isdir("/dev/shm") else disk
    files = {"tmpfs": os.path.join(shm, "s.ckpt"), "disk": os.path.join(disk, "s.ckpt")}
    for p in files.values():
        ckptfmt.save(st, p, compression=args.compression)
    del st
    targets = args.targets.split(",")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {m: [] for m in MODES} for t in targets}
    try:
        for r in range(args.rounds):
            for target in targets:
                order = MODES if r % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    spec = {
                        "path": files["tmpfs" if target == "tmpfs" else "disk"],
                        "mode": mode,
                        "cold": target == "disk cold",
                    }
                    if target == "disk warm":  # into the page cache first
                        with open(spec["path"], "rb") as fh:
                            while fh.read(64 << 20):
                                pass
                    res = run_child(spec)
                    runs[target][mode].append(res)
                    print(
                        f"round {r + 1}/{args.rounds} {target:9s} {mode:11s} {res['seconds']:.3f}s "
                        f"{nbytes / res['seconds'] / 1e9:5.2f} GB/s rss +{res['rss'] >> 20} MiB",
                        flush=True,
                    )
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        if shm != disk:
            shutil.rmtree(shm, ignore_errors=True)
    report = summarise(runs, nbytes, vars(args))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "load_into")
    with open(stem + ".json", "w") as fh:
        json.dump(report, fh, indent=1)
    md = markdown(report)
    with open(stem + ".md", "w") as fh:
        fh.write(md)
    print("\n" + md)
    return 0


def summarise(
    runs: dict[str, dict[str, list[dict[str, Any]]]], nbytes: int, args: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "state_bytes": nbytes,
        "args": {k: v for k, v in args.items() if k != "child"},
        "cases": {},
    }
    for target, modes in runs.items():
        case: dict[str, Any] = {}
        for mode, rs in modes.items():
            secs = [x["seconds"] for x in rs]
            case[mode] = {
                "seconds": statistics.median(secs),
                "gbps": statistics.median(nbytes / s / 1e9 for s in secs),
                "rss_mib": statistics.median(x["rss"] for x in rs) / 2**20,
                "all_seconds": secs,
            }
        per_round = [a["seconds"] / f["seconds"] for a, f in zip(modes["atomic"], modes["fast"])]
        case["atomic_over_fast"] = {
            "median": statistics.median(per_round),
            "min": min(per_round),
            "max": max(per_round),
        }
        out["cases"][target] = case
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"load_into of a {report['state_bytes'] / 2**20:.0f} MiB {report['args']['dtype']} training state "
        f"({report['args']['compression'] or 'raw'} chunks), median of {report['args']['rounds']} rounds; "
        "cost = atomic time / fast time, per round (median, min–max)",
        "",
        "| target | fast (atomic=False) | atomic (default) | verify pass alone | cost of atomic | "
        "peak extra RSS fast / atomic |",
        "|---|---|---|---|---|---|",
    ]
    for target, c in report["cases"].items():
        r = c["atomic_over_fast"]
        lines.append(
            f"| {target} | {c['fast']['gbps']:.2f} GB/s | {c['atomic']['gbps']:.2f} GB/s | "
            f"{c['verify pass']['gbps']:.2f} GB/s | x{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}) | "
            f"{c['fast']['rss_mib']:.0f} / {c['atomic']['rss_mib']:.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

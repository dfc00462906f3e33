"""The load a resume makes: the first one in a fresh process, of a checkpoint in the page cache.

    python bench/resume.py [--size 1G] [--rounds 5] [--dir DIR]

bench/run.py's workers time their loads after loading and freeing the state once,
so their loads get memory the process has just handed back.  A resumed run has no
such memory: this runs each load as the first thing a fresh process does, every byte
of every returned tensor read, in turn each round: ckptfmt.load as it is, ckptfmt.load
with huge pages wherever free 2 MiB blocks allow (as on hosts that do not take free
blocks back), ckptfmt.load with none, and torch.load of the same state.
Writes results/resume.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import state as bench_state  # noqa: E402
import torch  # noqa: E402
from run import parse_size  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.engine import hostmem  # noqa: E402

_WORKER = r"""
import sys, time
path, mode, here = sys.argv[1:4]
sys.path.insert(0, here)
import torch, tools
if mode == "torch":
    t = time.perf_counter()
    out = torch.load(path, weights_only=False)
else:
    import ckptfmt
    from ckptfmt import hostmem
    if mode == "ckptfmt-huge-pages":
        hostmem._reclaims = False
    if mode == "ckptfmt-4k-pages":
        hostmem.MIN_HUGE_BYTES = 1 << 62
    t = time.perf_counter()
    out = ckptfmt.load(path)
tools.touch(out)
print(time.perf_counter() - t)
"""

MODES = ("ckptfmt", "ckptfmt-huge-pages", "ckptfmt-4k-pages", "torch")


def first_load(path: str, mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, path, mode, HERE], capture_output=True, text=True, timeout=600
    )
    if out.returncode:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: under bench/)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "resume.json"))
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="ckptfmt-resume-", dir=args.dir or HERE)
    try:
        st, _ = bench_state.build(parse_size(args.size))
        nbytes = bench_state.tensor_bytes(st)
        paths = {"ckptfmt": os.path.join(folder, "state.ckpt"), "torch": os.path.join(folder, "state.pt")}
        ckptfmt.save(st, paths["ckptfmt"])
        torch.save(st, paths["torch"])
        del st
        for p in paths.values():  # in the page cache, as a checkpoint written minutes ago is
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for mode in order:
                seconds[mode].append(first_load(paths["torch" if mode == "torch" else "ckptfmt"], mode))
            print(
                f"round {r + 1}: "
                + ", ".join(f"{m} {nbytes / seconds[m][-1] / 1e9:.2f} GB/s" for m in MODES),
                flush=True,
            )
        result: dict[str, Any] = {
            "command": " ".join(["python", "bench/resume.py", *sys.argv[1:]]),
            "state_bytes": nbytes,
            "gbps": {m: statistics.median(nbytes / s / 1e9 for s in v) for m, v in seconds.items()},
            "torch_time_over_ckptfmt": statistics.median(
                t / c for t, c in zip(seconds["torch"], seconds["ckptfmt"])
            ),
            "host_reclaims_huge_blocks": hostmem.host_reclaims_huge_blocks(),
            **{
                f"ckptfmt_time_over_{m[8:].replace('-', '_')}": statistics.median(
                    c / h for h, c in zip(seconds[m], seconds["ckptfmt"])
                )
                for m in ("ckptfmt-huge-pages", "ckptfmt-4k-pages")
            },
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The load a resume makes, and the huge-page choice behind ckptfmt's: ckptfmt.load three ways and torch.load.

    python bench/resume.py [--size 1G] [--rounds 5] [--dir DIR]

Each load is the first thing a fresh process does (bench/loads.py), of a checkpoint
in the page cache, every byte of every returned tensor read; in turn each round,
the order rotated: ckptfmt.load as it is, ckptfmt.load with huge pages wherever free
2 MiB blocks allow (as on hosts that do not take free blocks back), ckptfmt.load with
none, and torch.load of the same state.  Writes results/resume.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import loads  # noqa: E402
import state as bench_state  # noqa: E402
import torch  # noqa: E402
from common import command_line, machine_state, parse_size, rotated, write_json  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt.engine import hostmem  # noqa: E402

MODES = ["ckptfmt", "ckptfmt-huge-pages", "ckptfmt-4k-pages", "torch"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: under bench/)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "resume.json"))
    args = ap.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="ckptfmt-resume-", dir=args.dir or HERE)
    try:
        st, _ = bench_state.build(parse_size(args.size))
        nbytes = bench_state.tensor_bytes(st)
        paths = {"ckptfmt": os.path.join(folder, "state.ckpt"), "torch": os.path.join(folder, "state.pt")}
        ckptfmt.save(st, paths["ckptfmt"])
        torch.save(st, paths["torch"])
        del st
        for p in paths.values():  # in the page cache, as a checkpoint written minutes ago is
            loads.dd_read(p)
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in rotated(MODES, r):
                path = paths["torch" if mode == "torch" else "ckptfmt"]
                seconds[mode].append(loads.measure(mode, path)["seconds"])
            print(
                f"round {r + 1}: "
                + ", ".join(f"{m} {nbytes / seconds[m][-1] / 1e9:.2f} GB/s" for m in MODES),
                flush=True,
            )
        result: dict[str, Any] = {
            "command": command_line(__file__, argv),
            "machine": machine_state({"dir": folder}),
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
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

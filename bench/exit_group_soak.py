"""Soak of the two-rank save made at interpreter exit (tests/test_dcp_exit_group.py), run by
hand, not in CI: the test's two ranks run `--runs` times per source tree, the trees alternated
run by run, and every run's outcome counted: ``ok`` (both ranks saved and exited 0),
``abort`` (a rank died of SIGABRT or printed "terminate called": a gloo group freed at
interpreter teardown; the rank is named), ``other`` (any other failure, its first line kept).

    nice -n 10 python bench/exit_group_soak.py --runs 40 --trees /tmp/base,.
    (--keep-groups: the ranks leave their groups to torch's teardown)

Each tree is put first on PYTHONPATH of its runs (a tree: a directory holding ckptfmt/).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TEST = Path(__file__).resolve().parent.parent / "tests" / "test_dcp_exit_group.py"


def rank_script(keep_groups: bool) -> str:
    """The test's rank program, taken from the test itself so that the soak runs what CI runs;
    `keep_groups`: without its handler's destroy_process_group() (torch frees the groups left
    at interpreter teardown)."""
    spec = importlib.util.spec_from_file_location("exit_group_test", _TEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    script = str(module._RANK)
    if keep_groups:
        assert "    dist.destroy_process_group()\n" in script
        script = script.replace("    dist.destroy_process_group()\n", "")
    return script


def one_run(script: str, tree: str, timeout: float) -> tuple[str, str]:
    """Run the two ranks once against `tree`: (outcome, what went wrong or "")."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    with tempfile.TemporaryDirectory(prefix="exit-group-soak-") as tmp:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(rank), f"{tmp}/store", f"{tmp}/final"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(2)
        ]
        outs = []
        for p in ranks:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                err += "\n(killed at the soak's deadline)"
            outs.append((p.returncode, out, err))
    for rank, (code, _, err) in enumerate(outs):
        if code == -signal.SIGABRT or "terminate called" in err:
            return "abort", f"rank {rank}: " + (err.strip().splitlines() or [""])[-1][:200]
    for code, out, err in outs:
        if code != 0 or out.strip() != "saved":
            lines = (out + err).strip().splitlines()
            return "other", f"rc={code}: " + (lines[-1][:200] if lines else "")
    return "ok", ""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=40, help="runs per tree")
    parser.add_argument("--trees", default=".", help="comma-separated source trees, alternated run by run")
    parser.add_argument("--keep-groups", action="store_true", help="the ranks do not destroy their groups")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a rank may take")
    args = parser.parse_args()
    trees = args.trees.split(",")
    script = rank_script(args.keep_groups)
    counts = {tree: collections.Counter[str]() for tree in trees}
    notes: dict[str, list[str]] = {tree: [] for tree in trees}
    start = time.monotonic()
    for i in range(args.runs):
        for tree in trees:
            outcome, note = one_run(script, tree, args.timeout)
            counts[tree][outcome] += 1
            if note:
                notes[tree].append(f"run {i}: {outcome}: {note}")
            print(f"run {i} {tree}: {outcome} {note}", flush=True)
    summary = {
        "runs_per_tree": args.runs,
        "keep_groups": args.keep_groups,
        "seconds": round(time.monotonic() - start, 1),
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "trees": {tree: {"counts": dict(counts[tree]), "notes": notes[tree]} for tree in trees},
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

"""The main job: a training run killed mid-run resumes bit for bit from its checkpoints.

    python -m ckptfmt.demo [--dir DIR] [--steps N] [--kill-after K] [--archive]

1. Trains ckptfmt.demo.training's small GPT-like model (dropout, shuffling data loader,
   AdamW, warm-up + cosine LR, bf16 autocast with a GradScaler) in a child process
   with a CheckpointManager (a checkpoint every step, keep_last=3, non-blocking
   saves), and SIGKILLs it at a random step.
2. Lists the run directory as ``ckptfmt ls`` does: the killed save's directory is
   there but is no checkpoint.
3. Resumes from ``latest()`` in a fresh process and trains to the end.
4. Runs the same training uninterrupted and compares: every loss after the resume
   and every tensor of the final state (weights, AdamW moments, ...), bit for bit.
5. Flips one bit in the newest checkpoint: ``ckptfmt verify`` names the damaged
   tensor, and ``load(fallback=True)`` warns and falls back to the step before.

With --archive, the demo starts a local S3-compatible server (moto) and every step is
also archived there; after the kill the run's local directory is deleted, as if the node
were lost, and a new one resumes from the archive.  The damaged local copy of step 5 is
then read from the archive instead of falling back a step.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

import ckptfmt

from . import training

KEEP_LAST = 3
#: what every run of the demo saves with: a checkpoint per step, the last three kept, written
#: in the background while the next steps train
SAVE_ARGS = ["--non-blocking", "--keep-last", str(KEEP_LAST)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def _short(path: str) -> str:
    """`path` relative to the current directory when it lies under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _checked(run: training.ChildRun, what: str) -> training.ChildRun:
    if run.returncode != 0:
        raise SystemExit(f"demo: the {what} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return run


# -- showing a run directory ----------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptfmt", *args], capture_output=True, text=True)


def show_listing(run_dir: str) -> None:
    """`ckptfmt ls RUN_DIR`, or the same facts from the manager if the CLI cannot."""
    done = _cli("ls", run_dir)
    if done.returncode == 0 and done.stdout.strip():
        print(_indent(done.stdout))
        return
    for s in ckptfmt.CheckpointManager(run_dir).statuses():
        if s.info is not None:
            print(
                f"    {s.step:>10}  complete    {_mib(s.info.size):>10}  loss={s.info.metrics.get('loss', 0):.6g}"
            )
        else:
            print(f"    {s.step:>10}  incomplete  {s.problem}")


# -- comparing runs ---------------------------------------------------------------------


def differences(a: Any, b: Any, path: str = "state") -> list[str]:
    """Where two loaded states differ, bit for bit (tensors by value, dtype and shape)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{path} (keys)"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if type(a) is not type(b):
        return [f"{path} (type)"]
    if isinstance(a, float):
        return [] if a.hex() == b.hex() else [path]
    return [] if a == b else [path]


def count_tensors(obj: Any) -> tuple[int, int]:
    """(tensors, bytes) in a loaded state."""
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    counts = [count_tensors(v) for v in items]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def compare_losses(resumed: training.ChildRun, reference: training.ChildRun, last: int) -> int:
    """Print a few of the per-step losses side by side; return how many steps match."""
    steps = sorted(resumed.losses)
    shown = steps[:3] + ([last] if last not in steps[:3] else [])
    print(f"    {'step':>6}  {'loss':>7}  {'killed, then resumed':>22}  {'uninterrupted':>22}")
    for s in shown:
        if s == last and len(steps) > 4:
            print(f"    {'...':>6}")
        a, b = resumed.losses[s], reference.losses[s]
        same = "same" if a == b else "DIFFERENT"
        print(f"    {s:>6}  {float.fromhex(a):7.4f}  {a:>22}  {b:>22}  {same}")
    return sum(resumed.losses[s] == reference.losses.get(s) for s in steps)


# -- damage -------------------------------------------------------------------------------


def flip_one_bit(path: str) -> int:
    """Flip one bit a third of the way into the file (inside the tensor data); return the offset."""
    offset = os.path.getsize(path) // 3
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    return offset


def show_fallback(run_dir: str, archive: str | None = None) -> int | None:
    """Load the newest checkpoint with fallback=True; print the warning; return the step loaded."""
    mgr = ckptfmt.CheckpointManager(run_dir, archive=archive)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = mgr.load(fallback=True)
    for w in caught:
        print(f"    warning: {str(w.message)[:300]}")
    return state.get("step") if isinstance(state, dict) else None


# -- timings --------------------------------------------------------------------------------


def save_timings(directory: str, repeats: int = 5) -> tuple[float, float, float]:
    """Median seconds of: a blocking save; a non-blocking save's return; its commit (the state
    of ckptfmt.demo.training, saved in this process)."""
    run = training.build_run()
    blocking = ckptfmt.CheckpointManager(os.path.join(directory, "blocking"), keep_last=2)
    background = ckptfmt.CheckpointManager(os.path.join(directory, "background"), keep_last=2, blocking=False)
    t_block: list[float] = []
    t_return: list[float] = []
    t_commit: list[float] = []
    for step in range(1, repeats + 1):
        t = time.perf_counter()
        blocking.save(step, run.state())
        t_block.append(time.perf_counter() - t)
        t = time.perf_counter()
        handle = background.save(step, run.state())
        t_return.append(time.perf_counter() - t)
        if handle is not None:
            handle.wait()
        t_commit.append(time.perf_counter() - t)
    return statistics.median(t_block), statistics.median(t_return), statistics.median(t_commit)


# -- the demo ------------------------------------------------------------------------------


def _kill_step(steps: int, rng: random.Random) -> int:
    """A random step in the middle of the run and of an epoch."""
    per_epoch = training.SEQUENCES // training.BATCH
    return rng.choice([k for k in range(steps // 4, 3 * steps // 4) if k % per_epoch])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--dir", help="where to make the run directories (default: a temp dir under the current one)"
    )
    ap.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    ap.add_argument("--kill-after", type=int, help="kill the run once it reports this step (default: random)")
    ap.add_argument(
        "--archive",
        action="store_true",
        help="archive every step to a local S3 server; resume on a 'new node'",
    )
    args = ap.parse_args(argv)
    if args.steps < 10:
        ap.error("--steps must be at least 10")
    kill_after = args.kill_after or _kill_step(args.steps, random.Random())
    if not 1 <= kill_after < args.steps:
        ap.error("--kill-after must be between 1 and --steps - 1")
    params = sum(p.numel() for p in training.TinyGPT().parameters())
    print(
        f"ckptfmt {ckptfmt.__version__} ({ckptfmt.backend()} engine), torch {torch.__version__}: "
        f"a {params / 1e3:.0f}K-parameter GPT-like model, {args.steps} steps, a checkpoint every step "
        f"(keep_last={KEEP_LAST}, non-blocking)\n"
    )
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="ckptfmt-demo-") as tmp:
        if not args.archive:
            return _demo(tmp, args.steps, kill_after)
        from .s3server import local_s3

        with local_s3() as bucket:
            print(
                f"archive: {bucket}/run on a local S3 server (moto), AWS_ENDPOINT_URL={os.environ['AWS_ENDPOINT_URL']}\n"
            )
            return _demo(tmp, args.steps, kill_after, archive=f"{bucket}/run")


def _demo(tmp: str, steps: int, kill_after: int, archive: str | None = None) -> int:
    run_dir, ref_dir = os.path.join(tmp, "run"), os.path.join(tmp, "uninterrupted")
    final, ref_final = os.path.join(tmp, "final.ckpt"), os.path.join(tmp, "final-uninterrupted.ckpt")
    save_args = SAVE_ARGS + (["--archive", archive] if archive else [])

    killed = training.run_child(run_dir, steps, save_args, kill_after=kill_after)
    if killed.killed_after is None:
        raise SystemExit(f"demo: the run ended before step {kill_after}:\n{killed.stderr[-3000:]}")
    print(
        f"1. training in a child process (pid {killed.pid}), SIGKILLed once it reported step "
        f"{killed.killed_after} (exit {killed.returncode}, {killed.seconds:.1f}s incl. start-up)"
    )
    print(f"2. ckptfmt ls {_short(run_dir)}")
    show_listing(run_dir)
    if archive:
        print(f"   ckptfmt ls {archive}")
        show_listing(archive)
        shutil.rmtree(run_dir)
        run_dir = os.path.join(tmp, "new-node")
        print(f"   the node is lost: its run directory is deleted; a new node starts in {_short(run_dir)}")

    resumed = _checked(training.run_child(run_dir, steps, [*save_args, "--final", final]), "resumed run")
    start = resumed.resumed_from
    in_flight = (
        f" (the kill came before step {killed.killed_after}'s save committed)"
        if start is not None and start < killed.killed_after
        else ""
    )
    print(
        f"3. a fresh process resumed from latest() = step {start}{in_flight} and trained steps "
        f"{(start or 0) + 1}..{steps} ({resumed.seconds:.1f}s)"
    )
    reference = _checked(
        training.run_child(ref_dir, steps, [*SAVE_ARGS, "--final", ref_final]), "reference run"
    )
    print(f"4. the same run, uninterrupted ({reference.seconds:.1f}s), compared bit for bit:")
    same_losses = compare_losses(resumed, reference, steps)
    a, b = ckptfmt.load(final), ckptfmt.load(ref_final)
    diff = differences(a, b)
    n_tensors, n_bytes = count_tensors(a)
    print(
        f"    losses: {same_losses} of {len(resumed.losses)} steps after the resume identical; "
        f"final state: {n_tensors} tensors ({_mib(n_bytes)}: weights, AdamW moments and steps, ...) "
        + ("identical" if not diff else f"DIFFER at {', '.join(diff[:5])}")
    )

    newest = ckptfmt.CheckpointManager(run_dir).latest()
    assert newest is not None  # the resumed run committed its last step
    offset = flip_one_bit(newest.state_path)
    print(
        f"5. flipped one bit at byte {offset} of step {newest.step}'s {os.path.basename(newest.state_path)}:"
    )
    verified = _cli("verify", _short(newest.state_path))
    print(_indent(verified.stdout or verified.stderr) + f"\n    (ckptfmt verify exit {verified.returncode})")
    still = ckptfmt.CheckpointManager(run_dir).latest()
    print(
        f"    latest() is still step {still.step if still else None}: the commit record, file lengths and "
        "index checksums hold; the chunk checksums catch the damage on load:"
    )
    fell_back_to = show_fallback(run_dir, archive)
    expected = newest.step if archive else newest.step - 1
    print(
        f"    load(fallback=True) returned step {fell_back_to}"
        + (" (the archived copy of the damaged step)" if archive else "")
    )

    t_block, t_return, t_commit = save_timings(os.path.join(tmp, "timing"))
    ok = (
        same_losses == len(resumed.losses) == steps - (start or 0)
        and not diff
        and verified.returncode == 1
        and fell_back_to == expected
    )
    print(
        f"\nsummary: killed after step {killed.killed_after}, resumed from step {start}; "
        f"{'bit-identical' if ok else 'NOT identical'} to the uninterrupted run. "
        f"One checkpoint: {_mib(newest.size)}; a blocking save {t_block * 1e3:.0f} ms, a non-blocking one "
        f"returns in {t_return * 1e3:.0f} ms and commits in {t_commit * 1e3:.0f} ms (median of 5, this machine)."
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

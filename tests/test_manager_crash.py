"""Crash campaign for CheckpointManager: SIGKILL a training run at random instants.

A worker (tests/manager_crash_child.py) resumes from ``latest()``, trains a tiny
model and saves every step with ``keep_last=2`` and non-blocking saves, at most
``IN_FLIGHT`` of them in flight.  After every kill the directory must hold:

* a newest complete checkpoint that verifies, loads, and holds exactly the state
  the uninterrupted run has at that step (model, AdamW state, step: computed here
  by running the same trainer from scratch), and whose step is not behind the
  last step the worker saw committed nor ahead of the last one it started;
* complete checkpoints that are consecutive steps, at least ``keep_last`` of them
  (rotation never deletes what it keeps) and at most ``keep_last + 1`` (commits
  are serialised, each followed by its rotation, so only the newest commit can be
  un-rotated when the kill lands);
* besides them, at most one unfinished entry per save in flight (a temporary or
  uncommitted step directory, or one being retired), at most one temporary file
  per save in flight, and nothing else;
* none of the unfinished entries seen after the previous kill, once the next
  worker has completed a save (a save removes what crashed saves left).

CKPTFMT_MANAGER_KILLS sets the number of kills (150 by default; ``make soak``
runs 10,000), CKPTFMT_MANAGER_SEED the seed of the kill instants.
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from manager_crash_child import IN_FLIGHT, KEEP_LAST, Trainer, flat_state

import ckptfmt
from ckptfmt.engine.marks import MARK_NAME
from ckptfmt.files.multifile import COMMIT_NAME
from ckptfmt.runs.steps import STATE_NAME, parse_step_dirname

KILLS = int(os.environ.get("CKPTFMT_MANAGER_KILLS", "150"))
#: the kill instants' seed (timing noise makes runs differ anyway; this varies them on purpose)
SEED = int(os.environ.get("CKPTFMT_MANAGER_SEED", "20240601"))
#: a kill lands uniformly in [0, MAX_DELAY) s after the fork: a worker takes
#: tens of ms to resume and ~10 ms per step, so this covers startup and many saves
MAX_DELAY = 0.2
TEMP_MARK = ".ckptfmt-tmp."
_TEMP_DIR_RE = re.compile(r"\.step-([0-9]{9,20})\.ckptfmt-tmp\.[0-9a-f]{16}\.[0-9]+\.[0-9]+\.[0-9a-f]{8}")
# spec section 10: .<name>.ckptfmt-tmp.<host>.<pid>.<start>.<random>
_TEMP_FILE_RE = re.compile(r"\.(state\.ckpt|COMMIT)\.ckptfmt-tmp\.[0-9a-f]{16}\.[0-9]+\.[0-9]+\.[0-9a-f]{8}")
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "manager_crash_child.py")


class Server:
    """The fork server: one worker per start(), each SIGKILLed by kill()."""

    def __init__(self, run_dir: str, progress: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, run_dir, progress],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = 0

    def start(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.pid = int(self.proc.stdout.readline())
        return self.pid

    def kill(self) -> None:
        assert self.proc.stdout is not None
        os.kill(self.pid, signal.SIGKILL)
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["reaped"], line
        status = int(line[1])
        # a worker only ends by our kill: anything else is an error it printed to stderr
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"worker {self.pid} ended on its own (status {status}); see its traceback above"
        )

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Progress:
    """What the workers reported in the progress file, read incrementally."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.last_done = 0  # the newest step whose save returned complete (0: none yet)
        self.last_begun = 0
        self.begun: dict[int, set[int]] = collections.defaultdict(set)  # pid -> steps
        self.done: dict[int, set[int]] = collections.defaultdict(set)
        self.warnings: list[str] = []

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # the worker is dead, but keep to whole lines anyway
        self.offset += end
        for line in data[:end].decode().splitlines():
            kind, rest = line.split(" ", 1)
            if kind == "warn":
                self.warnings.append(rest)
                continue
            step, pid = map(int, rest.split())
            if kind == "begin":
                assert step > self.last_done, f"{line}: step {self.last_done} was already committed"
                self.begun[pid].add(step)
                self.last_begun = max(self.last_begun, step)
            else:
                assert kind == "done" and step in self.begun[pid], line
                assert step > self.last_done, f"{line}: steps are committed in order"
                self.done[pid].add(step)
                self.last_done = step

    def unfinished(self, pid: int) -> set[int]:
        return self.begun[pid] - self.done[pid]

    def started(self, pid: int) -> None:
        """A worker with this pid starts: pids are reused, an earlier worker's steps are not its."""
        self.begun.pop(pid, None)
        self.done.pop(pid, None)


class Reference:
    """The uninterrupted run: the same trainer from scratch, on its own RNG stream."""

    def __init__(self) -> None:
        with torch.random.fork_rng(devices=[]):
            self.trainer = Trainer()
            self.rng = torch.get_rng_state()
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def at(self, step: int) -> dict[str, torch.Tensor]:
        while self.trainer.step < step:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self.rng)
                self.trainer.train_step()
                self.rng = torch.get_rng_state()
            t = self.trainer
            flat = flat_state(t.model.state_dict(), t.opt.state_dict())
            self.states[t.step] = {k: v.detach().clone() for k, v in flat.items()}
        return self.states[step]

    def forget_before(self, step: int) -> None:
        for s in [s for s in self.states if s < step]:
            del self.states[s]


@dataclass
class Scan:
    """A run directory as found after a kill."""

    complete: list[int]
    unfinished: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name -> signature
    temp_files: list[str] = field(default_factory=list)
    phases: set[str] = field(default_factory=set)


def _signature(path: str) -> tuple[int, int, int]:
    # a recreated directory of the same name has another inode or change time
    st = os.stat(path)
    return st.st_ino, st.st_ctime_ns, st.st_mtime_ns


def _walk_names(path: str) -> Iterator[str]:
    for root, dirs, files in os.walk(path):
        yield from (os.path.join(root, n) for n in dirs + files)


def scan(run_dir: str, mgr: ckptfmt.CheckpointManager) -> Scan:
    """Classify every entry of the run directory; fail on anything a save could not have left."""
    infos = mgr.checkpoints()
    out = Scan(complete=[c.step for c in infos])
    complete_names = {os.path.basename(c.path) for c in infos}
    newest = out.complete[-1] if out.complete else -1
    out.temp_files = [
        p for p in _walk_names(run_dir) if TEMP_MARK in os.path.basename(p) and os.path.isfile(p)
    ]
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        assert os.path.isdir(path) and not os.path.islink(path), f"stray file {name}"
        inside = set(os.listdir(path)) - {MARK_NAME}  # ckptfmt's mark: in every folder it makes
        if name in complete_names:
            assert inside == {STATE_NAME, COMMIT_NAME}, f"{name} is complete but holds {sorted(inside)}"
            continue
        temp_dir = _TEMP_DIR_RE.fullmatch(name)
        step = int(temp_dir.group(1)) if temp_dir else parse_step_dirname(name)
        assert step is not None, f"stray directory {name}"
        assert temp_dir is None or not inside, f"{name}: files in a directory not yet renamed into place"
        # named, a folder bears the mark (removed last by a deletion): it stays provably ckptfmt's
        assert temp_dir or not inside or MARK_NAME in os.listdir(path), f"{name}: files but no mark"
        # a commit record is renamed in last and unlinked first: never in an unfinished step
        for n in inside:
            assert n == STATE_NAME or _TEMP_FILE_RE.fullmatch(n), f"stray file {name}/{n}"
        out.unfinished[name] = _signature(path)
        # which part of a save (or of a rotation) the kill interrupted, for the report
        if temp_dir:
            out.phases.add("make step dir")
        elif step < newest:
            out.phases.add("retire")
        elif any(n.startswith(".state.ckpt") for n in inside):
            out.phases.add("write state")
        elif any(n.startswith(".COMMIT") for n in inside):
            out.phases.add("write commit")
        elif STATE_NAME in inside:
            out.phases.add("state written, no commit")
        else:
            out.phases.add("empty step dir")
    if len(out.complete) > KEEP_LAST:
        out.phases.add("commit, rotation pending")
    return out


def check_after_kill(
    n: int, run_dir: str, progress: Progress, reference: Reference, previous: Scan | None, pid: int
) -> Scan:
    """Every promise the manager makes about a directory its writer died in; returns the scan."""
    where = f"kill {n} (worker {pid})"
    mgr = ckptfmt.CheckpointManager(run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)  # the unfinished steps skipped
        info = mgr.latest()
        found = scan(run_dir, mgr)
    assert not progress.warnings, f"{where}: workers warned: {progress.warnings[:5]}"

    # latest(): never behind a save that returned, never ahead of a save that started
    if progress.last_done:
        assert info is not None, f"{where}: no checkpoint, yet step {progress.last_done} was committed"
    if info is None:
        assert found.complete == [], where
    else:
        assert found.complete[-1] == info.step, f"{where}: latest() {info.step}, complete {found.complete}"
        assert progress.last_done <= info.step <= progress.last_begun, (
            f"{where}: latest() is step {info.step}, the worker committed {progress.last_done} "
            f"and began {progress.last_begun}"
        )
        report = mgr.verify()
        assert report.ok, f"{where}: step {info.step}: {report.problems}"

    # rotation: consecutive steps, the keep_last newest kept, one extra at most
    c = found.complete
    if c:
        assert c == list(range(c[0], c[-1] + 1)), f"{where}: checkpoints {c} are not consecutive"
        assert min(KEEP_LAST, c[-1]) <= len(c) <= KEEP_LAST + 1, (
            f"{where}: checkpoints {c}; after the previous kill {previous and previous.complete}; "
            f"this worker began {sorted(progress.begun[pid])}, saw done {sorted(progress.done[pid])}"
        )
    # every complete checkpoint holds exactly the uninterrupted run's state at its step
    for step in c:
        state = mgr.load(step)
        expected = reference.at(step)
        got = flat_state(state["model"], state["optim"])
        assert got.keys() == expected.keys(), f"{where}: step {step}: keys {sorted(got)}"
        for k, v in expected.items():
            assert torch.equal(got[k], v), f"{where}: step {step}: {k} differs from the uninterrupted run"
        assert state["step"] == step and state["data"] == {"batch": step}, f"{where}: {state['step']}"

    # nothing accumulates: one unfinished entry and one temporary file per save in flight
    assert len(found.unfinished) <= IN_FLIGHT, f"{where}: unfinished entries {sorted(found.unfinished)}"
    assert len(found.temp_files) <= IN_FLIGHT, f"{where}: temporary files {found.temp_files}"
    # a worker that completed a save removed every entry the one before it abandoned
    if previous is not None and progress.done[pid]:
        for name, sig in previous.unfinished.items():
            assert found.unfinished.get(name) != sig, (
                f"{where}: {name}, abandoned by the previous worker, survived this worker's saves"
            )
    return found


@pytest.mark.slow
def test_sigkill_campaign_on_a_rotating_run(tmp_path):
    run_dir, progress_path = str(tmp_path / "run"), str(tmp_path / "progress.txt")
    progress = Progress(progress_path)
    reference = Reference()
    server = Server(run_dir, progress_path)
    rng = random.Random(SEED)
    phases: collections.Counter[str] = collections.Counter()
    mid_save = with_checkpoint = 0
    previous: Scan | None = None
    started = time.monotonic()
    try:
        for n in range(KILLS):
            pid = server.start()
            progress.started(pid)
            time.sleep(rng.uniform(0.0, MAX_DELAY))
            server.kill()
            progress.read()
            found = check_after_kill(n, run_dir, progress, reference, previous, pid)
            # a kill "mid-save": the worker had begun a save it never saw complete, and it
            # left an unfinished entry (leftovers of an earlier worker do not count alone)
            if progress.unfinished(pid) and found.unfinished:
                mid_save += 1
            with_checkpoint += bool(found.complete)
            phases.update(found.phases or ({"idle or training"} if progress.begun[pid] else {"resume"}))
            reference.forget_before(progress.last_done - KEEP_LAST - 1)
            previous = found
    finally:
        server.close()
    elapsed = time.monotonic() - started
    print(
        f"\n{KILLS} kills in {elapsed:.1f} s, up to step {progress.last_done}; "
        f"{mid_save} mid-save ({mid_save / KILLS:.0%}); phases: {dict(phases.most_common())}"
    )
    assert with_checkpoint > KILLS // 2, "most workers never saved: the kills come too early"
    assert mid_save > 0.2 * KILLS, f"only {mid_save} of {KILLS} kills landed mid-save"


def test_next_save_removes_a_save_abandoned_unseen(tmp_path):
    """Kill a worker mid-save and look only at the raw directory (no manager call in
    between): the next worker's first completed save must have removed what was left."""
    run_dir, progress_path = str(tmp_path / "run"), str(tmp_path / "progress.txt")
    progress = Progress(progress_path)
    server = Server(run_dir, progress_path)
    abandoned: dict[str, tuple[int, int, int]] = {}
    try:
        for _attempt in range(50):
            pid = server.start()
            progress.started(pid)
            time.sleep(0.1)  # past the resume, into the saves
            deadline = time.monotonic() + 10
            # wait until a save is writing its state file, then kill at once
            while not any(
                n.startswith(".state.ckpt" + TEMP_MARK)
                for p in _walk_names(run_dir)
                for n in [os.path.basename(p)]
            ):
                assert time.monotonic() < deadline, "no save seen writing in 10 s"
            server.kill()
            for name in os.listdir(run_dir):
                path = os.path.join(run_dir, name)
                if _TEMP_DIR_RE.fullmatch(name) or not os.path.exists(os.path.join(path, COMMIT_NAME)):
                    abandoned[name] = _signature(path)
            if abandoned:
                break
        assert abandoned, "no kill left an unfinished save behind"
        progress.read()
        # the next worker: wait until its first save has returned complete
        pid = server.start()
        progress.started(pid)
        deadline = time.monotonic() + 30
        while not progress.done[pid]:
            assert time.monotonic() < deadline, "the next worker completed no save in 30 s"
            time.sleep(0.01)
            progress.read()
        server.kill()
    finally:
        server.close()
    for name, sig in abandoned.items():
        path = os.path.join(run_dir, name)
        assert not os.path.exists(path) or _signature(path) != sig, f"{name} was not cleaned up"
    assert not progress.warnings, progress.warnings


class _Died(BaseException):
    """Stands for the process dying: nothing after it runs (not an error a save handles)."""


def test_a_rotation_cut_short_is_finished_before_the_next_commit(tmp_path):
    """Deterministic version of what the campaign found: runs killed between a commit and its
    rotation, one after another, must not pile up checkpoints beyond keep_last + 1."""
    run_dir = str(tmp_path / "run")
    mgr = ckptfmt.CheckpointManager(run_dir, keep_last=KEEP_LAST)
    for step in range(1, KEEP_LAST + 1):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    for step in range(KEEP_LAST + 1, KEEP_LAST + 4):
        mgr = ckptfmt.CheckpointManager(run_dir, keep_last=KEEP_LAST)  # a new process

        def die() -> None:
            raise _Died

        mgr._rotate = die  # type: ignore[method-assign]  # dies right after the commit
        with pytest.raises(_Died):
            mgr.save(step, {"w": torch.full((2,), float(step))})
        steps = [c.step for c in mgr.checkpoints()]
        assert steps == list(range(step - KEEP_LAST, step + 1)), steps
    mgr = ckptfmt.CheckpointManager(run_dir, keep_last=KEEP_LAST)
    mgr.save(step + 1, {"w": torch.zeros(2)})
    assert [c.step for c in mgr.checkpoints()] == [step, step + 1]

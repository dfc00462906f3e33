"""SIGKILL soak of a tiered run: a local CheckpointManager archiving every step to a real local
S3 server (moto), killed at random instants, in plain, signed, encrypted and zstd runs, some
restarts on a "fresh node" (the local directory deleted).

A worker (tests/tiered_soak_child.py) resumes from the tiers' newest complete step, trains a
tiny model and saves every step (keep_last=2, archive_keep_last=4, archive_keep_every=25,
non-blocking, incremental but for the encrypted run).  After every kill:

* the worker resumed from the tiers' newest complete step, as found after the kill before it;
* the newest complete step of each tier holds exactly the uninterrupted run's state there;
* no step a worker saw committed was deleted locally while newer than the archive's newest,
  and every committed step archive_keep_every keeps is in one tier or the other;
* the archive holds no complete step its rules drop;
* local disk holds no complete step but those the local rules keep, those newer than the
  archive's newest (before or after the kill), those archive_keep_every keeps that the
  archive lacks, and one per save in flight whose rotation the kill cut short (checked
  where the worker completed a save: one killed sooner may not have listed the archive).

After a clean end (a worker that saves a few more steps, waits and exits) the archive holds
no prefix that is neither a complete step nor kept for one's objects, no copy marker but in
those kept, and both tiers' newest step is the uninterrupted run's.

CKPTFMT_TIERED_KILLS: kills per mode (6 by default: about a minute for the four modes on two
busy cores; ``make soak-tiered`` runs 500 a mode); CKPTFMT_TIERED_SEED: the seed of the
kill instants and fresh-node restarts.
"""

from __future__ import annotations

import datetime
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from manager_crash_child import IN_FLIGHT, flat_state
from test_manager_crash import Reference
from tiered_soak_child import (
    ARCHIVE_KEEP_EVERY,
    ARCHIVE_KEEP_LAST,
    FROZEN,
    KEEP_LAST,
    MODES,
    tiered_options,
)

import ckptfmt
from ckptfmt.runs import retention
from ckptfmt.runs.objectnames import COPY_MARKER
from ckptfmt.runs.objectrun import ObjectRun

KILLS = int(os.environ.get("CKPTFMT_TIERED_KILLS", "6"))
SEED = int(os.environ.get("CKPTFMT_TIERED_SEED", "20261206"))
#: a kill lands uniformly in [0, MAX_DELAY) s after the fork: resuming takes ~0.1-0.3 s, then
#: a save every ~20 ms and an archive copy every ~0.1-0.3 s
MAX_DELAY = 1.2
FRESH_NODE = 0.08
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiered_soak_child.py")


class Server:
    """The fork server of one run: start() forks a worker, kill() SIGKILLs it."""

    def __init__(self, run_dir: str, progress: str, url: str, endpoint: str, mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, run_dir, progress, url, endpoint, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = 0

    def start(self, line: str = "go") -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        self.pid = int(self.proc.stdout.readline())
        return self.pid

    def reaped(self) -> int:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["reaped"], line
        return int(line[1])

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        status = self.reaped()
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"worker {self.pid} ended on its own (status {status}); see its traceback above"
        )

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@dataclass
class Progress:
    """What the workers appended to the progress file, read incrementally."""

    path: str
    offset: int = 0
    resumed: dict[int, int] = field(default_factory=dict)  # pid -> step
    done: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].decode().splitlines():
            kind, rest = line.split(" ", 1)
            if kind == "warn":
                self.warnings.append(rest)
            elif kind == "resume":
                step, pid = map(int, rest.split())
                self.resumed[pid] = step
            elif kind == "done":
                self.done.append(int(rest.split()[0]))


@dataclass
class Tiers:
    """Both tiers of the run as found after a kill."""

    local: list[int]
    archived: list[int]
    lag_s: float  # how long the oldest local step newer than the archive's newest has waited
    strays: list[int]  # archive prefixes neither complete nor kept for a complete step's objects
    markers: int  # copy markers but in prefixes kept for a complete step's objects
    retained: int

    @property
    def newest(self) -> int:
        return max(self.local + self.archived, default=0)

    @property
    def archive_newest(self) -> int:
        return max(self.archived, default=-1)


class Checker:
    """Reads the two tiers as a resuming worker would, and checks them."""

    def __init__(self, run_dir: str, kw: dict[str, Any], reference: Reference) -> None:
        self.run_dir = run_dir
        self.reference = reference
        reads = {k: kw[k] for k in ("trusted_keys", "encrypt_with") if k in kw}
        if "encrypt_with" in reads:
            reads["decrypt_with"] = reads.pop("encrypt_with")
        self.reads = reads
        self.options = kw["storage_options"]
        self.url = kw["archive"]
        # each tier read on its own: a tiered manager here would start archiving
        self.archive = ckptfmt.CheckpointManager(self.url, storage_options=self.options, **reads)
        self.run = ObjectRun(self.url, self.options)

    def local_manager(self) -> ckptfmt.CheckpointManager:
        return ckptfmt.CheckpointManager(self.run_dir, **self.reads)

    def tiers(self) -> Tiers:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)
            infos = self.local_manager().checkpoints()
            statuses = self.run.statuses()
        local = [c.step for c in infos]
        archived = [s.step for s in statuses if s.info is not None]
        behind = [c.created for c in infos if c.step > max(archived, default=-1)]
        now = datetime.datetime.now(datetime.timezone.utc)
        lag_s = (now - behind[0]).total_seconds() if behind else 0.0
        strays = [s.step for s in statuses if s.info is None and not s.retained]
        retained = {s.step for s in statuses if s.retained}
        keys = self.run.listing()
        markers = sum(
            1
            for step, names in keys.items()
            if step not in retained
            for n in names
            if n.startswith(COPY_MARKER)
        )
        return Tiers(local, archived, lag_s, strays, markers, len(retained))

    def check_state(self, where: str, mgr: ckptfmt.CheckpointManager, step: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)
            state = mgr.load(step)
        expected = self.reference.at(step)
        got = flat_state(state["model"], state["optim"])
        assert got.keys() == expected.keys(), f"{where}: step {step}: keys {sorted(got)}"
        for k, v in expected.items():
            assert torch.equal(got[k], v), f"{where}: step {step}: {k} differs from the uninterrupted run"
        assert state["step"] == step and state["data"] == {"batch": step}, where
        assert torch.equal(state["frozen"], FROZEN), f"{where}: step {step}: the frozen tensor differs"


def _kept_locally(t: Tiers, archive_before: int) -> set[int]:
    """The local steps the rules allow after a kill (the module docstring's last point)."""
    rules = retention.kept_steps([(s, {}) for s in t.local], keep_last=KEEP_LAST)
    newer = {s for s in t.local if s > min(archive_before, t.archive_newest)}
    owed = {s for s in t.local if s % ARCHIVE_KEEP_EVERY == 0 and s not in t.archived}
    return rules | newer | owed


def soak(tmp_path: Any, s3_server: Any, mode: str, kills: int, seed: int) -> dict[str, Any]:
    bucket = s3_server.new_bucket()
    run_dir, progress_path = str(tmp_path / mode / "run"), str(tmp_path / mode / "progress.txt")
    os.makedirs(os.path.dirname(run_dir))
    url = f"s3://{bucket}/run"
    kw = tiered_options(mode, url, s3_server.endpoint_url)
    reference = Reference()
    check = Checker(run_dir, kw, reference)
    progress = Progress(progress_path)
    server = Server(run_dir, progress_path, url, s3_server.endpoint_url, mode)
    rng = random.Random(f"{seed}-{mode}")
    stats: dict[str, Any] = {
        "kills": 0,
        "fresh": 0,
        "resumes": 0,
        "max_lag": 0,
        "max_lag_s": 0.0,
        "max_extra": 0,
        "max_strays": 0,
    }
    expected_resume = 0
    committed: set[int] = set()  # steps workers saw committed (since the last fresh node)
    archive_before = -1
    try:
        for n in range(kills):
            pid = server.start()
            progress.resumed.pop(pid, None)  # pids are reused: an earlier worker's is not this one's
            time.sleep(rng.uniform(0.0, MAX_DELAY))
            server.kill()
            progress.read()
            where = f"{mode}: kill {n} (worker {pid})"
            assert not progress.warnings, f"{where}: workers warned: {progress.warnings[:5]}"
            if pid in progress.resumed:
                stats["resumes"] += 1
                assert progress.resumed[pid] == expected_resume, (
                    f"{where}: resumed from step {progress.resumed[pid]}, the tiers' newest was {expected_resume}"
                )
            saved = bool(progress.done)
            committed.update(progress.done)
            progress.done.clear()
            t = check.tiers()
            a = t.archive_newest
            lost = sorted(s for s in committed if s > a and s not in t.local)
            assert not lost, (
                f"{where}: steps {lost} deleted locally, the archive's newest is {a}; local {t.local}"
            )
            owed = sorted(
                s for s in committed if s % ARCHIVE_KEEP_EVERY == 0 and s not in t.local + t.archived
            )
            assert not owed, f"{where}: steps {owed} that archive_keep_every keeps are in neither tier"
            rules = retention.kept_steps(
                [(s, {}) for s in t.archived], keep_last=ARCHIVE_KEEP_LAST, keep_every=ARCHIVE_KEEP_EVERY
            )
            assert set(t.archived) == rules, (
                f"{where}: the archive holds {t.archived}, its rules keep {sorted(rules)}"
            )
            extra = sorted(set(t.local) - _kept_locally(t, archive_before))
            if saved:  # (a worker killed before any save may not have listed the archive yet)
                assert len(extra) <= IN_FLIGHT, (
                    f"{where}: local {t.local}, archive {t.archived}: extra {extra}"
                )
            if t.local:
                check.check_state(where, check.local_manager(), t.local[-1])
            if t.archived:
                check.check_state(where, check.archive, t.archived[-1])
            stats["kills"] += 1
            stats["max_lag"] = max(stats["max_lag"], sum(1 for s in t.local if s > a))
            stats["max_lag_s"] = round(max(stats["max_lag_s"], t.lag_s), 2)
            stats["max_extra"] = max(stats["max_extra"], len(extra))
            stats["max_strays"] = max(stats["max_strays"], len(t.strays))
            archive_before = a
            expected_resume = t.newest
            if rng.random() < FRESH_NODE:  # the node is lost: a new one starts from the archive
                shutil.rmtree(run_dir)
                stats["fresh"] += 1
                committed = {s for s in committed if s in t.archived}
                expected_resume = max(t.archived, default=0)
            reference.forget_before(min(expected_resume, max(a, 0)) - ARCHIVE_KEEP_LAST - 1)
        # the clean end: a worker saves a few more steps, waits for them and their copies, exits
        final = expected_resume + 5
        server.start(f"finish {final}")
        status = server.reaped()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
            f"{mode}: the last worker failed ({status})"
        )
        progress.read()
        assert not progress.warnings, f"{mode}: the last worker warned: {progress.warnings[:5]}"
    finally:
        server.close()
    # what killed copies left is removed once older than the bound by the store's time (a plain
    # saver on another host may be writing into such a step): here a pass a day later
    check.run.remove_interrupted_copies(datetime.timedelta(0))
    t = check.tiers()
    assert t.strays == [] and t.markers == 0, (
        f"{mode}: after a clean end: strays {t.strays}, {t.markers} markers"
    )
    assert t.local[-1] == t.archived[-1] == final, (mode, t.local, t.archived)
    check.check_state(f"{mode}: the end", check.local_manager(), final)
    check.check_state(f"{mode}: the end", check.archive, final)
    stats["final_step"] = final
    stats["retained_at_end"] = t.retained
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_tiered_run_survives_sigkill(tmp_path, s3_server, mode):
    started = time.monotonic()
    stats = soak(tmp_path, s3_server, mode, KILLS, SEED)
    elapsed = time.monotonic() - started
    print(f"\n{mode}: {stats} in {elapsed:.1f} s ({stats['kills'] / elapsed:.2f} kills/s)")
    # the campaign is not vacuous: workers get as far as resuming (how many depends on how busy
    # the machine is: 24% to 60% of 500 kills were seen, the invariants checked after each)
    assert stats["resumes"] >= max(1, KILLS // 8), f"{mode}: workers never resumed: the kills come too early"

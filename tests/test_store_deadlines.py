"""Every wait on an object store ends at a deadline: one per operation, covering all its
attempts (ckptfmt retries, botocore does not), on each store (S3, GCS and Azure emulators)
behind the fault proxy that stalls or trickles their answers.  The errors say what was tried
for how long; `ckptfmt ls` on a store that answers nothing exits within the deadline, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptfmt
from ckptfmt.errors import StorageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outcome_within(seconds: float, work: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """What `work` raised (None if it returned) and how long it took; fails the test when it
    is still running after `seconds` (left behind on a daemon thread)."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            work()
        except BaseException as e:
            box[0] = e

    started = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s"
    return box[0], time.monotonic() - started


def _run(faults, **options: Any) -> ckptfmt.CheckpointManager:
    url = f"{faults.new_root()}/run"
    m = ckptfmt.CheckpointManager(url, storage_options=faults.options | options)
    m.save(1, {"w": torch.ones(100)})
    return m


def test_a_record_the_store_never_answers_gives_up_at_one_deadline(store_faults):
    """The issue's case: request_timeout=4, read_timeout=3, max_attempts=3 took about 27 s a
    record (botocore's 3 attempts in each of ckptfmt's 3).  One deadline of 5 s covers them
    all; each attempt is one request, and the error names the attempts, time and options."""
    f = store_faults
    m = _run(f, request_timeout=4, read_timeout=3, max_attempts=3, deadline=5)
    f.delay(*f.op("read", "step-000000001/COMMIT"), seconds=60)
    f.clear_counts()
    e, took = _outcome_within(40, lambda: m.run.record(1))
    assert isinstance(e, StorageError), repr(e)
    assert took < 5 + 3 + 2, took  # the deadline, and at most one socket wait begun before it
    assert f.count(*f.op("read", "step-000000001/COMMIT")) <= 3
    assert "max_attempts 3, deadline 5 s" in str(e) and e.path.endswith("/step-000000001/COMMIT")


def test_an_error_the_store_may_not_make_again_is_retried_by_ckptfmt_only(store_faults):
    # two 503s, then the answer: three requests in all (botocore adds none of its own)
    f = store_faults
    m = _run(f, max_attempts=3)
    f.fail_next(*f.op("read", "step-000000001/COMMIT"), status=503, count=2)
    f.clear_counts()
    assert m.run.record(1).step == 1
    assert f.count(*f.op("read", "step-000000001/COMMIT")) == 3
    # a ranged read likewise, resumed within its budget
    f.fail_next(*f.op("read", "state.ckpt"), status=500, count=2)
    assert torch.equal(m.load(1)["w"], torch.ones(100))


def test_a_trickled_listing_is_cut_off_at_the_deadline(store_faults):
    # a listing sent one byte every 0.3 s never goes quiet long enough for read_timeout
    m = _run(store_faults, deadline=3)
    store_faults.trickle(*store_faults.op("list"), after_bytes=10, interval=0.3)
    e, took = _outcome_within(30, m.statuses)
    assert isinstance(e, StorageError), repr(e)
    assert took < 3 + 3, took
    # the listing's own deadline error (its pages share it), naming the option
    assert "the listing took more than 3 s (storage option deadline)" in str(e), str(e)
    store_faults.clear_rules()
    assert [s.step for s in m.statuses()] == [1]


def test_ls_on_a_store_that_stalls_every_request_exits_naming_the_deadline(store_faults):
    """`python -m ckptfmt ls URL` (a subprocess, settings from the environment: the AWS_*
    variables, STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING) against a store that
    holds every request: an error naming the deadline, within it."""
    root = store_faults.new_root()
    env = dict(os.environ)  # the GCS and Azure fixtures set their variables here
    if store_faults.kind == "s3":
        options = store_faults.options
        env.update(
            AWS_ENDPOINT_URL=options["endpoint_url"],
            AWS_ACCESS_KEY_ID=options["aws_access_key_id"],
            AWS_SECRET_ACCESS_KEY=options["aws_secret_access_key"],
            AWS_DEFAULT_REGION="us-east-1",
        )
    env.update(CKPTFMT_STORAGE_DEADLINE="3", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    store_faults.delay(None, "", seconds=120)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfmt", "ls", f"{root}/run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert proc.returncode != 0, proc
    assert "deadline 3 s" in proc.stderr + proc.stdout, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    # the interpreter's start and torch's import, then one operation's deadline
    assert took < 60, took


@pytest.mark.parametrize("value", ["0", "soon", "-1"])
def test_a_deadline_that_is_not_seconds_is_refused(s3_faults, monkeypatch, value):
    monkeypatch.setenv("CKPTFMT_STORAGE_DEADLINE", value)
    with pytest.raises(ValueError, match="CKPTFMT_STORAGE_DEADLINE"):
        ckptfmt.CheckpointManager(
            f"s3://{s3_faults.new_bucket()}/run", storage_options=s3_faults.storage_options()
        ).statuses()
    with pytest.raises(ValueError, match="storage option deadline"):
        ckptfmt.CheckpointManager("s3://bucket/run", storage_options={"deadline": 0})


def test_latest_reads_steps_newest_first_and_stops_at_the_first_complete_one(store_faults):
    f = store_faults
    url = f"{f.new_root()}/run"
    m = ckptfmt.CheckpointManager(url, storage_options=f.options)
    for step in (1, 2, 3, 4):
        m.save(step, {"w": torch.full((10,), float(step))})
    ckptfmt.save({"w": torch.zeros(1)}, f"{url}/step-000000005/state.ckpt", storage_options=m.run.options)
    m = ckptfmt.CheckpointManager(url, storage_options=m.run.options)  # a resume: no record read yet
    f.clear_counts()
    with pytest.warns(ckptfmt.CheckpointWarning, match="step-000000005: no commit record"):
        assert m.latest().step == 4
    assert f.count(*f.op("read", "/COMMIT")) == 1  # step 4's record alone
    # a damaged newest step: the resume falls back past it, reading records newest first
    f.fail_next(*f.op("read", "step-000000004/state.ckpt"), status=403, count=50)
    with pytest.warns(ckptfmt.CheckpointWarning, match="skipping step 4"):
        assert m.load(fallback=True)["w"][0] == 3


@pytest.mark.parametrize(
    "kind, key, operation",
    [
        ("write", "step-000000002/COMMIT", lambda m: m.save(2, {"w": torch.ones(100)})),  # an upload
        ("read", "step-000000001/state.ckpt", lambda m: m.load(1)),  # a ranged read
        (
            "head",
            "step-000000001/state.ckpt",
            lambda m: ckptfmt.open(m.run.step_path(1) + "/state.ckpt", storage_options=m.run.options).close(),
        ),
        ("delete", "step-000000001", lambda m: m.remove(1)),
    ],
    ids=["upload", "ranged-read", "head", "delete"],
)
def test_every_kind_of_request_the_store_holds_ends_at_the_deadline(store_faults, kind, key, operation):
    m = _run(store_faults, deadline=3, read_timeout=2)
    store_faults.delay(*store_faults.op(kind, key), seconds=60)
    e, took = _outcome_within(40, lambda: operation(m))
    assert isinstance(e, StorageError), repr(e)
    assert took < 3 + 2 + 3, took  # the deadline, and at most one socket wait begun before it
    assert "deadline 3 s" in str(e), str(e)


def test_waiting_for_an_archive_that_stalls_ends_at_the_waits_deadline(store_faults, tmp_path):
    """A tiered manager's archive copy is held by a store that does not answer its uploads:
    waiting for the archive ends at the wait's deadline with an error naming the step being
    copied and the deadline; the copy goes on, and lands once the store answers."""
    f = store_faults
    m = ckptfmt.CheckpointManager(
        str(tmp_path / "run"), archive=f"{f.new_root()}/run", storage_options=f.options
    )
    f.delay(*f.op("write", "step-000000001/"), seconds=6.0, count=1)  # the step's first upload
    m.save(1, {"w": torch.ones(1000), "step": 1})
    assert m._archiver is not None
    held_by = time.monotonic() + 30
    while f.pending_rules() and time.monotonic() < held_by:
        time.sleep(0.02)  # until the archive thread's upload is being held
    assert f.pending_rules() == 0
    error, took = _outcome_within(20, lambda: m._archiver.wait(timeout=1.5))
    assert isinstance(error, StorageError), error
    assert "step 1" in str(error) and "deadline of 1.5 s" in str(error)
    assert 1.5 <= took < 5
    f.release()
    m._archiver.wait()  # the held upload goes through: the copy completes
    assert 1 in m._archiver._held

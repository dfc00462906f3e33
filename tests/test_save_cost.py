"""Every save says what it cost: ckptfmt.save returns a SaveHandle (done when blocking) whose
``cost`` gives the time the caller was blocked, the time to durable, the bytes written and the
throughput, and each save logs that at INFO on the "ckptfmt" logger (silent by default)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

import ckptfmt
from ckptfmt.engine import native as _native

STATE = {"w": torch.arange(1 << 18, dtype=torch.float32), "step": 3}


def _check(cost: ckptfmt.SaveCost, path: str, nbytes: int) -> None:
    assert cost.path == path and cost.bytes == nbytes > 1 << 20
    assert 0 < cost.blocked_s <= cost.durable_s < 60
    assert cost.throughput == pytest.approx(nbytes / cost.durable_s)


def test_a_blocking_save_returns_its_cost(tmp_path, caplog):
    path = str(tmp_path / "a.ckpt")
    with caplog.at_level(logging.INFO, logger="ckptfmt"):
        handle = ckptfmt.save(STATE, path)
    assert handle.done() and handle.exception() is None
    _check(handle.cost, path, os.path.getsize(path))
    assert handle.cost.blocked_s == handle.cost.durable_s  # it returned once durable
    lines = [r.getMessage() for r in caplog.records if r.name == "ckptfmt"]
    assert len(lines) == 1 and lines[0].startswith(f"saved {path}: {os.path.getsize(path)} bytes")


@pytest.mark.parametrize("snapshot", ["copy", "fork"])
def test_a_nonblocking_save_reports_once_durable(tmp_path, caplog, snapshot):
    if snapshot == "fork" and not _native.available():
        pytest.skip("fork snapshots need the C engine")
    path = str(tmp_path / "b.ckpt")
    with caplog.at_level(logging.INFO, logger="ckptfmt"):
        handle = ckptfmt.save(STATE, path, blocking=False, snapshot=snapshot)
        handle.wait()
    _check(handle.cost, path, os.path.getsize(path))
    lines = [r.getMessage() for r in caplog.records if r.name == "ckptfmt"]
    assert len(lines) == 1 and "caller blocked" in lines[0] and "durable after" in lines[0]


def test_a_failed_save_has_no_cost(tmp_path):
    """A background write that fails (EFBIG past RLIMIT_FSIZE) reports its error and no cost."""
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, previous[1]))
        handle = ckptfmt.save(STATE, str(tmp_path / "c.ckpt"), blocking=False)
        assert isinstance(handle.exception(), OSError)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)
    assert handle.cost is None


def test_an_object_save_reports_the_object_size(s3_server):
    bucket, options = s3_server.new_bucket(), s3_server.storage_options()
    handle = ckptfmt.save(STATE, f"s3://{bucket}/x.ckpt", storage_options=options)
    size = s3_server.client().head_object(Bucket=bucket, Key="x.ckpt")["ContentLength"]
    _check(handle.cost, f"s3://{bucket}/x.ckpt", int(size))


def test_the_log_is_silent_unless_configured(tmp_path):
    code = f"import torch, ckptfmt; ckptfmt.save({{'w': torch.ones(4)}}, {str(tmp_path / 'e.ckpt')!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "" and out.stdout == ""


def test_a_manager_reports_each_step(tmp_path, s3_bucket, caplog):
    """CheckpointManager.save_cost(step): blocked, durable, bytes of the step's files and, in
    a tiered run, the time until the archive held it; one INFO line per committed step."""
    bucket, options = s3_bucket
    with caplog.at_level(logging.INFO, logger="ckptfmt"):
        m = ckptfmt.CheckpointManager(
            tmp_path / "run", archive=f"s3://{bucket}/run", storage_options=options, blocking=False
        )
        m.save(1, STATE)
        m.wait()
    cost = m.save_cost(1)
    state_file = tmp_path / "run" / "step-000000001" / "state.ckpt"
    assert cost is not None and cost.bytes == state_file.stat().st_size
    assert 0 < cost.blocked_s <= cost.durable_s <= cost.archived_s < 60
    assert m.save_cost(2) is None
    lines = [
        r.getMessage() for r in caplog.records if r.name == "ckptfmt" and "step 1 committed" in r.getMessage()
    ]
    assert len(lines) == 1 and f"{cost.bytes} bytes" in lines[0] and "archive lag" in lines[0]
    blocking = ckptfmt.CheckpointManager(tmp_path / "b")
    assert blocking.save(1, STATE) is None  # a blocking save returns once committed
    assert blocking.save_cost(1).blocked_s == blocking.save_cost(1).durable_s


def _two_rank_costs(rank: int, world: int, base: str, blocking: bool) -> dict[str, object]:
    m = ckptfmt.CheckpointManager(os.path.join(base, f"run-{blocking}"), blocking=blocking)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32) + rank}
    m.save(1, {"model": state})
    m.wait()
    cost = m.save_cost(1)
    return {"cost": None if cost is None else [cost.bytes, cost.blocked_s, cost.durable_s]}


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_of_several_ranks_reports_its_cost(tmp_path, blocking):
    """A step saved by two ranks (the manager's DCP path) has a cost on every rank, blocking or
    not: the coordinator's bytes are those of the step's files by its record, another rank's
    those of its own rank file."""
    from helpers import run_ranks

    from ckptfmt.files import multifile

    got = run_ranks(_two_rank_costs, 2, tmp_path, str(tmp_path), blocking)
    record = multifile.read_commit(str(tmp_path / f"run-{blocking}" / "step-000000001"))
    for rank, out in enumerate(got):
        assert out.get("cost") is not None, out
        nbytes, blocked, durable = out["cost"]
        assert 0 < blocked <= durable < 120
        if rank == 0:
            assert nbytes == sum(p.length for p in record.files) > 1 << 18
        else:  # a rank that does not hold the step directory: its own rank file
            assert nbytes == next(p.length for p in record.files if p.name == "rank-00001.ckpt")

"""A store upload that fails: the error raised is the one that counts, no spool is kept alive by
it, and no part is sent once one has failed (a real moto server, its answers changed by
tests/s3_faults.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ckptfmt
from ckptfmt.errors import StorageError
from ckptfmt.storage.upload import ObjectFile, upload_file

MiB = 1 << 20


def _spool_maps(name: str) -> list[str]:
    with open("/proc/self/maps") as m:
        return [line for line in m if f"memfd:ckptfmt-{name}" in line]


def _spool_gone(name: str, seconds: float = 10.0) -> bool:
    """Whether the spool of object `name` is unmapped within `seconds` (its pages are freed on
    the upload pool's last task, after the save returns)."""
    deadline = time.monotonic() + seconds
    while _spool_maps(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _spool_maps(name)


def test_a_failed_single_part_save_keeps_no_spool_alive(s3_faults):
    options = s3_faults.storage_options() | {"max_attempts": 1}
    bucket = s3_faults.new_bucket()
    s3_faults.fail_next("PUT", "whole.ckpt", status=400, count=1000)
    with pytest.raises(StorageError) as kept:  # the error lives on, as a caller's may
        ckptfmt.save({"w": torch.randn(MiB)}, f"s3://{bucket}/whole.ckpt", storage_options=options)
    s3_faults.clear_rules()
    assert _spool_gone("whole.ckpt"), kept.value


def test_a_failed_file_upload_keeps_no_spool_alive(s3_faults, tmp_path):
    """An archive copy's upload_file, one of its parts answered 400."""
    options = s3_faults.storage_options() | {"max_attempts": 1, "part_size": 8 * MiB, "concurrency": 2}
    bucket = s3_faults.new_bucket()
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(48 * MiB))
    s3_faults.fail_next("PUT", "partNumber=2", status=400, count=1000)
    with open(src, "rb") as f, pytest.raises(StorageError) as kept:
        upload_file(f.fileno(), f"s3://{bucket}/copied.ckpt", options)
    s3_faults.clear_rules()
    assert _spool_gone("copied.ckpt"), kept.value


def test_an_abort_answered_404_leaves_the_saves_own_error(s3_faults):
    """The abort is best effort: S3's NoSuchUpload (a retried abort whose first answer was lost,
    an upload a lifecycle rule removed) must not replace the failure that made the save abort."""
    options = s3_faults.storage_options() | {"max_attempts": 1, "part_size": 8 * MiB}
    bucket = s3_faults.new_bucket()
    s3_faults.fail_next("PUT", "partNumber=2", status=400, count=1000)
    s3_faults.fail_next("DELETE", "uploadId=", status=404, code="NoSuchUpload")
    with pytest.raises(StorageError, match="upload part 2"):
        with ObjectFile(f"s3://{bucket}/gone.ckpt", options, 32 * MiB) as out:
            os.pwrite(out.fd, bytes(24 * MiB), 0)
            out.written(24 * MiB)
            out.commit()
    s3_faults.clear_rules()


def test_a_save_whose_upload_vanished_is_a_storage_error(s3_faults):
    """A part answered 404 NoSuchUpload (the upload aborted under the save) is no missing
    object: the save raises a StorageError that says so, not a FileNotFoundError."""
    options = s3_faults.storage_options() | {"max_attempts": 1, "part_size": 8 * MiB}
    bucket = s3_faults.new_bucket()
    s3_faults.fail_next("PUT", "partNumber=", status=404, code="NoSuchUpload", count=1000)
    with pytest.raises(StorageError, match="the upload in parts, or its bucket, is gone"):
        ckptfmt.save({"w": torch.randn(6 * MiB)}, f"s3://{bucket}/vanished.ckpt", storage_options=options)
    s3_faults.clear_rules()


def test_no_part_is_sent_once_a_part_has_failed(s3_faults):
    """One report of 80 MiB written (a threaded or compressed save reports every few chunks):
    part 2 fails at once, and the parts after it are not sent (each would be paid for, and
    waited on by the abort)."""
    options = s3_faults.storage_options() | {"max_attempts": 1, "part_size": 8 * MiB, "concurrency": 2}
    bucket = s3_faults.new_bucket()
    s3_faults.fail_next("PUT", "partNumber=2", status=400, count=1000)
    s3_faults.delay("PUT", "partNumber=", seconds=0.1)
    with pytest.raises(StorageError):
        with ObjectFile(f"s3://{bucket}/late.ckpt", options, 96 * MiB) as out:
            os.pwrite(out.fd, bytes(80 * MiB), 0)
            out.written(80 * MiB)
    sent = s3_faults.count("PUT", "partNumber=")
    s3_faults.clear_rules()
    assert sent <= 3, f"{sent} parts sent by a save whose part 2 failed"


def test_a_cleanup_never_aborts_an_upload_this_process_is_writing(s3_faults):
    """moto stamps every upload in parts as begun in 2010: the cleanup of a second
    non-blocking step took the first step's live upload for a crashed writer's and aborted
    it.  A process knows its own uploads: whatever a store stamps, they are not leftovers."""
    options = s3_faults.storage_options() | {"part_size": 8 * MiB}
    m = ckptfmt.CheckpointManager(
        f"s3://{s3_faults.new_bucket()}/run", storage_options=options, blocking=False
    )
    s3_faults.delay("PUT", "partNumber=", seconds=0.2)  # step 1's upload still under way
    first = m.save(1, {"w": torch.arange(6 * MiB, dtype=torch.float32)})
    second = m.save(2, {"w": torch.arange(6 * MiB, dtype=torch.float32) + 1})
    first.wait()
    second.wait()
    assert s3_faults.count("DELETE", "uploadId=") == 0
    assert [c.step for c in m.checkpoints()] == [1, 2]


def _train() -> None:
    important_local = "what a debugger wants"  # noqa: F841
    raise ValueError("training blew up")


def test_a_failed_emergency_save_leaves_the_callers_exception_whole(s3_faults):
    """A save made while handling the caller's exception: its failure's frames are cleared
    (they hold the spool), the caller's exception's frames, its context, are not."""
    options = s3_faults.storage_options() | {"max_attempts": 1}
    bucket = s3_faults.new_bucket()
    s3_faults.fail_next("PUT", "emergency.ckpt", status=400, count=1000)
    try:
        _train()
    except ValueError as err:
        original = err
        with pytest.raises(StorageError):
            ckptfmt.save({"w": torch.randn(MiB)}, f"s3://{bucket}/emergency.ckpt", storage_options=options)
    s3_faults.clear_rules()
    tb = original.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_locals.get("important_local") == "what a debugger wants"

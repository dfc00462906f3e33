"""Store saves at interpreter exit: a non-blocking save still in flight when the program
returns runs once concurrent.futures' exit hook may have refused new work to every pool; the
process must still end, promptly, with the object whole (or the failure reported), never hang
on a save's handle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptfmt

MiB = 1 << 20

# a 24 MiB state in 8 MiB parts: a multi-part upload whose parts go to the upload pool
_STATE = 'state = {"w": torch.arange(6 * (1 << 20), dtype=torch.float32)}'

_AT_RETURN = f"""
import json, sys, torch, ckptfmt
url, options, snapshot = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
{_STATE}
ckptfmt.save(state, url, storage_options=options, blocking=False, snapshot=snapshot)
print("returned", flush=True)
"""


def _run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=90, env=env
    )


def _expected() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6 * MiB, dtype=torch.float32)}


@pytest.mark.parametrize("snapshot", ["copy", "fork"])
def test_a_non_blocking_store_save_in_flight_at_exit_ends_and_is_whole(s3_bucket, snapshot):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/exit-{snapshot}.ckpt"
    done = _run_child(_AT_RETURN, url, json.dumps(options | {"part_size": 8 * MiB}), snapshot)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "returned" in done.stdout
    try:
        got = ckptfmt.load(url, storage_options=options)
    except FileNotFoundError:
        assert "failed" in done.stderr, done.stderr[-3000:]  # not committed: reported
    else:
        assert torch.equal(got["w"], _expected()["w"])

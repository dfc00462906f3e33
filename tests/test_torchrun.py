"""A real torchrun job that loses a rank after a save and is restarted by torchrun.

examples/torchrun_restart.py runs on 2 ranks (FSDP2, gloo on CPU) under
``torchrun --standalone --nproc-per-node 2 --max-restarts 1``; rank 1 kills itself just
after step 2 is committed.  torchrun restarts both ranks, and the new attempt must resume
from step 2's checkpoint with exactly the weights saved there and train to the end.
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set as the README says: without it, torch 2.13's
restarted workers often fail in gloo's init with "Connection refused" or hang
(pytorch/pytorch#135712).  About 30 s on an idle 2-core machine (four Python processes
importing torch, plus torchrun's agent).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import ckptfmt
from ckptfmt.files import multifile

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrun_restart.py"
#: generous: a loaded CI machine with 2 cores runs four torch processes and the agent
JOB_TIMEOUT_S = 300


def _run_job(run: Path, *options: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port for the rendezvous: jobs running side by side never meet
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        str(EXAMPLE),
        "--ckpt-dir",
        str(run),
        "--steps",
        "4",
        "--crash-after",
        "2",
        *options,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)


def test_torchrun_restart_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    job = _run_job(run)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    events = re.findall(r"attempt (\d): (saved|resumed from) step (\d) weights ([0-9a-f]{16})", job.stdout)
    digest = {(int(a), what, int(s)): d for a, what, s, d in events}
    assert sorted(digest) == [
        (0, "saved", 1),
        (0, "saved", 2),
        (1, "resumed from", 2),
        (1, "saved", 3),
        (1, "saved", 4),
    ], job.stdout
    assert digest[(1, "resumed from", 2)] == digest[(0, "saved", 2)]  # exactly the saved weights
    assert digest[(1, "saved", 3)] != digest[(0, "saved", 2)]  # and training went on from there
    manager = ckptfmt.CheckpointManager(str(run))
    assert [c.step for c in manager.checkpoints()] == [3, 4]  # keep_last=2
    assert all(multifile.read_commit(c.path).layout == "dcp" for c in manager.checkpoints())
    assert manager.verify().ok


def test_a_tiered_encrypted_incremental_nonblocking_job_resumes_on_a_fresh_node(
    tmp_path: Path, env_bucket: str
) -> None:
    """The same job with every option a large run combines: archived to a local S3 server,
    encrypted, incremental, non-blocking; the restart finds its local directory gone (a new
    machine) and resumes from the archive with exactly the weights saved at step 2."""
    from ckptfmt.files.encryption import generate_key_file

    run, key = tmp_path / "run", tmp_path / "run.key"
    generate_key_file(str(key))
    url = f"s3://{env_bucket}/run"
    options = ("--archive", url, "--key-file", str(key), "--incremental", "--non-blocking", "--fresh-node")
    job = _run_job(run, *options)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    events = re.findall(r"attempt (\d): (saved|resumed from) step (\d) weights ([0-9a-f]{16})", job.stdout)
    digest = {(int(a), what, int(s)): d for a, what, s, d in events}
    assert (1, "resumed from", 2) in digest, job.stdout
    assert digest[(1, "resumed from", 2)] == digest[(0, "saved", 2)]  # from the archive, bit for bit
    assert sorted(
        c.step for c in ckptfmt.CheckpointManager(str(run), decrypt_with=str(key)).checkpoints()
    ) == [
        3,
        4,
    ]  # the new node's own steps: steps 1 and 2 were on the lost one
    archive = ckptfmt.CheckpointManager(url, decrypt_with=str(key))
    archived = [c.step for c in archive.checkpoints()]
    # the newest step is archived and at most two are kept (archive_keep_last=2); an archive
    # that lags the saves takes the newest committed step next, so step 3 may be skipped
    assert archived[-1] == 4 and len(archived) <= 2 and set(archived) <= {2, 3, 4}, archived
    assert archive.verify(4).ok

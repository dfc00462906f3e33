"""A DCP background save made at interpreter exit (an atexit handler's final checkpoint, run
there, blocking: dcp/api.py) goes on the gloo checkpoint group every background save uses, so
ranks that disagree on whether their pools refuse work still meet on one group."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import ckptfmt.dcp as cdcp

_RANK = """
import atexit, datetime, sys, warnings, torch
import torch.distributed as dist
import ckptfmt.dcp as cdcp
warnings.filterwarnings("ignore")
rank, store, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group(
    "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=20),
)

def save():
    try:
        cdcp.async_save({f"w{rank}": torch.arange(10.0) + rank}, path).result(timeout=40)
        print("saved", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, e, flush=True)
    dist.destroy_process_group()

if rank == 0:
    atexit.register(save)  # its pools refuse work by then: saved there, blocking
else:
    save()  # its pools take work: torch's async_save
"""


def test_ranks_that_disagree_on_the_exit_save_on_one_group(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    path = tmp_path / "final"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), str(tmp_path / "store"), str(path)],
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
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    for code, out, err in outs:
        assert code == 0 and out.strip() == "saved", out + err[-3000:]
    back = {"w0": torch.zeros(10), "w1": torch.zeros(10)}
    cdcp.load(back, path)
    assert torch.equal(back["w0"], torch.arange(10.0)) and torch.equal(back["w1"], torch.arange(10.0) + 1)

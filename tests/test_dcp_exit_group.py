"""A DCP background save made at interpreter exit (an atexit handler's final checkpoint, run
there, blocking: dcp/api.py) goes on the gloo checkpoint group every background save uses, so
ranks that disagree on whether their pools refuse work still meet on one group."""

from __future__ import annotations

import json
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


_BOTH_AT_EXIT = """
import atexit, datetime, json, sys, warnings, torch
import torch.distributed as dist
import ckptfmt.dcp as cdcp
from ckptfmt.dcp import api
warnings.filterwarnings("ignore")
rank, store, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group(
    "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=20),
)

def groups():  # the groups torch holds, and the checkpoint groups still alive (held by anyone)
    alive = [g for g in (r() for r in api._GROUPS.values()) if g is not None]
    return len(dist.distributed_c10d._world.pg_map), len(alive)

@atexit.register
def save():
    before = groups()
    outcome = []
    for step in (1, 2):  # a second exit save makes its group afresh, on every rank alike
        try:
            cdcp.async_save({f"w{rank}": torch.arange(10.0) + rank + step}, f"{path}/{step}").result(timeout=40)
            outcome.append("saved")
        except BaseException as e:
            outcome.append(f"failed: {type(e).__name__} {e}")
        during = groups()
        outcome.append(during == before or f"left {during}, before {before}")
    print(json.dumps(outcome), flush=True)
    dist.destroy_process_group()
"""


def test_a_group_first_made_at_exit_is_destroyed_after_that_save(tmp_path):
    """A checkpoint group first made by an exit save is destroyed once that save is made, by
    the handler's thread: left to torch, it is freed at interpreter teardown, where a gloo
    thread releasing the save's last collective needs the GIL and aborts the process (about
    one two-rank run in 40; bench/exit_group_soak.py counts them)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOTH_AT_EXIT,
                str(rank),
                str(tmp_path / "store"),
                str(tmp_path / "final"),
            ],
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
        assert code == 0, out + err[-3000:]
        assert json.loads(out) == ["saved", True, "saved", True], out + err[-3000:]
    for step in (1, 2):
        back = {"w0": torch.zeros(10), "w1": torch.zeros(10)}
        cdcp.load(back, tmp_path / "final" / str(step))
        assert torch.equal(back["w0"], torch.arange(10.0) + step)
        assert torch.equal(back["w1"], torch.arange(10.0) + 1 + step)

"""ckptfmt keeps no process group alive past destroy_process_group().

A group that outlives it is freed at interpreter exit, where a gloo thread still releasing
a collective's tensors needs the GIL and aborts the process ("terminate called without an
active exception"): a torchrun worker that finished its work would then count as failed.
Once the caller has destroyed the groups, no gloo thread may be left in the process, whether
ckptfmt.dcp (and through it torch's DCP) was imported before init_process_group() or only
after, by the checkpoint manager's first sharded save (ckptfmt/dcp/torchimport.py)."""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return names


def _rank(rank: int, world: int, where: str, late: bool) -> None:
    import sys

    import ckptfmt

    if not late:
        from ckptfmt import dcp as cdcp
    assert late == ("torch.distributed.checkpoint" not in sys.modules)
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(where, "store"), world), rank=rank, world_size=world
    )
    if late:  # the manager's sharded save imports ckptfmt.dcp and torch's DCP, the group exists
        ckptfmt.CheckpointManager(os.path.join(where, "first")).save(1, {"w": torch.ones(4)})
        from ckptfmt import dcp as cdcp
    state = {"w": torch.arange(1 << 12, dtype=torch.float32) + rank, "n": rank}
    cdcp.async_save(state, os.path.join(where, "async")).result()  # on a group of its own
    cdcp.save(state, os.path.join(where, "blocking"))
    cdcp.load(state, os.path.join(where, "async"))
    manager = ckptfmt.CheckpointManager(os.path.join(where, "run"), blocking=False)
    manager.save(1, {"model": torch.nn.Linear(4, 4)})
    manager.wait()
    during = [n for n in _thread_names() if n in GLOO_THREADS]
    del manager, state
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    after = [n for n in _thread_names() if n in GLOO_THREADS]
    with open(os.path.join(where, f"threads.{rank}.json"), "w") as fh:
        json.dump({"during": during, "after": after}, fh)


@pytest.mark.parametrize("late", [False, True], ids=["dcp-imported-first", "dcp-imported-after-init"])
def test_no_gloo_thread_outlives_destroy_process_group(tmp_path: Any, late: bool) -> None:
    mp.start_processes(_rank, args=(2, str(tmp_path), late), nprocs=2, join=True, start_method="spawn")
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"threads.{rank}.json").read_text())
        assert seen["during"], seen  # the probe sees gloo's threads while the groups exist
        assert seen["after"] == [], seen


_LATE_IMPORT = """
import os, sys, warnings
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["TESTS"])
from test_process_groups import GLOO_THREADS, _thread_names
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from ckptfmt import dcp
assert [w for w in seen if "ckptfmt" in w.filename] == [], [str(w.message) for w in seen]
from torch.distributed.nn import functional
assert functional.broadcast.__defaults__ == (None,), functional.broadcast.__defaults__
dist.destroy_process_group()
assert [n for n in _thread_names() if n in GLOO_THREADS] == []
"""


def test_torchs_dcp_imported_after_init_keeps_no_group(tmp_path: Any) -> None:
    """The mechanism, in one process: torch's DCP first imported (by ckptfmt.dcp) after
    init_process_group() leaves torch.distributed.nn's defaults None, not the default group,
    without a warning of its own, and destroy_process_group() leaves no gloo thread."""
    import subprocess
    import sys

    env = {**os.environ, "TESTS": os.path.dirname(os.path.abspath(__file__))}
    done = subprocess.run(
        [sys.executable, "-c", _LATE_IMPORT, str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]

"""ckptfmt as torch.distributed.checkpoint's storage layer (ckptfmt/dcp/).

Multi-process tests spawn gloo groups of 1, 2, 3 and 4 ranks (tests/dcp_worker.py,
a FileStore in a temp directory).  Spawning torch costs seconds per process, so one
group per world size runs many tasks, and the groups run in an order that lets each
load what the earlier ones saved: every world size loads checkpoints saved with other
world sizes (DDP-replicated, DTensor rows/columns/replicated, FSDP2), and every loaded
value is compared bit for bit with what was saved.  The single-process tests cover
DCP's no_dist mode, hostile metadata, missing and damaged rank files, sub-region
reads, consolidation and the no-pickle guarantee.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hostile_dcp import edit as _edit
from test_hostile_dcp import read_record as _read_record
from test_hostile_dcp import rewrite as _rewrite
from test_hostile_dcp import set_chunks as _chunks

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.engine import marks
from ckptfmt.errors import (
    CheckpointError,
    CorruptError,
    IncompleteError,
    UnsupportedError,
    UnsupportedObjectError,
)
from ckptfmt.files import multifile
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.format import layout as fmt

WORKER = os.path.join(os.path.dirname(__file__), "dcp_worker.py")
SESSION_TIMEOUT_S = 240

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def run_group(world: int, tasks: list[dict[str, Any]], work: Path, name: str) -> list[list[dict[str, Any]]]:
    """Run `tasks` on `world` spawned ranks; each rank's results, in task order."""
    out = work / f"results-{name}"
    out.mkdir()
    store = work / f"store-{name}"
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(r), str(world), str(store), json.dumps(tasks), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=SESSION_TIMEOUT_S)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    results = []
    for r in range(world):
        path = out / f"rank-{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else [])
    for r, res in enumerate(results):
        for t, got in zip(tasks, res):
            got["task"] = t
        if len(res) < len(tasks) and not any(t["op"] == "kill" or t.get("victim") is not None for t in tasks):
            raise AssertionError(f"group {name}: rank {r} stopped after {len(res)} tasks:\n{logs[r][-3000:]}")
    return results


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Runs every group once; maps each task's name to its result on every rank."""
    work = tmp_path_factory.mktemp("dcp")

    def d(name: str) -> str:
        return str(work / name)

    def save(scenario: str, world: int, seed: int, file: bool = False) -> dict[str, Any]:
        key = f"{scenario}{world}"
        t = {"op": "save", "name": f"save-{key}", "scenario": scenario, "seed": seed, "dir": d(key)}
        t["ref"] = d(f"{key}.ref")
        if file:
            t["file"] = d(f"{key}.ckpt")
        return t

    def load(scenario: str, src: str, world: int, single_file: bool = False) -> dict[str, Any]:
        """Load what `src` (e.g. "dtensor2") saved into `scenario` on `world` ranks."""
        tag = "file" if single_file else "dir"
        return {
            "op": "load",
            "name": f"load-{src}-{tag}-into-{scenario}{world}",
            "scenario": scenario,
            "seed": 100 + world,
            "src": d(f"{src}.ckpt" if single_file else src),
            "ref": d(f"{src}.ref"),
        }

    def manager_save(step: int, scenario: str, seed: int, run: str = "run") -> dict[str, Any]:
        return {
            "op": "msave",
            "name": f"manager-save-{step}" + ("" if run == "run" else f"-{run}"),
            "scenario": scenario,
            "seed": seed,
            "step": step,
            "run": d(run),
            "ref": d(f"{run}-{step}.ref"),
        }

    def manager_load(scenario: str, step: int, world: int, run: str = "run") -> dict[str, Any]:
        return {
            "op": "mload",
            "name": f"manager-load-{step}-into-{world}" + ("" if run == "run" else f"-{run}"),
            "scenario": scenario,
            "seed": 200 + world,
            "run": d(run),
            "ref": d(f"{run}-{step}.ref"),
        }

    plan = [
        (1, [save("ddp", 1, 1), save("dtensor", 1, 2, file=True), save("fsdp", 1, 3)]),
        (
            2,
            [
                load("ddp", "ddp1", 2),
                load("dtensor", "dtensor1", 2),
                load("fsdp", "fsdp1", 2),
                load("dtensor", "dtensor1", 2, single_file=True),
                save("ddp", 2, 4),
                save("dtensor", 2, 5, file=True),
                save("fsdp", 2, 6),
                {
                    "op": "async",
                    "name": "async-fsdp2",
                    "scenario": "fsdp",
                    "seed": 7,
                    "dir": d("async-fsdp2"),
                },
                manager_save(10, "fsdp", 14),
                manager_save(10, "fsdp", 21, run="run-2-1-2"),
                {**manager_save(20, "fsdp", 15), "victim": 1, "ref": None},  # the group's last task
            ],
        ),
        (
            3,
            [
                load("dtensor", "dtensor2", 3),
                load("fsdp", "fsdp1", 3),
                save("dtensor", 3, 8),
                save("fsdp", 3, 9),
                # the same plans again: DCP's plan cache serves this save
                {
                    **save("fsdp", 3, 19),
                    "name": "save-fsdp3-again",
                    "dir": d("fsdp3b"),
                    "ref": d("fsdp3b.ref"),
                },
            ],
        ),
        (
            4,
            [
                load("dtensor", "dtensor1", 4),
                load("dtensor", "dtensor2", 4),
                load("dtensor", "dtensor3", 4),
                load("fsdp", "fsdp2", 4),
                load("fsdp", "fsdp3", 4),
                load("ddp", "ddp2", 4),
                load("dtensor", "dtensor2", 4, single_file=True),
                load("ddp", "fsdp2", 4),
                save("dtensor", 4, 10),
                save("fsdp", 4, 11),
                save("ddp", 4, 12),
                {
                    "op": "async",
                    "name": "async-dtensor4",
                    "scenario": "dtensor",
                    "seed": 13,
                    "dir": d("async-dt4"),
                },
                manager_load("fsdp", 10, 4),
                {**manager_save(30, "fsdp", 16), "keep_last": 1},
            ],
        ),
        (
            1,
            [
                load("dtensor", "dtensor4", 1),
                load("dtensor", "dtensor2", 1),
                load("fsdp", "fsdp4", 1),
                load("fsdp", "ddp4", 1),
                load("dtensor", "dtensor3", 1),
                manager_load("fsdp", 30, 1),
                # FSDP2 at world size 1: DTensors, so the manager saves through DCP
                manager_load("fsdp", 10, 1, run="run-2-1-2"),
                manager_save(20, "fsdp", 22, run="run-2-1-2"),
                manager_load("fsdp", 20, 1, run="run-2-1-2"),
                manager_save(5, "plain", 23, run="run-plain"),
            ],
        ),
        (
            2,
            [
                load("dtensor", "dtensor4", 2),
                load("fsdp", "fsdp4", 2),
                load("fsdp", "fsdp3", 2),
                load("fsdp", "fsdp3b", 2),
                manager_load("fsdp", 20, 2, run="run-2-1-2"),
            ],
        ),
    ]
    out: dict[str, list[dict[str, Any]]] = {"_work": [{"path": str(work)}]}
    for i, (world, tasks) in enumerate(plan):
        results = run_group(world, tasks, work, f"{i}-w{world}")
        for j, t in enumerate(tasks):
            out[t["name"]] = [results[r][j] if j < len(results[r]) else None for r in range(world)]
    return out


def _ok(groups: dict[str, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    assert name in groups, f"no task {name}"
    for r, res in enumerate(groups[name]):
        assert res is not None, f"{name}: rank {r} died"
        assert res["ok"], f"{name} failed on rank {r}: {res.get('trace', res.get('error'))}"
    return groups[name]


# -- saves and resharded loads --------------------------------------------------------------------

SAVES = [
    f"save-{scenario}{world}"
    for scenario, worlds in (("ddp", (1, 2, 4)), ("dtensor", (1, 2, 3, 4)), ("fsdp", (1, 2, 3, 4)))
    for world in worlds
]


@pytest.mark.parametrize("name", SAVES)
def test_every_rank_saves(groups: dict[str, Any], name: str) -> None:
    _ok(groups, name)


RESHARD = [
    # (saved by, loaded into scenario and world size): N -> M for N, M in 1..4, both ways
    ("ddp1", "ddp2"),
    ("dtensor1", "dtensor2"),
    ("fsdp1", "fsdp2"),
    ("dtensor2", "dtensor3"),
    ("fsdp1", "fsdp3"),
    ("dtensor1", "dtensor4"),
    ("dtensor2", "dtensor4"),
    ("dtensor3", "dtensor4"),
    ("fsdp2", "fsdp4"),
    ("fsdp3", "fsdp4"),
    ("ddp2", "ddp4"),
    ("dtensor4", "dtensor1"),
    ("dtensor2", "dtensor1"),
    ("dtensor3", "dtensor1"),
    ("fsdp4", "fsdp1"),
    ("dtensor4", "dtensor2"),
    ("fsdp4", "fsdp2"),
    ("fsdp3", "fsdp2"),
]


@pytest.mark.parametrize(("src", "into"), RESHARD)
def test_reshard_bit_exact(groups: dict[str, Any], src: str, into: str) -> None:
    """Saved with N ranks, loaded with M: every tensor (fp32 and bf16, model and Adam state) and
    every value equals what was saved, bit for bit, after set_state_dict."""
    res = _ok(groups, f"load-{src}-dir-into-{into}")
    assert all(r["values"] >= 30 for r in res)


def test_a_save_from_cached_plans_is_its_own(groups: dict[str, Any]) -> None:
    """A second save with unchanged plans (served by DCP's plan cache) holds its own values,
    and its commit record names its own directory and save, not the first one's."""
    _ok(groups, "save-fsdp3-again")
    res = _ok(groups, "load-fsdp3b-dir-into-fsdp2")
    assert all(r["values"] >= 30 for r in res)
    work = Path(groups["_work"][0]["path"])
    first = multifile.read_commit(str(work / "fsdp3")).layout_data["storage_meta"]
    again = multifile.read_commit(str(work / "fsdp3b")).layout_data["storage_meta"]
    assert again["checkpoint_id"] == str(work / "fsdp3") + "b"
    assert first["checkpoint_id"] == str(work / "fsdp3")
    assert again["save_id"] != first["save_id"]


@pytest.mark.parametrize(("src", "into"), [("fsdp2", "ddp4"), ("ddp4", "fsdp1")])
def test_fsdp_to_replicated_and_back(groups: dict[str, Any], src: str, into: str) -> None:
    """FSDP2 shards into DDP replicas (full tensors on every rank), and the reverse."""
    _ok(groups, f"load-{src}-dir-into-{into}")


def _data_bytes(path: str) -> int:
    with CheckpointFile(path) as f:
        return sum(c.stored_len for c in f.chunks)


@pytest.mark.parametrize(("src", "world"), [("dtensor1", 2), ("dtensor2", 4)])
def test_single_file_into_shards_reads_only_the_slice(groups: dict[str, Any], src: str, world: int) -> None:
    """A consolidated file loads into a sharded state, each rank reading about its share."""
    res = _ok(groups, f"load-{src}-file-into-dtensor{world}")
    total = _data_bytes(os.path.join(groups["_work"][0]["path"], f"{src}.ckpt"))
    for r in res:
        assert r["bytes_read"] < total * (1.6 / world), (r["bytes_read"], total)


def test_sharded_reads_only_the_slice(groups: dict[str, Any]) -> None:
    """1 rank's file loaded by 4 ranks: each reads about a quarter (64 KiB chunks)."""
    res = _ok(groups, "load-dtensor1-dir-into-dtensor4")
    total = _data_bytes(os.path.join(groups["_work"][0]["path"], "dtensor1", "rank-00000.ckpt"))
    for r in res:
        assert r["bytes_read"] < total * 0.4, (r["bytes_read"], total)


@pytest.mark.parametrize("name", ["async-fsdp2", "async-dtensor4"])
def test_async_save_holds_the_values_at_call_time(groups: dict[str, Any], name: str) -> None:
    for r in _ok(groups, name):
        assert r["blocked"] <= r["total"]


def test_every_file_is_ckptfmt(groups: dict[str, Any]) -> None:
    """No pickle: every file of every saved directory starts with ckptfmt's magic; the
    directory holds the rank files and the commit record, nothing else (a manager's step
    directory also its mark, engine/marks.py: plain JSON naming the writer)."""
    work = Path(groups["_work"][0]["path"])
    dirs = [p for p in work.iterdir() if p.is_dir() and not p.name.startswith(("results", "run"))]
    steps = list((work / "run").iterdir())  # the manager's step directories
    assert len(dirs) + len(steps) >= 14
    for d in dirs + steps:
        names = sorted(os.listdir(d))
        if d in steps:
            assert names[0] == marks.MARK_NAME and "writer" in json.loads((d / names[0]).read_text())
            names = names[1:]
        assert names[0] == "COMMIT" and all(n.startswith("rank-") for n in names[1:]), (d, names)
        for n in names:
            assert (d / n).read_bytes()[:8] == fmt.MAGIC, d / n
        record = multifile.check_complete(str(d))
        assert record.layout == "dcp" and [p.name for p in record.files] == names[1:]


# -- the checkpoint manager on several ranks ------------------------------------------------------


def test_manager_steps_of_several_ranks(groups: dict[str, Any]) -> None:
    """CheckpointManager on 2 ranks saves sharded steps; a step whose rank 1 was killed never
    becomes a checkpoint; 4 ranks resume from the newest complete step (resharded, RNG of the
    ranks that saved restored), save and rotate; 1 rank and a plain process then see the same."""
    saved = _ok(groups, "manager-save-10")
    assert all(r["error"] is None and r["steps"] == [10] for r in saved)
    killed = groups["manager-save-20"]
    assert killed[0]["ok"] and "no commit record was written" in killed[0]["error"]
    assert killed[1] is None  # the victim never reported
    resumed = _ok(groups, "manager-load-10-into-4")
    assert all(r["latest"] == 10 and r["layout"] == "dcp" for r in resumed)
    assert [r["rng_restored"] for r in resumed] == [True, True, False, False]
    assert resumed[0]["draw"] == saved[0]["draw"] and resumed[1]["draw"] == saved[1]["draw"]
    after = _ok(groups, "manager-save-30")
    assert all(r["steps"] == [30] for r in after)  # keep_last=1 rotated step 10 away
    one = _ok(groups, "manager-load-30-into-1")
    assert one[0]["latest"] == 30 and one[0]["rng_restored"]
    work = Path(groups["_work"][0]["path"])
    manager = ckptfmt.CheckpointManager(str(work / "run"))
    assert [c.step for c in manager.checkpoints()] == [30]
    assert manager.verify().ok
    full = manager.load()  # one process: the whole state, full tensors
    ref = ckptfmt.load(str(work / "run-30.ref"))
    for k, v in full["model"].items():
        assert torch.equal(v, ref[f"model.{k}"])


def test_fsdp2_manager_at_world_size_one(groups: dict[str, Any]) -> None:
    """FSDP2 at world size 1 (a job resumed on one rank, a one-process FSDP2 run) holds
    DTensors, so the manager saves through DCP as with several ranks: a run saved on 2 ranks
    resumes on 1, saves there, and that step resumes on 1 and on 2 ranks, bit for bit, RNG
    included where the rank saved it.  A plain model at world size 1 still saves one state file."""
    on_two = _ok(groups, "manager-save-10-run-2-1-2")
    first = _ok(groups, "manager-load-10-into-1-run-2-1-2")
    assert first[0]["latest"] == 10 and first[0]["rng_restored"] and first[0]["draw"] == on_two[0]["draw"]
    saved = _ok(groups, "manager-save-20-run-2-1-2")
    assert saved[0]["error"] is None and saved[0]["steps"] == [10, 20]
    again = _ok(groups, "manager-load-20-into-1-run-2-1-2")
    assert again[0]["latest"] == 20 and again[0]["rng_restored"] and again[0]["draw"] == saved[0]["draw"]
    two = _ok(groups, "manager-load-20-into-2-run-2-1-2")
    assert all(r["latest"] == 20 and r["layout"] == "dcp" for r in two)
    assert [r["rng_restored"] for r in two] == [True, False]  # rank 1 did not save at step 20
    assert two[0]["draw"] == saved[0]["draw"]
    work = Path(groups["_work"][0]["path"])
    record = multifile.check_complete(str(work / "run-2-1-2" / "step-000000020"))
    assert record.layout == "dcp" and record.layout_data["world_size"] == 1
    plain = _ok(groups, "manager-save-5-run-plain")
    assert plain[0]["error"] is None
    assert multifile.check_complete(str(work / "run-plain" / "step-000000005")).layout == "state"


# -- a rank killed during a save -------------------------------------------------------------------


def test_rank_killed_during_save_leaves_no_commit(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed after writing its chunks: rank 0 fails with a clear error, no commit
    record appears, and the previous checkpoint still loads bit for bit."""
    import dcp_worker

    ok, bad = tmp_path / "ok", tmp_path / "bad"
    tasks = [
        {
            "op": "save",
            "name": "ok",
            "scenario": "ddp",
            "seed": 1,
            "dir": str(ok),
            "ref": str(tmp_path / "ok.ref"),
        },
        {"op": "kill", "name": "kill", "scenario": "ddp", "seed": 2, "dir": str(bad), "victim": 1},
    ]
    results = run_group(2, tasks, tmp_path, "kill")
    assert results[0][0]["ok"] and results[0][1]["ok"], results[0]
    err = results[0][1]["error"]
    assert err is not None and "save failed on rank 0" in err and "no commit record was written" in err
    assert len(results[1]) == 1  # the victim never reported the kill task
    assert not (bad / "COMMIT").exists()
    assert (bad / "rank-00000.ckpt").exists()
    with pytest.raises(IncompleteError, match="no commit record"):
        cdcp.load({}, str(bad))
    model, opt, extra = dcp_worker.build("plain", 50, 1)
    state = dcp_worker.state_of(model, opt, extra)
    cdcp.load(state, str(ok))
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert dcp_worker.compare(dcp_worker.state_of(model, opt, state["extra"]), str(tmp_path / "ok.ref")) >= 30
    # the next save into the damaged directory removes the victim's temp file
    cdcp.save(state, str(bad))
    assert sorted(os.listdir(bad)) == ["COMMIT", "rank-00000.ckpt"]


# -- one process (DCP's no_dist mode) ---------------------------------------------------------------


def _plain(seed: int) -> tuple[Any, Any, dict[str, Any]]:
    import dcp_worker

    model, opt, extra = dcp_worker.build("plain", seed, 1)
    return model, opt, dcp_worker.state_of(model, opt, extra)


@pytest.fixture
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any unpickling (pickle.load(s), an Unpickler, torch.load) raises."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle used")

    class NoUnpickler:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    yield


def test_single_process_roundtrip_without_pickle(tmp_path: Path, no_pickle: None) -> None:
    import dcp_worker

    model, opt, state = _plain(1)
    ckptfmt.save(dcp_worker.full_flat(state), str(tmp_path / "ref"))
    cdcp.save(state, str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path / "ck")) == ["COMMIT", "rank-00000.ckpt"]
    for n in os.listdir(tmp_path / "ck"):
        assert (tmp_path / "ck" / n).read_bytes()[:8] == fmt.MAGIC
    model2, opt2, state2 = _plain(2)
    cdcp.load(state2, str(tmp_path / "ck"))
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model2, opt2, model_state_dict=state2["model"], optim_state_dict=state2["optim"])
    assert dcp_worker.compare(dcp_worker.state_of(model2, opt2, state2["extra"]), str(tmp_path / "ref")) >= 30
    assert state2["extra"]["sizes"] == (1, 2.5, None)


def test_dcp_api_with_our_pieces(tmp_path: Path, no_pickle: None) -> None:
    """dcp.save/dcp.load called directly with cdcp's Writer/Reader and planners."""
    _, _, state = _plain(3)
    dcp.save(state, storage_writer=cdcp.Writer(str(tmp_path)), planner=cdcp.SavePlanner())
    _, _, state2 = _plain(4)
    dcp.load(state2, storage_reader=cdcp.Reader(str(tmp_path)), planner=cdcp.LoadPlanner())
    for k, v in state["model"].items():
        assert torch.equal(v, state2["model"][k])
    assert state2["extra"]["name"] == "run-3"


def test_default_planners_are_refused(tmp_path: Path) -> None:
    """DCP's default planners pickle non-tensor values: the writer and reader say what to pass."""
    _, _, state = _plain(1)
    with pytest.raises(BaseException, match="planner=ckptfmt.dcp.SavePlanner"):
        dcp.save(state, storage_writer=cdcp.Writer(str(tmp_path / "a")))
    assert not any(n.startswith("rank-") for n in os.listdir(tmp_path / "a"))
    cdcp.save(state, str(tmp_path / "b"))
    with pytest.raises(BaseException, match="planner=ckptfmt.dcp.LoadPlanner"):
        dcp.load(state, storage_reader=cdcp.Reader(str(tmp_path / "b")))
    # tensors only: DCP's default planners are fine
    tensors = {"w": torch.arange(6.0)}
    dcp.save(tensors, storage_writer=cdcp.Writer(str(tmp_path / "c")))
    back = {"w": torch.zeros(6)}
    dcp.load(back, storage_reader=cdcp.Reader(str(tmp_path / "c")))
    assert torch.equal(back["w"], tensors["w"])


class _Empty:
    """A Stateful whose state is empty."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state == {}


EMPTY_STATES = {
    "empty": lambda: {},
    "stateful": lambda: {"app": _Empty()},
    "nested": lambda: {"a": {}, "b": {"c": {}}},
}


@pytest.mark.parametrize("kind", sorted(EMPTY_STATES))
def test_a_save_with_no_items_round_trips(tmp_path: Path, kind: str) -> None:
    """No rank has an item: the coordinator writes an empty rank file, so the commit record
    still names the files it covers; dcp.save/load and cdcp.save/load both round-trip it."""
    state = EMPTY_STATES[kind]
    dcp.save(state(), storage_writer=cdcp.Writer(str(tmp_path / "dcp")), planner=cdcp.SavePlanner())
    cdcp.save(state(), str(tmp_path / "cdcp"))
    for d in ("dcp", "cdcp"):
        record = multifile.check_complete(str(tmp_path / d))
        assert [p.name for p in record.files] == ["rank-00000.ckpt"]
        assert ckptfmt.load(str(tmp_path / d / "rank-00000.ckpt")) == {}
        back = state()
        dcp.load(back, storage_reader=cdcp.Reader(str(tmp_path / d)), planner=cdcp.LoadPlanner())
        cdcp.load(back, str(tmp_path / d))
        assert back.keys() == state().keys()
    assert ckptfmt.verify(str(tmp_path / "cdcp" / "rank-00000.ckpt")).ok


def test_bytes_io_values_are_stored_as_their_bytes(tmp_path: Path, no_pickle: None) -> None:
    """io.BytesIO values (a module's extra state, a tokenizer blob) are stored as their raw
    bytes, never pickled, and come back as BytesIO where the state holds one; also behind
    DCP's default save planner, whose only transform would pickle them."""
    blob = bytes(range(256)) * 3

    def state() -> dict[str, Any]:
        return {"w": torch.arange(4.0), "extra": io.BytesIO(blob), "nested": {"empty": io.BytesIO()}}

    def fresh() -> dict[str, Any]:
        return {"w": torch.zeros(4), "extra": io.BytesIO(b"old"), "nested": {"empty": io.BytesIO(b"x")}}

    cdcp.save(state(), str(tmp_path / "ours"))
    dcp.save(state(), storage_writer=cdcp.Writer(str(tmp_path / "default")))  # DCP's default planner
    cdcp.async_save(state(), str(tmp_path / "async")).result(timeout=120)
    for d in ("ours", "default", "async"):
        with CheckpointFile(str(tmp_path / d / "rank-00000.ckpt")) as f:
            values = f.load_subtree(f.tree.root, None, True)
        assert sorted(v for v in values.values() if isinstance(v, bytes)) == [b"", blob]
        back = fresh()
        cdcp.load(back, str(tmp_path / d))
        assert isinstance(back["extra"], io.BytesIO) and back["extra"].getvalue() == blob
        assert isinstance(back["nested"]["empty"], io.BytesIO) and back["nested"]["empty"].getvalue() == b""
        assert torch.equal(back["w"], torch.arange(4.0))


def test_bytes_io_through_dcps_own_storage_with_our_planners(tmp_path: Path) -> None:
    """Our planners on DCP's FileSystemWriter/Reader: a BytesIO's raw bytes are written and
    come back as a BytesIO (DCP's .metadata itself is a pickle: no no_pickle here)."""
    blob = b"\x00raw\xffbytes" * 100
    dcp.save(
        {"extra": io.BytesIO(blob)},
        storage_writer=dcp.FileSystemWriter(str(tmp_path)),
        planner=cdcp.SavePlanner(),
    )
    assert blob in b"".join(p.read_bytes() for p in tmp_path.glob("*.distcp"))
    back = {"extra": io.BytesIO()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path)), planner=cdcp.LoadPlanner())
    assert isinstance(back["extra"], io.BytesIO) and back["extra"].getvalue() == blob


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path: Path) -> None:
    """overwrite=False (DCP FileSystemWriter's option; True by default there and here) refuses
    a directory holding a commit record, on every rank, before anything is written."""
    import inspect

    stock = inspect.signature(dcp.FileSystemWriter.__init__).parameters["overwrite"].default
    assert inspect.signature(cdcp.Writer.__init__).parameters["overwrite"].default is stock is True
    cdcp.save({"w": torch.ones(3)}, str(tmp_path / "ck"))
    before = sorted((n, (tmp_path / "ck" / n).read_bytes()) for n in os.listdir(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match=r"already there \(overwrite=False\).*was left as it was"):
        cdcp.save({"w": torch.zeros(3)}, str(tmp_path / "ck"), overwrite=False)
    with pytest.raises(BaseException, match=r"overwrite=False"):
        dcp.save(
            {"w": torch.zeros(3)},
            storage_writer=cdcp.Writer(str(tmp_path / "ck"), overwrite=False),
            planner=cdcp.SavePlanner(),
        )
    with pytest.raises(CheckpointError, match="overwrite=False"):
        cdcp.async_save({"w": torch.zeros(3)}, str(tmp_path / "ck"), overwrite=False).result(timeout=120)
    assert sorted((n, (tmp_path / "ck" / n).read_bytes()) for n in os.listdir(tmp_path / "ck")) == before
    cdcp.save({"w": torch.ones(3)}, str(tmp_path / "new"), overwrite=False)  # nothing there yet
    cdcp.save({"w": torch.full((3,), 2.0)}, str(tmp_path / "ck"))  # the default replaces it
    back = {"w": torch.zeros(3)}
    cdcp.load(back, str(tmp_path / "ck"))
    assert torch.equal(back["w"], torch.full((3,), 2.0))


def test_unstorable_value_fails_before_writing(tmp_path: Path) -> None:
    state = {"w": torch.ones(3), "opts": {"callback": object()}}
    with pytest.raises(UnsupportedObjectError, match=r"opts\.callback"):
        cdcp.save(state, str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if not n.startswith(".")]


def test_resave_into_a_directory_replaces_it(tmp_path: Path) -> None:
    """Saving over an older checkpoint: its commit record goes first, stale rank files after."""
    cdcp.save({"w": torch.ones(4)}, str(tmp_path))
    (tmp_path / "rank-00007.ckpt").write_bytes((tmp_path / "rank-00000.ckpt").read_bytes())
    cdcp.save({"w": torch.full((4,), 2.0)}, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["COMMIT", "rank-00000.ckpt"]
    back = {"w": torch.zeros(4)}
    cdcp.load(back, str(tmp_path))
    assert torch.equal(back["w"], torch.full((4,), 2.0))


def test_views_of_larger_buffers_save_only_themselves(tmp_path: Path) -> None:
    big = torch.arange(1 << 16, dtype=torch.float32)
    cdcp.save({"part": big[100:164], "col": big.view(256, 256)[:, 3]}, str(tmp_path))
    assert os.path.getsize(tmp_path / "rank-00000.ckpt") < 8192
    back = {"part": torch.zeros(64), "col": torch.zeros(256)}
    cdcp.load(back, str(tmp_path))
    assert torch.equal(back["part"], big[100:164]) and torch.equal(back["col"], big.view(256, 256)[:, 3])


def test_async_save_single_process(tmp_path: Path) -> None:
    """Returns after the snapshot; later changes do not reach the file; staging buffers are reused."""
    model, opt, state = _plain(5)
    snapshot = {k: v.clone() for k, v in state["model"].items()}
    stager = cdcp.Stager()
    fut = cdcp.async_save(state, str(tmp_path / "a"), stager=stager)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    fut.result(timeout=60)
    buffers = {k: v.data_ptr() for k, v in stager._buffers.items()}
    fut2 = cdcp.async_save(state, str(tmp_path / "b"), stager=stager)
    fut2.result(timeout=60)
    assert {k: v.data_ptr() for k, v in stager._buffers.items()} == buffers
    _, _, back = _plain(6)
    cdcp.load(back, str(tmp_path / "a"))
    for k, v in snapshot.items():
        assert torch.equal(back["model"][k], v)


# -- damaged and hostile checkpoints -----------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "b": torch.ones(5, dtype=torch.bfloat16),
        "lr": 0.5,
        "names": ["a", "b"],
    }
    cdcp.save(state, str(tmp_path / "ck"))
    return tmp_path / "ck", state


def _fresh(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}


def test_load_checks_sizes_against_the_metadata(saved: tuple[Path, dict[str, Any]]) -> None:
    """The record says the chunk is 4x6; a 2x6 chunk of a bigger tensor would be read wrongly."""
    directory, state = saved

    def change(v: dict[str, Any]) -> None:
        _edit(v, "w", size=[8, 6], chunks=np.array([[0, 0, 4, 6, 0, 0], [4, 0, 4, 6, 0, 0]]))

    _rewrite(directory, change)
    fresh = _fresh(state)
    fresh["w"] = torch.zeros(8, 6)
    cdcp.load(fresh, str(directory))  # both chunks name the same 4x6 item: readable, consistent
    _rewrite(directory, lambda v: _chunks(v, "w", [[0, 0, 2, 6, 0, 0], [2, 0, 6, 6, 0, 0]]))
    with pytest.raises(CorruptError, match="shape"):
        cdcp.load(fresh, str(directory))


def test_missing_and_damaged_rank_files_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.tensor  # noqa: F401 - DCP needs it for DTensor types

    directory = tmp_path / "ck"
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
    cdcp.save(state, str(directory))
    # make it a two-rank checkpoint: split w across two files, as two ranks would save it
    _two_ranks(directory, state["w"])
    back = {"w": torch.zeros(4096), "step": 0}
    cdcp.load(back, str(directory))
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
    from ckptfmt.cli import main as cli

    assert cli(["verify", str(directory)]) == 0
    capsys.readouterr()
    info = cdcp.describe(str(directory))
    assert (info["complete"], info["world_size"], info["tensors"], info["values"]) == (True, 2, 1, 1)
    data = bytearray((directory / "rank-00001.ckpt").read_bytes())
    data[200] ^= 0x40
    (directory / "rank-00001.ckpt").write_bytes(bytes(data))
    with pytest.raises(CorruptError, match="rank-00001.ckpt"):
        cdcp.load(back, str(directory))
    assert cli(["verify", str(directory)]) == 1
    assert "rank-00001.ckpt" in capsys.readouterr().out
    (directory / "rank-00001.ckpt").unlink()
    with pytest.raises(IncompleteError, match=r"rank-00001\.ckpt \(rank 1\).*missing"):
        cdcp.load(back, str(directory))
    assert cli(["verify", str(directory)]) == 1
    assert "rank-00001.ckpt" in capsys.readouterr().out
    info = cdcp.describe(str(directory))
    assert not info["complete"] and [f["status"] for f in info["files"]] == ["ok", "missing"]


def _two_ranks(directory: Path, w: torch.Tensor) -> None:
    """Rewrite a one-rank checkpoint of {"w", "step"} as two rank files, w split in halves."""
    record = _read_record(directory)
    v = record.layout_data
    half = w.numel() // 2
    ckptfmt.save({0: w[:half].clone(), 1: 3}, str(directory / "rank-00000.ckpt"))
    ckptfmt.save({0: w[half:].clone()}, str(directory / "rank-00001.ckpt"))
    _chunks(v, "w", [[0, half, 0, 0], [half, half, 1, 0]])
    v["bytes"]["step"] = [0, 1]
    v["world_size"] = 2
    parts = tuple(
        multifile.describe_part(str(directory / n), n) for n in ("rank-00000.ckpt", "rank-00001.ckpt")
    )
    multifile.write_commit(str(directory), multifile.CommitRecord(None, "dcp", parts, layout_data=v))


def test_not_a_dcp_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(IncompleteError, match="no commit record"):
        cdcp.load({"w": torch.zeros(2)}, str(tmp_path))
    part = tmp_path / "state.ckpt"
    ckptfmt.save({"w": torch.ones(2)}, str(part))
    multifile.write_commit(
        str(tmp_path), multifile.CommitRecord(1, "state", (multifile.describe_part(str(part), "state.ckpt"),))
    )
    with pytest.raises(UnsupportedError, match="not a DCP one"):
        cdcp.load({"w": torch.zeros(2)}, str(tmp_path))


# -- sub-region reads ---------------------------------------------------------------------------------


def _boxes(shape: tuple[int, ...], rng: np.random.Generator, n: int) -> Iterator[tuple[list[int], list[int]]]:
    for _ in range(n):
        off = [int(rng.integers(0, s)) for s in shape]
        yield off, [int(rng.integers(1, s - o + 1)) for s, o in zip(shape, off)]


@pytest.mark.parametrize("layout", ["rows", "transposed", "offset-view"])
def test_boxes_of_saved_tensors(tmp_path: Path, layout: str) -> None:
    """Any hyper-rectangle of a saved tensor, whatever its strides, equals slicing the original."""
    from ckptfmt.dcp import regions

    rng = np.random.default_rng(0)
    base = torch.randn(40, 30, 20)
    t = {"rows": base, "transposed": base.permute(2, 0, 1), "offset-view": base[3:, 1:, 2:]}[layout]
    path = str(tmp_path / "t.ckpt")
    ckptfmt.save({"t": t, "h": t.to(torch.bfloat16)}, path, chunk_size=4096)
    with CheckpointFile(path) as f:
        items = dict(f.root_items())
        for key in ("t", "h"):
            meta = f.tree.nodes[items[key]][1]
            want_all = t if key == "t" else t.to(torch.bfloat16)
            for off, ln in _boxes(tuple(t.shape), rng, 25):
                for contiguous_dest in (True, False):
                    dest = (
                        torch.zeros(ln, dtype=want_all.dtype)
                        if contiguous_dest
                        else torch.zeros(list(reversed(ln)), dtype=want_all.dtype).permute(
                            *reversed(range(len(ln)))
                        )
                    )
                    job = regions.plan_box(f, meta, off, ln, dest, lambda: None, key)
                    assert job is not None
                    regions.run_jobs([job], True, regions.ReadStats())
                    want = want_all[tuple(slice(o, o + n) for o, n in zip(off, ln))]
                    assert torch.equal(dest, want), (layout, key, off, ln)


def test_row_boxes_read_only_their_chunks(tmp_path: Path) -> None:
    """A block of rows of a row-major tensor reads the chunks under those rows and no others;
    inner chunks go straight into the destination."""
    from ckptfmt.dcp import regions

    t = torch.randn(1024, 256)  # 1 KiB rows, 4 KiB chunks: 4 rows a chunk
    path = str(tmp_path / "t.ckpt")
    ckptfmt.save({"t": t}, path, chunk_size=4096)
    with CheckpointFile(path) as f:
        meta = f.tree.nodes[dict(f.root_items())["t"]][1]
        for first, n in [(0, 4), (2, 4), (101, 37), (1000, 24)]:
            dest = torch.empty(n, 256)
            stats = regions.ReadStats()
            job = regions.plan_box(f, meta, [first, 0], [n, 256], dest, lambda: None, "t")
            assert job is not None
            regions.run_jobs([job], True, stats)
            assert torch.equal(dest, t[first : first + n])
            chunks = (first + n - 1) // 4 - first // 4 + 1
            assert stats.chunks == chunks and stats.bytes == chunks * 4096
            assert stats.scratch_bytes <= 2 * 4096
        # a column block touches every chunk: it reads them all, once
        dest = torch.empty(1024, 8)
        stats = regions.ReadStats()
        job = regions.plan_box(f, meta, [0, 100], [1024, 8], dest, lambda: None, "t")
        assert job is not None
        regions.run_jobs([job], True, stats)
        assert torch.equal(dest, t[:, 100:108]) and stats.chunks == 256


def test_box_reads_are_verified(tmp_path: Path) -> None:
    path = tmp_path / "t.ckpt"
    t = torch.randn(64, 64)
    ckptfmt.save({"t": t}, str(path), chunk_size=4096)
    data = bytearray(path.read_bytes())
    data[64 + 4096 * 3 + 10] ^= 1  # a byte in chunk 3 (rows 48..63)
    path.write_bytes(bytes(data))
    back = {"t": torch.zeros(64, 64)}
    with pytest.raises(CorruptError, match="checksum"):
        cdcp.load(back, str(path))


# -- consolidation -------------------------------------------------------------------------------------


def test_consolidate_ours_and_load_file_back(tmp_path: Path) -> None:
    model, opt, state = _plain(7)
    cdcp.save(state, str(tmp_path / "ck"))
    report = cdcp.consolidate(str(tmp_path / "ck"), str(tmp_path / "full.ckpt"))
    assert report.source_format == "ckptfmt-dcp" and report.tensors >= 20
    full = ckptfmt.load(str(tmp_path / "full.ckpt"))
    assert set(full) == {"model", "optim", "extra"}
    fresh = type(model.module if hasattr(model, "module") else model)()
    fresh.load_state_dict(full["model"])  # a plain state dict: nothing else needed for inference
    for k, v in state["model"].items():
        assert torch.equal(fresh.state_dict()[k], v)
    _, _, back = _plain(8)
    cdcp.load(back, str(tmp_path / "full.ckpt"))
    assert back["extra"] == state["extra"]
    for k, v in state["optim"]["state"].items():
        for kk, vv in v.items():
            assert torch.equal(back["optim"]["state"][k][kk], vv)


def test_consolidate_dcp_filesystem_format(tmp_path: Path) -> None:
    _, _, state = _plain(9)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    report = cdcp.consolidate(str(tmp_path / "dcp"), str(tmp_path / "full.ckpt"))
    assert report.source_format == "dcp-filesystem"
    full = ckptfmt.load(str(tmp_path / "full.ckpt"))
    for k, v in state["model"].items():
        assert torch.equal(full["model"][k], v)
    assert full["extra"]["sizes"] == (1, 2.5, None)
    assert full["optim"]["param_groups"][0]["lr"] == state["optim"]["param_groups"][0]["lr"]


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/ckptfmt-dcp-pwned",))


def test_consolidate_refuses_code_in_dcp_metadata(tmp_path: Path) -> None:
    _, _, state = _plain(10)
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)
    if os.path.exists("/tmp/ckptfmt-dcp-pwned"):
        os.unlink("/tmp/ckptfmt-dcp-pwned")
    (src / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CorruptError, match="cannot be read safely"):
        cdcp.consolidate(str(src), str(tmp_path / "out.ckpt"))
    assert not os.path.exists("/tmp/ckptfmt-dcp-pwned")
    shutil.rmtree(src)
    with pytest.raises(IncompleteError):
        cdcp.consolidate(str(tmp_path), str(tmp_path / "out.ckpt"))


def test_ranks_of_one_host_share_its_cores() -> None:
    """Each rank's engine threads are its host's cores split among that host's ranks."""
    from torch.distributed.checkpoint.planner import SavePlan

    from ckptfmt.dcp.rankplan import Host as _Host
    from ckptfmt.dcp.rankplan import RankPlan as _RankPlan
    from ckptfmt.dcp.rankplan import thread_shares as _thread_shares
    from ckptfmt.engine.native import default_threads, threads_at_most

    hosts = [_Host("a", 16), _Host("a", 16), _Host("b", 8), _Host("a", 16), None]
    assert _thread_shares(hosts) == [5, 5, 8, 5, None]
    assert _thread_shares([_Host("a", 2)] * 4) == [2, 2, 2, 2]  # never below two: I/O waits overlap

    w = cdcp.Writer("/nonexistent/never-written")
    plans = w.prepare_global_plan([SavePlan([], storage_data=_Host("h", 4)) for _ in range(2)])
    assert [p.storage_data for p in plans] == [
        _RankPlan("rank-00000.ckpt", 2),
        _RankPlan("rank-00001.ckpt", 2),
    ]

    with threads_at_most(1):
        assert default_threads() == 1
        with threads_at_most(None):  # no cap inside keeps the outer one
            assert default_threads() == 1
    with threads_at_most(10**6):
        uncapped = default_threads()
    assert default_threads() == uncapped


@st.composite
def _chunk_tables(draw: Any) -> tuple[list[int], list[list[int]]]:
    ndim = draw(st.integers(0, 3))
    size = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    width = 2 * ndim + 2
    row = st.lists(st.integers(-1, 5), min_size=width, max_size=width)
    return size, draw(st.lists(row, min_size=0, max_size=6))


def _tiles_exactly(size: list[int], table: list[list[int]], n_files: int) -> bool:
    """The reference: every row in range and inside the tensor, every element covered by exactly
    one chunk (counted element by element), no two rows at the same offsets."""
    import itertools

    ndim = len(size)
    if not table or any(v < 0 for row in table for v in row):
        return False
    if any(row[2 * ndim] >= n_files for row in table):
        return False
    if any(row[d] + row[ndim + d] > size[d] for row in table for d in range(ndim)):
        return False
    count: dict[tuple[int, ...], int] = {}
    for row in table:
        ranges = [range(row[d], row[d] + row[ndim + d]) for d in range(ndim)]
        for element in itertools.product(*ranges):
            count[element] = count.get(element, 0) + 1
    every = list(itertools.product(*(range(n) for n in size)))
    if any(count.get(e, 0) != 1 for e in every) or len(count) != len(every):
        return False
    return not ndim or len({tuple(row[:ndim]) for row in table}) == len(table)


@settings(max_examples=600, deadline=None)
@given(_chunk_tables())
def test_chunk_rows_tile_the_tensor_as_counting_elements_says(
    case: tuple[list[int], list[list[int]]],
) -> None:
    """The plain-Python check of a tensor's chunk rows (the one load and verify make, without
    numpy) accepts exactly the tables whose chunks cover every element once, counted element
    by element, and refuses the others with a CorruptError."""
    from ckptfmt.dcp import metadata as mdv

    size, table = case
    numel = math.prod(size)
    try:
        mdv.check_rows(mdv._Fail("p"), "k", table, size, numel, 2)
        ok = True
    except CorruptError:
        ok = False
    assert ok == _tiles_exactly(size, table, 2), (size, table)


def test_cached_plans_follow_dtype_changes_and_failed_saves(tmp_path: Path) -> None:
    """DCP's plan cache compares keys and shapes only: a dtype change with the same shapes
    must still reach the record, an unstorable value must still fail before anything is
    written (the earlier checkpoint in the directory stays), and each save returns its own
    Metadata."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    m1 = cdcp.save({"w": w, "lr": 0.5}, str(tmp_path / "a"))
    m2 = cdcp.save({"w": w.to(torch.bfloat16), "lr": 0.25}, str(tmp_path / "b"))
    assert m1 is not m2
    assert m1.storage_meta is not None and m1.storage_meta.checkpoint_id == str(tmp_path / "a")
    assert m2.state_dict_metadata["w"].properties.dtype == torch.bfloat16  # type: ignore[union-attr]
    back = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "lr": 0.0}
    cdcp.load(back, str(tmp_path / "b"))
    assert torch.equal(back["w"], w.to(torch.bfloat16)) and back["lr"] == 0.25
    with pytest.raises(UnsupportedObjectError, match="lr"):
        cdcp.save({"w": w.to(torch.bfloat16), "lr": object()}, str(tmp_path / "b"))
    assert (tmp_path / "b" / multifile.COMMIT_NAME).exists()
    cdcp.load(back, str(tmp_path / "b"))
    assert back["lr"] == 0.25
    cdcp.save({"w": w.to(torch.bfloat16) + 1, "lr": 0.125}, str(tmp_path / "b"))
    cdcp.load(back, str(tmp_path / "b"))
    assert torch.equal(back["w"], w.to(torch.bfloat16) + 1) and back["lr"] == 0.125


def test_tiling_check_of_many_chunks_is_a_sweep_not_every_pair() -> None:
    """200k one-element chunks of a vector (a hostile record could hold millions) are checked
    by sorting, not by comparing every pair; chunks that pile up where a sweep cannot tell
    them apart stop at a limit with a LimitError, never a hang."""
    import random

    from ckptfmt.dcp import metadata as mdv
    from ckptfmt.errors import LimitError

    fail = mdv._Fail("p")
    n = 200_000
    starts = list(range(n))
    random.Random(0).shuffle(starts)
    table = [[o, 1, 0, k] for k, o in enumerate(starts)]
    mdv.check_rows(fail, "v", table, [n], n, 1)  # exact: passes
    table[7][0] = table[8][0]  # two chunks at one element, another element uncovered
    with pytest.raises(CorruptError, match="overlap"):
        mdv.check_rows(fail, "v", table, [n], n, 1)
    m = 3000  # every chunk on element 0: volumes add up, 4.5M pairs to compare
    with pytest.raises(LimitError, match="too often to check"):
        mdv._check_disjoint(fail, "v", [([0], [1])] * m)
    grid = [[r, c, 8, 16, 0, 0] for r in range(0, 64, 8) for c in range(0, 64, 16)]
    mdv.check_rows(fail, "g", grid, [64, 64], 64 * 64, 1)  # 2-D shards


def test_a_writers_options_are_one_value_checked_once(tmp_path):
    """Writer checks its options once into a frozen WriterOptions that every rank file and the
    commit record are written from: what the caller changes afterwards changes nothing."""
    import dataclasses

    from ckptfmt.dcp.storage import Writer

    meta, metrics = {"run": "a"}, {"loss": 1.0}
    w = Writer(tmp_path / "ck", metadata=meta, metrics=metrics, step=7, chunk_size=1 << 16)
    meta["run"], metrics["loss"] = "b", 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.options.step = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        w.options.metadata["run"] = "c"  # type: ignore[index]
    dcp.save({"x": torch.arange(10)}, storage_writer=w, planner=cdcp.SavePlanner())
    record = multifile.read_commit(str(tmp_path / "ck"))
    assert (record.step, record.metadata, record.metrics) == (7, {"run": "a"}, {"loss": 1.0})
    with pytest.raises(ValueError, match="chunk_size"):
        Writer(tmp_path / "other", chunk_size=3)


_ASYNC_SAVE_IN_ATEXIT = """
import atexit, sys, warnings, torch
import ckptfmt.dcp as cdcp
warnings.filterwarnings("ignore")

@atexit.register
def last():
    try:
        cdcp.async_save({"w": torch.arange(10.0)}, sys.argv[1]).result(timeout=60)
        back = {"w": torch.zeros(10)}
        cdcp.load(back, sys.argv[1])
        print("saved" if torch.equal(back["w"], torch.arange(10.0)) else "wrong values", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, e, flush=True)
"""


def test_an_async_save_in_an_atexit_handler_is_made_there(tmp_path):
    """torch's async_save writes on a pool, which refuses work once the interpreter exits: a
    final checkpoint saved by an atexit handler is saved there, blocking, its future done."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, "-c", _ASYNC_SAVE_IN_ATEXIT, str(tmp_path / "final")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "saved", done.stdout + done.stderr[-3000:]

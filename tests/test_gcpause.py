"""The cyclic collector is paused while ckptfmt builds object trees, and always restored."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.gcpause import paused

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def collections_seen() -> Iterator[list[int]]:
    """Counts collections; a low threshold makes every burst of allocations trigger some."""
    seen: list[int] = []

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    old = gc.get_threshold()
    gc.set_threshold(50, 2, 2)
    gc.callbacks.append(cb)
    try:
        yield seen
    finally:
        gc.callbacks.remove(cb)
        gc.set_threshold(*old)


def _state(n: int) -> dict[str, object]:
    return {f"layer{i}": {"w": torch.full((4,), float(i)), "lr": 0.1 * i, "name": str(i)} for i in range(n)}


def _import_once(tmp_path: Path) -> None:
    """A first save and load import their modules on first use, outside any section (each
    import allocates, so the collector may run): done once before counting, as any process's
    first checkpoint would have done, so that the count says what a section does."""
    ckptfmt.save(_state(2), tmp_path / "warm.ckpt")
    ckptfmt.load(tmp_path / "warm.ckpt")
    cdcp.save(_state(2), tmp_path / "warm")
    cdcp.load(_state(2), tmp_path / "warm")


def test_save_and_load_run_no_collection(tmp_path: Path, collections_seen: list[int]) -> None:
    _import_once(tmp_path)
    state = _state(2000)
    path = tmp_path / "a.ckpt"
    # a reference: the same amount of allocation outside ckptfmt does trigger collections
    junk = [[i, str(i)] for i in range(20000)]
    assert len(collections_seen) > 100, "the low threshold should have made the collector run"
    del junk
    collections_seen.clear()
    ckptfmt.save(state, path)
    back = ckptfmt.load(path)
    # at most one collection at each edge of a section: what was allocated just before it,
    # and, after it ends, the young objects it made
    assert len(collections_seen) <= 4, collections_seen
    assert gc.isenabled()
    assert torch.equal(back["layer1999"]["w"], state["layer1999"]["w"])  # type: ignore[index]


def test_dcp_save_and_load_run_no_collection(tmp_path: Path, collections_seen: list[int]) -> None:
    _import_once(tmp_path)
    state = _state(500)
    back = _state(500)
    for v in back.values():
        v["w"].zero_()  # type: ignore[index]
    collections_seen.clear()
    cdcp.save(state, tmp_path / "d")
    cdcp.load(back, tmp_path / "d")
    assert len(collections_seen) <= 4, collections_seen
    assert gc.isenabled()
    assert torch.equal(back["layer7"]["w"], state["layer7"]["w"])  # type: ignore[index]


def test_a_collector_switched_off_by_the_caller_stays_off(tmp_path: Path) -> None:
    gc.disable()
    try:
        ckptfmt.save(_state(3), tmp_path / "a.ckpt")
        ckptfmt.load(tmp_path / "a.ckpt")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_restores_the_collector(tmp_path: Path) -> None:
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint at all" * 100)
    with pytest.raises(ckptfmt.CheckpointError):
        ckptfmt.load(tmp_path / "bad.ckpt")
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), paused():
        1 / 0  # noqa: B018
    assert gc.isenabled()


def test_the_last_section_to_end_switches_it_back_on() -> None:
    """Sections in two threads overlap: the first to end must not switch the collector on."""
    inside = threading.Event()
    leave = threading.Event()
    states: list[bool] = []

    def other() -> None:
        with paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with paused():
        t.start()
        inside.wait(10)
    states.append(gc.isenabled())  # the other thread is still inside
    leave.set()
    t.join(10)
    states.append(gc.isenabled())
    assert states == [False, True]


def test_whole_calls_pause_only_in_the_main_thread() -> None:
    """A blocking call pauses for its whole length where the caller waits for it; from another
    thread (a background save) the rest of the process keeps its collector."""
    from ckptfmt.gcpause import pausing_in_main_thread

    probe = pausing_in_main_thread(gc.isenabled)
    assert probe() is False
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(probe()))
    t.start()
    t.join(10)
    assert seen == [True] and gc.isenabled()


def test_a_child_forked_during_a_section_gets_its_collector_back() -> None:
    import os

    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the section's thread does not exist here
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        leave.set()
        t.join(10)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()


_CYCLE_PROBE = r"""
import gc, json, sys
from pathlib import Path

import torch

import ckptfmt
from ckptfmt import dcp as cdcp


def state(n):
    return {f"layer{i}": {"w": torch.full((4,), float(i)), "lr": 0.1 * i, "name": str(i)} for i in range(n)}


def unreachable_after(fn):
    # run fn with the collector off, drop its result, and count what a full collection frees
    gc.collect()
    gc.disable()
    try:
        fn()
        return gc.collect()
    finally:
        gc.enable()


where = Path(sys.argv[1])
full = state(300)
path = where / "a.ckpt"
ckptfmt.save(full, path)
cdcp.save(full, where / "d")
run = ckptfmt.CheckpointManager(where / "run")
run.save(1, full)
calls = {
    "save": lambda: ckptfmt.save(full, where / "b.ckpt"),
    "load": lambda: ckptfmt.load(path),
    "load mmap": lambda: ckptfmt.load(path, mmap=True),
    "open get": lambda: ckptfmt.open(path).get("layer7"),
    "load_into": lambda: ckptfmt.load_into(path, state(300)),
    "verify": lambda: ckptfmt.verify(path),
    "dcp": lambda: cdcp.load(state(300), where / "d"),
    "manager": lambda: run.load(),
}
print(json.dumps({op: unreachable_after(fn) for op, fn in calls.items()}))
"""


@pytest.fixture(scope="module")
def cycles_left(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Objects in reference cycles each call leaves behind, counted in a process of its own:
    in the test process, threads that earlier tests left (servers, trainers' workers) allocate
    and drop cycles of their own while a call runs, and a full collection cannot tell whose."""
    import json
    import subprocess
    import sys

    where = tmp_path_factory.mktemp("cycles")
    done = subprocess.run(
        [sys.executable, "-c", _CYCLE_PROBE, str(where)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "op", ["save", "load", "load mmap", "open get", "load_into", "verify", "dcp", "manager"]
)
def test_calls_leave_no_reference_cycles(cycles_left: dict[str, int], op: str) -> None:
    """Every index a call parses is freed by reference counting as soon as the call returns.
    A cycle (a storage record pointing back at its tree, a decoder calling itself through its
    closure) would leave the whole index for a collection that walks the whole heap: in a
    process that has imported torch, 0.1 s or more, paid by whatever allocates next, often the
    load itself."""
    assert cycles_left[op] == 0

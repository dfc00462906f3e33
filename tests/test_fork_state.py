"""A forked child (a DataLoader worker, a process a training script forks) forgets the state
of its parent's that a fork copies: every module-level lock, which a thread of the parent's
may have held at the fork (the child has no such thread: it would wait on it for ever), and
the registries of what the parent had under way.  One mechanism does it everywhere:
``os.register_at_fork(after_in_child=...)``.  Each check runs in a child forked while another
thread of this process holds the lock, under an alarm that kills a child that hangs."""

from __future__ import annotations

import os
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import ckptfmt


def _in_child(check: Callable[[], bool], deadline: int = 20) -> int:
    """Fork; run check() in the child within `deadline` s (SIGALRM ends a child that hangs); its
    exit status: 0 when check() held, 2 when it did not, 3 when it raised, -14 when it hung.
    The child computes on one thread, as DataLoader workers do (torch's pool of the parent's is
    not the child's: its parallel ops hang after a fork)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            signal.alarm(deadline)
            torch.set_num_threads(1)
            code = 0 if check() else 2
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@contextmanager
def _held_by_a_thread(lock: Any) -> Iterator[None]:
    """`lock` held by another thread of this process while the block runs."""
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            done.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        done.set()
        t.join()


def _save_blocking(path: str) -> Callable[[], bool]:
    def check() -> bool:
        ckptfmt.save({"w": torch.ones(3)}, path)
        return torch.equal(ckptfmt.load(path)["w"], torch.ones(3))

    return check


def test_a_child_writes_its_own_temp_files(tmp_path):
    from ckptfmt.engine import commit

    parent_owner = commit.owner_token()
    with _held_by_a_thread(commit._own_lock):
        assert _in_child(_save_blocking(str(tmp_path / "child.ckpt"))) == 0
        assert _in_child(lambda: commit.owner_token() != parent_owner) == 0


def test_a_child_saves_in_the_background_through_the_staging_pool(tmp_path):
    from ckptfmt.background import staging

    path = str(tmp_path / "child.ckpt")

    def check() -> bool:
        ckptfmt.save({"w": torch.ones(3)}, path, blocking=False).wait(15)
        return staging.POOL.in_use == 0 and torch.equal(ckptfmt.load(path)["w"], torch.ones(3))

    with _held_by_a_thread(staging.POOL._cond):
        assert _in_child(check) == 0


def test_a_child_reads_the_free_huge_page_blocks_itself():
    from ckptfmt.engine import hostmem

    with _held_by_a_thread(hostmem._lock):
        assert _in_child(lambda: hostmem._take_free_blocks(0)) == 0


def test_a_child_counts_its_own_store_errors():
    from ckptfmt.storage import client

    with _held_by_a_thread(client._errors_lock):
        assert _in_child(lambda: client.add_transfer_errors(ConnectionError) is None) == 0


def test_a_child_claims_its_own_copy_markers():
    from ckptfmt.runs import objectnames

    def check() -> bool:
        with objectnames.claiming("marker"):
            return True

    objectnames._claims_in_use["parents-marker"] += 1  # a copy of the parent's under way
    try:
        with _held_by_a_thread(objectnames._claims_lock):
            assert _in_child(check) == 0
            assert _in_child(lambda: "parents-marker" not in objectnames._claims_in_use) == 0
    finally:
        del objectnames._claims_in_use["parents-marker"]


def test_a_child_registers_classes_and_keeps_the_parents():
    import collections

    from ckptfmt.integrations import objects

    Pair = collections.namedtuple("Pair", "a b")
    objects.register(Pair)
    try:
        with _held_by_a_thread(objects._registry_lock):
            assert _in_child(lambda: objects.qualified_name(Pair) in objects.registered()) == 0
    finally:
        objects.unregister(Pair)


def test_a_child_makes_its_own_work_folders_and_holds_none_of_the_parents():
    from ckptfmt.integrations.lightning import workdirs

    parents = workdirs.make(workdirs.UPLOAD)
    try:

        def check() -> bool:
            mine = workdirs.make(workdirs.DOWNLOAD)
            held = set(workdirs._HELD)
            workdirs.remove(mine)
            return held == {mine}

        with _held_by_a_thread(workdirs._HELD_LOCK):
            assert _in_child(check) == 0
        assert os.path.isdir(parents)
    finally:
        workdirs.remove(parents)


def test_a_child_can_undo_the_pretrained_hook():
    pytest.importorskip("transformers")
    from ckptfmt.integrations.transformers import pretrained

    with _held_by_a_thread(pretrained._LOCK):
        assert _in_child(lambda: pretrained.disable() is None) == 0


def test_a_child_makes_its_own_store_and_its_own_connections(s3_bucket):
    """The parent's store holds pooled connections: a child that used them would read answers
    meant for its parent.  The child's store is its own, and its requests are answered."""
    from ckptfmt.storage import backends
    from ckptfmt.storage.urls import parse_url

    bucket, options = s3_bucket
    url = parse_url(f"s3://{bucket}/object")
    parents = backends.store_for(url, options)
    parents.put(url, memoryview(b"data"), if_absent=False)  # a connection in the parent's pool

    def check() -> bool:
        mine = backends.store_for(url, options)
        return mine is not parents and mine.head(url)[0] == 4

    with _held_by_a_thread(backends._lock):
        assert _in_child(check) == 0
    assert backends.store_for(url, options) is parents


def test_dcp_background_saves_of_the_parent_are_not_the_childs(tmp_path: Any, monkeypatch: Any) -> None:
    """A child forked while its parent's DCP background save is in flight (the stagers' pending
    future, as async_save leaves it until the write ends; the fork stager's lock held by a
    thread) makes a background save of its own at once: it does not wait for the parent's
    future, which no thread of the child ends (a CheckpointError at the deadline before), nor
    on the lock."""
    from ckptfmt import dcp as cdcp
    from ckptfmt.background import inflight
    from ckptfmt.dcp import api
    from ckptfmt.dcp.forkstage import ForkStager

    monkeypatch.setattr(inflight, "DEADLINE", 2.0)
    parent = __import__("concurrent.futures").futures.Future()
    own = cdcp.Stager()
    for stager in (api._DEFAULT_STAGER, own):
        stager.track(parent, str(tmp_path / "parent-step"))
    api._LAST_SAVE.track(parent, str(tmp_path / "parent-step"))

    def saves() -> bool:
        for i, stager in enumerate((None, own)):
            kw = {} if stager is None else {"stager": stager}
            cdcp.async_save({"w": torch.arange(10.0)}, str(tmp_path / f"child-{i}"), **kw).result(timeout=15)
        return True

    try:
        with _held_by_a_thread(ForkStager._lock):
            assert _in_child(saves) == 0
    finally:
        parent.set_result(None)


def test_a_reader_of_an_incremental_file_reads_in_a_child_forked_mid_read(tmp_path: Any) -> None:
    """The chunk reader's locks over referenced files (held by a parent thread's read at the
    fork) are the child's own: a DataLoader worker's get does not wait on them for ever."""
    from ckptfmt.files import incremental

    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    frozen = torch.arange(1 << 16, dtype=torch.float32)
    incremental.save({"frozen": frozen, "x": torch.zeros(4)}, a)
    incremental.save({"frozen": frozen, "x": torch.ones(4)}, b, base=a, min_reference_bytes=1024)
    with ckptfmt.open(b) as r:
        chunks = r._file.chunk_reader
        assert chunks.externals
        chunks._pins[0] += 1  # a parent's read holds the referenced file at the fork
        with _held_by_a_thread(chunks._ext_lock):
            # compared by numpy: torch's own thread pool is not the child's to use
            assert _in_child(lambda: bool((r.get("frozen").numpy() == frozen.numpy()).all())) == 0
        chunks._pins.clear()


def test_a_reader_closes_at_once_in_a_child_forked_while_a_parent_get_ran(tmp_path: Any) -> None:
    """A Reader's count of gets in progress and its lock are the child's own: a get of the
    parent's at the fork (which never ends in the child) neither holds the child's close for
    its wait nor leaves the file open; the child's own gets read."""
    import time

    from ckptfmt.files import load

    path = str(tmp_path / "r.ckpt")
    w = torch.arange(1 << 12, dtype=torch.float32)
    ckptfmt.save({"w": w}, path)
    with ckptfmt.open(path) as r:
        gets = r._gets

        def child() -> bool:
            ok = bool((r.get("w").numpy() == w.numpy()).all())
            began = time.monotonic()
            r.close()
            return ok and time.monotonic() - began < load.CLOSE_WAIT / 2 and r._file.chunk_reader.fd == -1

        with gets.running("a parent's get"), _held_by_a_thread(gets._cond):
            assert _in_child(child) == 0

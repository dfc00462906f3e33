"""A Reader of an object opened in a parent and read in a forked child (a DataLoader worker
whose Dataset holds it): the child reads through a spool, threads, locks and books of its own,
made at its first read, at the version the parent opened; the parent's reads, on threads that
go on meanwhile, and its spool's pages are untouched by the child's.  A child that hangs
(waiting on a pool whose threads it lacks, or a lock a parent thread held at the fork) is
ended by an alarm: a failure, never a blocked run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from helpers import assert_same
from test_fork_state import _held_by_a_thread
from test_fork_state import _in_child as _in_child_within

import ckptfmt
from ckptfmt.errors import StorageError
from ckptfmt.storage.download import RemoteObject

MiB = 1 << 20
#: seconds a child may take before its alarm ends it (its reads take well under one)
CHILD_DEADLINE = 30


def _state(seed: int = 11) -> dict[str, torch.Tensor]:
    """Tensors read through the spool (small ones, a request spanning neighbours) and straight
    into their tensors (ones of several chunks), interleaved in the object."""
    g = torch.Generator().manual_seed(seed)
    sizes = [3000, 300_000, 5000, 70_000, 1000, 300_000]
    return {f"t{i:02d}": torch.randn(n, generator=g) for i, n in enumerate(sizes * 2)}


def _saved(url: str, options: dict[str, object], state: dict[str, torch.Tensor]) -> None:
    ckptfmt.save(state, url, storage_options=options, chunk_size=64 << 10)


def _remote(r: ckptfmt.Reader) -> RemoteObject:
    remote = r._file.chunk_reader.remote
    assert isinstance(remote, RemoteObject)
    return remote


def _in_child(check: Callable[[], bool]) -> int:
    return _in_child_within(check, CHILD_DEADLINE)


def _reads_all(r: ckptfmt.Reader, state: dict[str, torch.Tensor], keys: list[str]) -> bool:
    """Each key got twice (verified, and unverified: bytes of another process's would then come
    back as they are) and compared bit for bit."""
    for verify in (True, False):
        for k in keys:
            if not torch.equal(r.get(k, verify=verify), state[k]):
                print(f"{k} (verify={verify}) differs")
                return False
    return True


@contextmanager
def _parent_reading(r: ckptfmt.Reader, state: dict[str, torch.Tensor]) -> Iterator[list[str]]:
    """A thread of the parent's reading every key through `r` in a loop while the block runs
    (and a round after it); its problems, in the list yielded, checked after."""
    problems: list[str] = []
    stop = threading.Event()
    rounds = [0]

    def loop() -> None:
        deadline = time.monotonic() + 120
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                if not _reads_all(r, state, list(state)):
                    problems.append(f"round {rounds[0]}: a tensor differs")
                rounds[0] += 1
            _reads_all(r, state, list(state)) or problems.append("the round after: a tensor differs")
        except BaseException as e:
            problems.append(f"round {rounds[0]}: {e!r}")

    t = threading.Thread(target=loop)
    t.start()
    while rounds[0] == 0 and t.is_alive():  # its pool's threads exist and are at work
        time.sleep(0.01)
    try:
        yield problems
    finally:
        stop.set()
        t.join(180)
        assert not t.is_alive(), "the parent's reading thread never ended"
    assert rounds[0] > 0


def test_a_child_reads_a_reader_the_parent_reads_meanwhile_bit_exact(s3_bucket):
    """Forked while a parent thread reads: the child reads the same and other keys bit for bit
    and closes the Reader; the parent's reads meanwhile and after are bit-exact, and the bytes
    its spool held when opened (the index's tail) are still there."""
    bucket, options = s3_bucket
    options = options | {"request_size": MiB}
    state = _state()
    url = f"s3://{bucket}/forked.ckpt"
    _saved(url, options, state)
    keys = list(state)
    with ckptfmt.open(url, storage_options=options) as r:
        remote = _remote(r)
        assert remote.spool is not None
        tail = (remote.size - 4096, remote.size)
        held = bytes(remote.spool.view(*tail))
        assert any(held)

        def child(part: list[str]) -> Callable[[], bool]:
            def check() -> bool:
                ok = _reads_all(r, state, part)
                r.close()  # the child's spool, pool and descriptors: the parent's untouched
                return ok

            return check

        with _parent_reading(r, state) as problems:
            assert _in_child(child(keys)) == 0  # the same keys the parent reads
            assert _in_child(child(keys[::3])) == 0  # some of them
        assert not problems, problems
        assert bytes(remote.spool.view(*tail)) == held
        assert_same(r.load(), state)


def test_dataloader_workers_read_a_dataset_holding_a_reader(s3_bucket):
    """A Dataset holding a Reader, read by two forked DataLoader workers while a parent thread
    reads it too: every item bit for bit, in the parent as in the workers."""
    from torch.utils.data import DataLoader, Dataset

    bucket, options = s3_bucket
    options = options | {"request_size": MiB}
    state = _state(5)
    url = f"s3://{bucket}/dataset.ckpt"
    _saved(url, options, state)
    keys = list(state) * 2

    class Entries(Dataset[torch.Tensor]):
        def __init__(self, reader: ckptfmt.Reader) -> None:
            self.reader = reader

        def __len__(self) -> int:
            return len(keys)

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.reader.get(keys[i])  # type: ignore[no-any-return]

    with ckptfmt.open(url, storage_options=options) as r:
        with _parent_reading(r, state) as problems:
            loader = DataLoader(
                Entries(r),
                batch_size=None,
                num_workers=2,
                multiprocessing_context="fork",
                timeout=CHILD_DEADLINE,
            )
            got = list(loader)
        assert not problems, problems
    assert len(got) == len(keys)
    for k, t in zip(keys, got):
        assert torch.equal(t, state[k]), k


def test_a_child_forked_while_a_parent_thread_holds_the_objects_lock_reads(s3_bucket):
    """The object's lock held by a thread of the parent's (a read in progress) at the fork: the
    child, which has no such thread, still reads."""
    bucket, options = s3_bucket
    state = _state(7)
    url = f"s3://{bucket}/locked.ckpt"
    _saved(url, options, state)
    with ckptfmt.open(url, storage_options=options) as r:
        with _held_by_a_thread(_remote(r)._held_lock):
            assert _in_child(lambda: _reads_all(r, state, list(state))) == 0
        assert_same(r.load(), state)


def test_a_child_reads_the_version_the_parent_opened_or_fails(s3_bucket):
    """The object replaced (same size, other values) after the parent opened it: the child's
    read is a StorageError naming the URL, never the new version's bytes."""
    bucket, options = s3_bucket
    state = _state(3)
    url = f"s3://{bucket}/replaced.ckpt"
    _saved(url, options, state)
    with ckptfmt.open(url, storage_options=options) as r:
        size = _remote(r).size
        _saved(url, options, {k: v + 1 for k, v in state.items()})
        with ckptfmt.open(url, storage_options=options) as now:
            assert _remote(now).size == size  # only the version tells them apart

        def check() -> bool:
            try:
                got = r.get("t01", verify=False)
            except StorageError as e:
                print(e)
                return e.path == url
            print("read", "the new bytes" if torch.equal(got, state["t01"] + 1) else "other bytes")
            return False

        assert _in_child(check) == 0


def test_a_child_forked_while_a_parent_thread_opens_a_referenced_object_reads(s3_bucket):
    """An incremental step's object refers to an earlier step's for its unchanged chunks: the
    chunk reader's lock held by a thread of the parent's (opening that object) at the fork: the
    child still reads both objects' chunks."""
    from ckptfmt import CheckpointManager

    bucket, options = s3_bucket
    url = f"s3://{bucket}/inc"
    frozen = torch.arange(1 << 18, dtype=torch.float32)
    m = CheckpointManager(url, incremental=True, storage_options=options)
    for step in (1, 2):
        m.save(step, {"frozen": frozen, "head": torch.full((1000,), float(step)), "step": step})
    with ckptfmt.open(f"{url}/step-000000002/state.ckpt", storage_options=options) as r:
        expected = r.load()
        assert r._file.externals  # its frozen chunks lie in step 1's object
        with _held_by_a_thread(r._file.chunk_reader._ext_lock):
            assert _in_child(lambda: _same(r.load(), expected)) == 0


def _same(a: object, b: object) -> bool:
    assert_same(a, b)
    return True

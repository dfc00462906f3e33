"""Reads of one store object at once, where the bookkeeping of what each read uses could go
wrong: an incremental object whose referenced objects are let go of (max_open) by one read
while another reads from them, a direct read's copy of held bytes another read still uses,
and a read whose windows fail to start.  Real moto server; every read compared bit for bit."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import ckptfmt
from ckptfmt.format.layout import PROLOGUE_SIZE
from ckptfmt.storage.download import RemoteObject

MiB = 1 << 20


def _settle(remote: RemoteObject) -> None:
    """Wait (30 s at most) until the pages given back are freed on the freeing thread."""
    deadline = time.monotonic() + 30
    while True:
        with remote._held_lock:
            pending = [f for _, f in remote._book.freeing if not f.done()]
        if not pending:
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("verify", [False, True])
def test_gets_at_once_of_an_object_whose_chunks_lie_in_many_others(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """Eight chained incremental objects, two kept open: a read fetches a referenced object's
    chunks into that object's spool, and must read them from it, not from the same object
    opened again by another thread after a third let it go (a new spool, without the bytes)."""
    from ckptfmt.files import incremental, reader

    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 2)
    bucket, options = s3_bucket
    g = torch.Generator().manual_seed(9)
    tensors = {f"t{j}": torch.randn(70_000, generator=g) for j in range(8)}
    base = None
    for k in range(8):
        state = dict(tensors, **{f"t{k}": tensors[f"t{k}"] + 100})
        url = f"s3://{bucket}/chained/f{k}/state.ckpt"
        incremental.save(state, url, base=base, min_reference_bytes=1024, storage_options=options)
        tensors, base = state, url
    keys = list(tensors)
    bad: list[str] = []
    with ckptfmt.open(base, storage_options=options) as r:
        for rnd in range(3):
            rng = random.Random(rnd)
            plans = [rng.sample(keys, len(keys)) for _ in range(6)]
            gate = threading.Barrier(6)

            def read(plan: list[str], gate: threading.Barrier = gate) -> list[tuple[str, object]]:
                gate.wait(30)
                out: list[tuple[str, object]] = []
                for k in plan:
                    try:
                        out.append((k, r.get(k, verify=verify)))
                    except Exception as e:  # noqa: BLE001 - every failure is reported below
                        out.append((k, e))
                return out

            with ThreadPoolExecutor(6) as pool:
                for got in pool.map(read, plans, timeout=300):
                    for k, t in got:
                        if not isinstance(t, torch.Tensor):
                            bad.append(f"{k}: {t!r}"[:200])
                        elif not torch.equal(t, tensors[k]):
                            bad.append(f"{k}: {int((t == 0).sum())} zeros")
    assert not bad, f"{len(bad)} bad gets, e.g. {bad[:5]}"


def _chained(bucket: str, options: dict[str, Any], name: str) -> tuple[str, dict[str, torch.Tensor]]:
    """Eight chained incremental objects, tensor j's bytes in object j: the last one's URL and
    its state."""
    from ckptfmt.files import incremental

    g = torch.Generator().manual_seed(9)
    tensors = {f"t{j}": torch.randn(70_000, generator=g) for j in range(8)}
    base = None
    for k in range(8):
        state = dict(tensors, **{f"t{k}": tensors[f"t{k}"] + 100})
        url = f"s3://{bucket}/{name}/f{k}/state.ckpt"
        incremental.save(state, url, base=base, min_reference_bytes=1024, storage_options=options)
        tensors, base = state, url
    assert base is not None
    return base, tensors


@pytest.mark.parametrize("verify", [False, True])
def test_gets_at_once_with_one_referenced_object_open(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """One referenced object kept open, six threads getting every key at once: each read holds
    the object it reads from (never let go of under it, never opened twice at once), so every
    get is bit for bit; no more are open at once than one beside those the reads hold (one
    each), once the gets are over no read holds any and one is open, and the descriptors are
    back to what they were once the reader is closed."""
    from ckptfmt.engine.chunkread import ChunkReader
    from ckptfmt.files import reader

    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 1)
    most_open = [0]
    unheld = ChunkReader._unheld

    def counted(self: ChunkReader, keep: int = -1) -> list[int]:
        fds = unheld(self, keep)
        most_open[0] = max(most_open[0], len(self._ext_open))
        return fds

    monkeypatch.setattr(ChunkReader, "_unheld", counted)
    bucket, options = s3_bucket
    url, tensors = _chained(bucket, options, "one-open")
    keys = list(tensors)
    bad: list[str] = []
    fds = len(os.listdir("/proc/self/fd"))
    with ckptfmt.open(url, storage_options=options) as r:
        chunks = r._file.chunk_reader
        for rnd in range(2):
            rng = random.Random(rnd)
            plans = [rng.sample(keys, len(keys)) for _ in range(6)]
            gate = threading.Barrier(6)

            def read(plan: list[str], gate: threading.Barrier = gate) -> list[tuple[str, object]]:
                gate.wait(30)
                out: list[tuple[str, object]] = []
                for k in plan:
                    try:
                        out.append((k, r.get(k, verify=verify)))
                    except Exception as e:  # noqa: BLE001 - every failure is reported below
                        out.append((k, e))
                return out

            with ThreadPoolExecutor(6) as pool:
                for got in pool.map(read, plans, timeout=300):
                    for k, t in got:
                        if not isinstance(t, torch.Tensor):
                            bad.append(f"{k}: {t!r}"[:200])
                        elif not torch.equal(t, tensors[k]):
                            bad.append(f"{k}: {int((t == 0).sum())} zeros")
            assert not +chunks._pins, dict(chunks._pins)
            assert len(chunks._ext_open) <= 1
    assert not bad, f"{len(bad)} bad gets, e.g. {bad[:5]}"
    assert 1 <= most_open[0] <= 1 + 6
    for t in threading.enumerate():  # each spool's mapping (a descriptor) is closed on this thread
        if t.name.startswith("ckptfmt-free-spool"):
            t.join(30)
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_gets_of_different_referenced_objects_run_together(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get whose fetch from one referenced object is held up does not hold up a get that
    reads from another: reads of an incremental object run at once, not in turn."""
    from ckptfmt.storage import download

    bucket, options = s3_bucket
    url, tensors = _chained(bucket, options, "together")
    release = threading.Event()
    held = threading.Event()
    get_range = RemoteObject._get_range

    def held_up(self: RemoteObject, lo: int, hi: int, *args: Any, **kwargs: Any) -> None:
        # f0's chunk bytes (not its prologue or tail, fetched as it is opened) wait for the test
        if "/f0/" in self.path and PROLOGUE_SIZE < hi and lo < self.size - download.TAIL_BYTES:
            held.set()
            release.wait(60)
        get_range(self, lo, hi, *args, **kwargs)

    monkeypatch.setattr(RemoteObject, "_get_range", held_up)
    with ckptfmt.open(url, storage_options=options) as r, ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(r.get, "t0")  # its bytes lie in f0
            assert held.wait(30)
            second = pool.submit(r.get, "t3")  # its bytes lie in f3
            assert torch.equal(second.result(timeout=30), tensors["t3"])
            assert not first.done()
        finally:
            release.set()
        assert torch.equal(first.result(timeout=60), tensors["t0"])


def test_a_referenced_object_being_opened_holds_up_no_other_get(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get that opens a referenced object (its head, prologue and tail asked for) does not
    hold up a get that reads from another, nor is the one being opened opened twice: a get
    that needs it meanwhile waits for that opening."""
    bucket, options = s3_bucket
    url, tensors = _chained(bucket, options, "opening")
    release, held = threading.Event(), threading.Event()
    opened: list[str] = []
    fetch_structure = RemoteObject.fetch_structure

    def held_up(self: RemoteObject, *args: Any, **kwargs: Any) -> None:
        opened.append(self.path)
        if "/f0/" in self.path:
            held.set()
            release.wait(60)
        fetch_structure(self, *args, **kwargs)

    monkeypatch.setattr(RemoteObject, "fetch_structure", held_up)
    with ckptfmt.open(url, storage_options=options) as r, ThreadPoolExecutor(3) as pool:
        try:
            first = pool.submit(r.get, "t0")  # opens f0, which holds
            assert held.wait(30)
            again = pool.submit(r.get, "t0")  # waits for that opening
            assert torch.equal(pool.submit(r.get, "t3").result(timeout=30), tensors["t3"])
            assert not first.done() and not again.done()
        finally:
            release.set()
        assert torch.equal(first.result(timeout=60), tensors["t0"])
        assert torch.equal(again.result(timeout=60), tensors["t0"])
    assert sum("/f0/" in p for p in opened) == 1


def test_a_copy_of_held_bytes_leaves_another_reads_use_of_them(s3_bucket: Any) -> None:
    """A direct read copies a chunk the spool holds and gives it back: a read that uses the same
    range (and has not given it back) keeps it, its bytes still there."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/held/unit.ckpt"
    ckptfmt.save({"w": torch.randn(MiB)}, url, storage_options=options)
    remote = RemoteObject(url, options, fetch_index=False)
    try:
        used = (8192, 8192 + 262144)  # page-aligned, as a chunk's span with no padding is
        remote.wait(remote.start((), uses=[used]))  # one read uses the range, reads it later
        assert remote.spool is not None
        before = bytes(remote.spool.view(*used))
        assert any(before)
        mine = bytearray(used[1] - used[0])  # another's direct target: the same chunk, held
        assert remote.copy_held([(used[0], memoryview(mine))]) == [used]
        assert bytes(mine) == before
        _settle(remote)
        assert dict(remote._book.uses) == {used: 1}
        assert bytes(remote.spool.view(*used)) == before
    finally:
        remote.close()


class _Refusing:
    """A pool that takes no work, as when no thread can start."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("can't start new thread")


def test_a_read_whose_second_window_fails_to_start_gives_back_the_first(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uses of the windows started before one that failed to start are given back: none is
    left in the spool's books once the get has failed."""
    from ckptfmt.engine import native
    from ckptfmt.engine.chunkread import decode_memory
    from ckptfmt.files.reader import CheckpointFile

    bucket, options = s3_bucket
    options = options | {"request_size": MiB}
    state = {"w": torch.randn(2 * MiB, generator=torch.Generator().manual_seed(1))}  # 8 MiB
    url = f"s3://{bucket}/windows/leak.ckpt"
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10, compression="zstd")
    with CheckpointFile(url, storage_options=options) as f:
        index, decode = f.index_memory, decode_memory(f.chunks, native.available())
    start = RemoteObject.start
    calls = [0]

    def second_refused(
        self: RemoteObject, ranges: Any, cell: Any = None, gap: Any = None, uses: Any = ()
    ) -> Any:
        calls[0] += 1
        if calls[0] != 2:
            return start(self, ranges, cell, gap, uses)
        pool, self._pool = self._pool, _Refusing()  # type: ignore[assignment]
        try:
            return start(self, ranges, cell, gap, uses)
        finally:
            self._pool = pool

    with ckptfmt.open(url, max_bytes=index + 8 * MiB + decode + 3 * MiB, storage_options=options) as r:
        remote = r._file.chunk_reader.remote
        monkeypatch.setattr(RemoteObject, "start", second_refused)
        with pytest.raises((RuntimeError, ckptfmt.StorageError)):
            r.get("w")
        monkeypatch.setattr(RemoteObject, "start", start)
        assert calls[0] >= 2
        _settle(remote)  # type: ignore[arg-type]
        assert not remote._book.uses, dict(remote._book.uses)  # type: ignore[union-attr]


def test_a_hash_that_cannot_start_or_fetch_gives_back_its_windows(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sha256 (a signed record's file digests) whose first window cannot be handed to a thread,
    or whose fetch fails: no use of its windows is left in the spool's books."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/hashed/sha.ckpt"
    ckptfmt.save({"w": torch.randn(1 << 16)}, url, storage_options=options)
    remote = RemoteObject(url, options, fetch_index=False)
    try:
        pool, remote._pool = remote._pool, _Refusing()  # type: ignore[assignment]
        try:
            with pytest.raises(RuntimeError):
                remote.sha256()
        finally:
            remote._pool = pool
        assert not remote._book.uses, dict(remote._book.uses)

        def failing(self: RemoteObject, *args: Any, **kwargs: Any) -> None:
            raise ckptfmt.StorageError("the fetch failed", path=url)

        monkeypatch.setattr(RemoteObject, "_get_range", failing)
        with pytest.raises(ckptfmt.StorageError):
            remote.sha256()
        assert not remote._book.uses, dict(remote._book.uses)
    finally:
        remote.close()


def _held_in_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """(held, release): a get's chunk reads set `held` and wait (60 s at most) for `release`
    before they fetch or read anything."""
    from ckptfmt.engine.chunkread import ChunkReader

    held, release = threading.Event(), threading.Event()
    read_into = ChunkReader.read_into

    def held_up(self: ChunkReader, *args: Any, **kwargs: Any) -> None:
        held.set()
        release.wait(60)
        read_into(self, *args, **kwargs)

    monkeypatch.setattr(ChunkReader, "read_into", held_up)
    return held, release


def _place(kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if kind == "local":
        return str(tmp_path / "closing.ckpt"), {}
    bucket, options = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/closing.ckpt", options


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_close_while_a_get_runs_lets_it_finish(
    kind: str, tmp_path: Any, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() on one thread while a get runs on another: the get finishes bit for bit (its
    descriptors were closed under it: EBADF), close waits for it, and a get begun after close
    raises a CheckpointError saying the reader is closed."""
    url, options = _place(kind, tmp_path, request)
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(MiB, generator=g), "b": torch.randn(1000, generator=g)}
    ckptfmt.save(state, url, storage_options=options)
    r = ckptfmt.open(url, storage_options=options)
    held, release = _held_in_reads(monkeypatch)
    with ThreadPoolExecutor(2) as pool:
        try:
            got = pool.submit(r.get, "a")
            assert held.wait(30)
            closing = pool.submit(r.close)
            time.sleep(0.3)
            assert not closing.done()  # it waits for the get
            with pytest.raises(ckptfmt.CheckpointError, match="the reader is closed"):
                r.get("b")
        finally:
            release.set()
        assert torch.equal(got.result(timeout=60), state["a"])
        closing.result(timeout=60)
    assert r._file.chunk_reader.fd == -1


def test_close_returns_after_its_wait_and_the_last_get_closes(
    tmp_path: Any, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get that runs longer than close waits (CLOSE_WAIT): close returns, the get finishes
    bit for bit, and the file is closed as it ends."""
    from ckptfmt.files import load

    monkeypatch.setattr(load, "CLOSE_WAIT", 0.2)
    url, _ = _place("local", tmp_path, request)
    state = {"a": torch.randn(MiB, generator=torch.Generator().manual_seed(4))}
    ckptfmt.save(state, url)
    r = ckptfmt.open(url)
    held, release = _held_in_reads(monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        try:
            got = pool.submit(r.get, "a")
            assert held.wait(30)
            r.close()  # returns after CLOSE_WAIT, the get still running
            assert not got.done() and r._file.chunk_reader.fd >= 0
        finally:
            release.set()
        assert torch.equal(got.result(timeout=60), state["a"])
    assert r._file.chunk_reader.fd == -1


@pytest.mark.parametrize("gap", [None, 0])
def test_a_read_asking_again_for_a_request_never_sent_takes_only_its_own_bytes(
    s3_bucket: Any, gap: int | None
) -> None:
    """A read waits for another read's request (1 MiB) that the other's hand-over failed to
    send: it asks again for the bytes it needs there (two 4 KiB ranges), by the grid and gap
    it asked by, never the other's whole request nor, asked with no gap, the bytes between
    its ranges; once it gives them back, the spool holds nothing that no read uses."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/refused-own.ckpt"
    ckptfmt.save({"w": torch.randn(MiB)}, url, storage_options=options)
    remote = RemoteObject(url, options, fetch_index=False)
    pool = remote._pool
    refused = threading.get_ident()
    waiting = threading.Event()
    needs = [(0, 4096), (32768, 36864)]
    waited: list[BaseException | None] = []

    def other_read() -> None:
        futures = remote.start(needs, gap=gap, uses=needs)  # finds the request in flight
        waiting.set()
        try:
            remote.wait(futures)
            waited.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            waited.append(e)
        remote.release(needs, wait=True)

    class RefusingOneThread:
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != refused:
                return pool.submit(fn, *args, **kwargs)
            threading.Thread(target=other_read).start()
            assert waiting.wait(30)
            raise RuntimeError("can't start new thread")

        def shutdown(self, *args: Any, **kwargs: Any) -> None:
            pool.shutdown(*args, **kwargs)

    try:
        remote._pool = RefusingOneThread()  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="can't start new thread"):
            remote.fetch([(0, MiB)])
        deadline = time.monotonic() + 30
        while not waited and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waited == [None]
        _settle(remote)
        with remote._held_lock:
            held, idle = list(remote._book.held), remote._book.idle()
        # with the default gap the two ranges are one request (their gap held); with none, not
        assert idle <= (36864 if gap is None else 0), held
    finally:
        remote._pool = pool
        remote.close()


def test_a_request_never_sent_that_was_to_fill_a_reads_memory_fails_that_read(
    s3_bucket: Any,
) -> None:
    """A request that was to bring bytes straight into a read's memory (a claimed read-ahead
    request, start_into's) and was never sent fails the read that waits for it with a
    StorageError naming the bytes: asking for its spool's part again would leave that memory
    unfilled."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/unsent-into.ckpt"
    ckptfmt.save({"w": torch.randn(MiB // 4)}, url, storage_options=options)
    remote = RemoteObject(url, options, fetch_index=False)
    try:
        with remote._held_lock:
            (q,) = remote._made(remote._book.make([(0, 8192)], [(4096, 8192)]))
        q.future.cancel()
        with pytest.raises(ckptfmt.StorageError, match="bytes 4096-8191: .* never sent"):
            remote.wait([q.future], needs=(), into=[(4096, 8192)])
        assert not remote._book.requests
    finally:
        remote.close()

"""Several threads reading one object through one open Reader at once: each get returns its
tensors bit for bit (with verify=False as well: a page given back under another read came
back as zeros, unchecked), a range two reads need is fetched once and freed once both are
done with it, no read's use of the spool outlives it, and under max_bytes each call keeps
within its bound."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import assert_same, use_backend

import ckptfmt
from ckptfmt.storage.download import RemoteObject

MiB = 1 << 20
THREADS = 6
ROUNDS = 4


def _state() -> dict[str, torch.Tensor]:
    """Tensors of every way a chunk is read, interleaved in the object: small ones (through the
    spool, a request of theirs spanning a neighbour's bytes), ones of a few chunks (straight
    into their tensors), and one whose last chunk is short (a chunk of each way)."""
    g = torch.Generator().manual_seed(11)
    sizes = [3000, 300_000, 5000, 70_000, 1000, 300_000, 16384, 70_000]
    return {f"t{i:02d}": torch.randn(n, generator=g) for i, n in enumerate(sizes * 2)}


def _remote(r: ckptfmt.Reader) -> RemoteObject:
    remote = r._file.chunk_reader.remote
    assert isinstance(remote, RemoteObject)
    return remote


def _freed_down_to(remote: RemoteObject, opened: int) -> None:
    """The spool's pages come down to what it held once opened (the index's tail) once the
    pages given back are freed, on a thread of their own (within a deadline)."""
    deadline = time.monotonic() + 30
    while remote.occupied() > opened:
        assert time.monotonic() < deadline, f"{remote.occupied()} bytes held, {opened} once opened"
        time.sleep(0.01)


def _rounds(r: ckptfmt.Reader, state: dict[str, torch.Tensor], max_bytes: int | None = None) -> None:
    """ROUNDS rounds of THREADS threads getting keys at once through `r`: overlapping rounds
    (every thread every key, each in an order of its own) and disjoint ones (each thread its
    share), verify=True and False in turn; each round's threads start together."""
    keys = list(state)
    for n in range(ROUNDS):
        verify = n % 2 == 0
        rng = random.Random(n)
        if n < ROUNDS // 2:
            plans = [rng.sample(keys, len(keys)) for _ in range(THREADS)]
        else:
            plans = [keys[t::THREADS] for t in range(THREADS)]
        gate = threading.Barrier(THREADS)

        def read(plan: list[str], verify: bool = verify, gate: threading.Barrier = gate) -> list[object]:
            gate.wait(30)
            return [r.get(k, verify=verify) for k in plan]

        with ThreadPoolExecutor(THREADS) as pool:
            results = list(pool.map(read, plans, timeout=300))
        for plan, got in zip(plans, results):
            for k, t in zip(plan, got):
                assert_same(t, state[k])


@pytest.mark.parametrize("compression", [None, "zstd"])  # straight into tensors; all through the spool
def test_gets_of_one_object_on_several_threads_at_once_are_bit_exact(store, compression):
    root, options = store
    options = options | {"request_size": MiB}
    state = _state()
    url = f"{root}/threads/{compression}.ckpt"
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10, compression=compression)
    with ckptfmt.open(url, storage_options=options) as r:
        remote = _remote(r)
        opened = remote.occupied()
        _rounds(r, state)
        # every read gave back what it used: the spool holds no more than the index's tail
        assert not remote._book.uses and not remote._book.requests
        _freed_down_to(remote, opened)


def test_gets_at_once_on_the_python_path_are_bit_exact(s3_bucket, monkeypatch):
    """Without the C engine each compressed chunk is read into a scratch buffer and decoded
    from there: one per thread (threads sharing one decoded each other's bytes)."""
    bucket, options = s3_bucket
    options = options | {"request_size": MiB}
    state = _state()
    url = f"s3://{bucket}/threads-python.ckpt"
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10, compression="zstd")
    use_backend(monkeypatch, "python")
    with ckptfmt.open(url, storage_options=options) as r:
        _rounds(r, state)


def test_gets_at_once_under_max_bytes_each_keep_within_it(s3_bucket):
    """Each call's windows are sized to what its max_bytes leaves beside what the spool holds
    when it begins: calls at once take that much each, no more (the object's peak within their
    sum), every use is given back, and a call after them is not refused for room they kept."""
    from ckptfmt.engine import native
    from ckptfmt.engine.chunkread import decode_memory
    from ckptfmt.files.reader import CheckpointFile

    bucket, options = s3_bucket
    options = options | {"request_size": MiB}
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(MiB // 2, generator=g) for i in range(THREADS)}  # 2 MiB each
    url = f"s3://{bucket}/bounded-threads.ckpt"
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10, compression="zstd")
    with CheckpointFile(url, storage_options=options) as f:
        index, decode = f.index_memory, decode_memory(f.chunks, native.available())
    room = 2 * MiB
    with ckptfmt.open(url, max_bytes=index + 2 * MiB + decode + room, storage_options=options) as r:
        remote = _remote(r)
        opened = remote.occupied()
        _rounds(r, state)
        assert 0 < remote.peak_bytes <= opened + THREADS * room
        assert not remote._book.uses
        _freed_down_to(remote, opened)
        assert_same(r.get("t0"), state["t0"])


def test_a_range_two_gets_need_at_once_is_fetched_once_and_freed_after_both(store_faults):
    """Two threads get the same entry at once while its first request is held unanswered: the
    second waits for the first's requests, no byte is asked for twice, and the bytes are
    given back (their pages freed) once both are done, not while the second still reads."""
    faults = store_faults
    options = faults.options | {"request_size": MiB}
    url = f"{faults.new_root()}/shared.ckpt"
    w = torch.randn(MiB, generator=torch.Generator().manual_seed(2))  # 4 MiB, through the spool
    ckptfmt.save({"w": w, "step": 1}, url, storage_options=options, chunk_size=256 << 10, compression="zstd")
    with ckptfmt.open(url, storage_options=options) as r:
        remote = _remote(r)
        opened = remote.occupied()
        faults.clear_counts()
        released = faults.hold(*faults.op("read", "shared.ckpt"))
        got: list[torch.Tensor] = []
        threads = [threading.Thread(target=lambda: got.append(r.get("w"))) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while not remote._book.uses or max(remote._book.uses.values()) < 2:  # both planned
                assert time.monotonic() < deadline, "the second get never asked for its chunks"
                time.sleep(0.01)
        finally:
            released.set()
            for t in threads:
                t.join(60)
        assert len(got) == 2 and all(torch.equal(t, w) for t in got)
        asked = sorted(faults.ranges("shared.ckpt"))
        assert all(a[1] <= b[0] for a, b in zip(asked, asked[1:])), asked  # every byte once
        assert not remote._book.uses
        _freed_down_to(remote, opened)


def test_a_range_two_reads_use_stays_in_the_spool_until_both_give_it_back(store_faults):
    """Two reads of one object use the same range: it is fetched once, the first's giving back
    leaves its bytes in the spool for the second (they were freed under it: zeros, a false
    CorruptError or, unverified, wrong tensors), and the second's frees its pages."""
    faults = store_faults
    url = f"{faults.new_root()}/used.ckpt"
    ckptfmt.save({"w": torch.randn(MiB // 4)}, url, storage_options=faults.options)
    expected = faults.get_raw(url)
    remote = RemoteObject(url, faults.options, fetch_index=False)
    try:
        assert remote.spool is not None
        used = (8192, 8192 + 300_000)
        faults.clear_counts()
        for _ in range(2):  # two reads, each using the range until it gives it back
            remote.wait(remote.start((), uses=[used]))
        assert faults.ranges("used.ckpt") == [used]  # asked for once
        remote.release([used], wait=True)
        assert bytes(remote.spool.view(*used)) == expected[used[0] : used[1]]
        assert remote.occupied() > 0
        remote.release([used], wait=True)
        assert remote.occupied() == 0 and os.fstat(remote.spool.fd).st_blocks == 0
    finally:
        remote.close()


def test_a_request_no_thread_took_is_asked_for_again_by_a_read_waiting_for_it(s3_bucket):
    """A read's requests are registered in flight, then handed to the pool; where the pool
    refuses one (no thread could start), that read fails with that error, and a read waiting
    for that request meanwhile (a get on another thread) asks for the bytes itself and gets
    them: the failure was the other read's, not its own."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/refused.ckpt"
    ckptfmt.save({"w": torch.randn(MiB // 4)}, url, storage_options=options)
    remote = RemoteObject(url, options, fetch_index=False)
    pool = remote._pool
    refused = threading.get_ident()
    waiting = threading.Event()
    waited: list[BaseException | None] = []

    def other_read() -> None:
        futures = remote.start([(0, 4096)])  # finds this thread's request in flight
        waiting.set()
        waited.append(_failure(remote, futures))

    class RefusingOneThread:
        """The pool, refusing this thread's submit once another read waits for its request."""

        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            if threading.get_ident() != refused:
                return pool.submit(fn, *args, **kwargs)
            threading.Thread(target=other_read).start()
            assert waiting.wait(30)
            raise RuntimeError("can't start new thread")

        def shutdown(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            pool.shutdown(*args, **kwargs)

    try:
        remote._pool = RefusingOneThread()  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="can't start new thread"):
            remote.fetch([(0, 4096)])
        deadline = time.monotonic() + 30
        while not waited and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waited == [None]
        assert not remote._book.requests
        assert remote.spool is not None
        other = RemoteObject(url, options, fetch_index=False)
        try:
            other.fetch([(0, 4096)])
            assert other.spool is not None
            assert bytes(remote.spool.view(0, 4096)) == bytes(other.spool.view(0, 4096))
        finally:
            other.close()
    finally:
        remote._pool = pool
        remote.close()


def _failure(remote: RemoteObject, futures: list) -> BaseException | None:
    try:
        remote.wait(futures)
    except BaseException as e:
        return e
    return None


def test_gets_at_once_of_a_file_whose_chunks_lie_in_many_others(tmp_path, monkeypatch):
    """An incremental file's chunks lie in eight earlier files, and the reader keeps two open:
    gets on several threads at once open and let go of them all the while; one let go of is
    closed only once no read is in progress (closed under another thread's read, its
    descriptor failed that read, or, reused, read another file's bytes)."""
    from ckptfmt.files import incremental, reader

    n = 8
    paths = []
    for i in range(n):
        (tmp_path / f"step-{i}").mkdir()
        paths.append(str(tmp_path / f"step-{i}" / "state.ckpt"))
    g = torch.Generator().manual_seed(9)
    state = {f"t{i}": torch.randn(70_000, generator=g) for i in range(n)}
    incremental.save(state, paths[0], chunk_size=64 << 10)
    for i in range(1, n):
        state[f"t{i}"].add_(100)
        incremental.save(state, paths[i], base=paths[i - 1])
    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 2)
    fds = len(os.listdir("/proc/self/fd"))
    with ckptfmt.open(paths[-1]) as r:
        _rounds(r, state)
    assert len(os.listdir("/proc/self/fd")) == fds

"""Several threads reading one object through one open Reader at once: each get returns its
tensors bit for bit (with verify=False as well: a page given back under another read came
back as zeros, unchecked), a range two reads need is fetched once and freed once both are
done with it, no read's use of the spool outlives it, and under max_bytes each call keeps
within its bound."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import assert_same

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
        assert remote.occupied() <= opened


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
        assert not remote._book.uses and remote.occupied() <= opened
        assert_same(r.get("t0"), state["t0"])

"""Failures around the referenced files a reader of an incremental checkpoint opens, holds and
lets go of while several gets run: a referencing file's directory gone, a referenced file whose
closing fails or takes long, an opening that takes long, a close under a read, a fork."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import ckptfmt
from ckptfmt.engine import chunkread, forkreset
from ckptfmt.engine.chunkread import ChunkReader
from ckptfmt.files import incremental


def _chain(folder: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """Three chained local incremental files in `folder`: the last one's path and its state,
    whose "a" lies in the first file, "b" in the second and "c" in the last."""
    g = torch.Generator().manual_seed(5)
    state = {k: torch.randn(50_000, generator=g) for k in "abc"}
    folder.mkdir(exist_ok=True)
    base = None
    for i, changed in enumerate(["", "b", "c"]):
        if changed:
            state = dict(state, **{changed: state[changed] + 1})
        path = str(folder / f"f{i}.ckpt")
        incremental.save(state, path, base=base, min_reference_bytes=1024)
        base = path
    assert base is not None
    return base, state


def test_a_referencing_files_directory_gone_fails_every_get_at_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory a local incremental file lies in renamed after it was opened: its
    references cannot be resolved, and every get of a key that lies in one fails at once with
    IncompleteError saying so, never a bare FileNotFoundError, never a wait for an opening
    that ended (OPEN_WAIT) and then another read's StorageError."""
    monkeypatch.setattr(chunkread, "OPEN_WAIT", 20.0)
    path, _ = _chain(tmp_path / "ck")
    with ckptfmt.open(path) as r:
        os.rename(tmp_path / "ck", tmp_path / "moved")
        for _ in range(2):
            began = time.monotonic()
            with pytest.raises(ckptfmt.IncompleteError, match=r"referenced file .* is missing"):
                r.get("a")
            assert time.monotonic() - began < 10
        assert not r._file.chunk_reader._opening


def _let_go_of(monkeypatch: pytest.MonkeyPatch, then: Any) -> list[int]:
    """ChunkReader._release calls `then()` after closing, on the first call only; the
    descriptors it was called with."""
    released: list[int] = []
    release = ChunkReader._release

    def failing(self: ChunkReader, fd: int) -> None:
        release(self, fd)
        released.append(fd)
        if len(released) == 1:
            then()

    monkeypatch.setattr(ChunkReader, "_release", failing)
    return released


def test_a_referenced_files_closing_that_fails_leaves_the_get_its_result(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A get that opens a referenced file lets go of another (max_open): that closing failing
    is logged, the get returns its tensor bit for bit, and no read holds a file afterwards."""
    from ckptfmt.files import reader

    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 1)
    path, state = _chain(tmp_path / "ck")

    def fails() -> None:
        raise OSError(5, "Input/output error")

    released = _let_go_of(monkeypatch, fails)
    with ckptfmt.open(path) as r:
        assert torch.equal(r.get("a"), state["a"])  # the first file opened
        with caplog.at_level(logging.WARNING, logger="ckptfmt"):
            assert torch.equal(r.get("b"), state["b"])  # the second: the first let go of
        assert released
        assert "closing a referenced file" in caplog.text
        chunks = r._file.chunk_reader
        assert not +chunks._pins and len(chunks._ext_open) == 1
        assert torch.equal(r.get("a"), state["a"])


def test_a_referenced_files_closing_holds_up_no_other_get(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A referenced file let go of while it takes long to close (an object's threads ending)
    holds up no get of a file that is open: the closing is done outside the readers' lock."""
    from ckptfmt.files import reader

    monkeypatch.setattr(reader, "MAX_OPEN_EXTERNALS", 1)
    path, state = _chain(tmp_path / "ck")
    closing, done = threading.Event(), threading.Event()

    def slow() -> None:
        closing.set()
        done.wait(60)

    _let_go_of(monkeypatch, slow)
    with ckptfmt.open(path) as r, ThreadPoolExecutor(2) as pool:
        assert torch.equal(r.get("a"), state["a"])
        try:
            first = pool.submit(r.get, "b")  # opens the second file, lets go of the first
            assert closing.wait(30)
            assert torch.equal(pool.submit(r.get, "b").result(timeout=30), state["b"])
            assert not first.done()
        finally:
            done.set()
        assert torch.equal(first.result(timeout=60), state["b"])


def test_a_close_under_a_read_leaves_no_count_below_none(tmp_path: Any) -> None:
    """close() while a read holds a referenced file (a forked child's, whose parent's reads never
    end there) clears the holds; the read ending afterwards leaves its file held by none, not
    by -1 (which would keep it from ever being let go of)."""
    path, _ = _chain(tmp_path / "ck")
    r = ckptfmt.open(path)
    chunks = r._file.chunk_reader
    k = next(k for k, ch in enumerate(chunks.chunks) if ch.source >= 0)
    with chunks._holding(chunks.chunks[k].source, k):
        r.close()
    assert all(n >= 0 for n in chunks._pins.values()), dict(chunks._pins)


def test_a_get_waits_for_an_opening_as_long_as_the_stores_deadline_lets_it_run(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get that needs a referenced object another get is opening waits as long as that
    opening's requests may take (the storage option deadline, raised here), not a fixed time:
    an opening slower than OPEN_WAIT and within its deadline fails no get."""
    from ckptfmt.storage.references import ObjectReferences

    monkeypatch.setattr(chunkread, "OPEN_WAIT", 0.5)
    bucket, options = s3_bucket
    options = dict(options, deadline=30)
    g = torch.Generator().manual_seed(6)
    state = {"a": torch.randn(50_000, generator=g), "b": torch.randn(50_000, generator=g)}
    base, url = f"s3://{bucket}/slow/base.ckpt", f"s3://{bucket}/slow/inc.ckpt"
    incremental.save(state, base, min_reference_bytes=1024, storage_options=options)
    state = dict(state, b=state["b"] + 1)
    incremental.save(state, url, base=base, min_reference_bytes=1024, storage_options=options)
    opening, go_on = threading.Event(), threading.Event()
    open_ref = ObjectReferences.open_ref

    def slow(self: ObjectReferences, rel: str) -> int:
        opening.set()
        go_on.wait(60)
        return open_ref(self, rel)

    monkeypatch.setattr(ObjectReferences, "open_ref", slow)
    with ckptfmt.open(url, storage_options=options) as r, ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(r.get, "a")
            assert opening.wait(30)
            second = pool.submit(r.get, "a")
            time.sleep(2)  # four times OPEN_WAIT: the second waits on
            assert not second.done()
        finally:
            go_on.set()
        assert torch.equal(first.result(timeout=60), state["a"])
        assert torch.equal(second.result(timeout=60), state["a"])


class _Failing:
    def _forget_in_child(self) -> None:
        raise RuntimeError("cannot")


class _Forgets:
    forgot = False

    def _forget_in_child(self) -> None:
        self.forgot = True


def test_one_object_failing_after_a_fork_leaves_the_others_made_anew() -> None:
    """In a forked child, an object whose state cannot be made anew does not keep the others
    registered from having theirs made anew."""
    # many of each: whichever order the registry holds them in, some failing come before others
    objects = [cls() for _ in range(16) for cls in (_Failing, _Forgets)]
    for obj in objects:
        forkreset.register(obj)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if all(o.forgot for o in objects if isinstance(o, _Forgets)) else 2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        for obj in objects:
            forkreset.unregister(obj)


def test_a_closing_that_fails_after_the_last_get_leaves_it_its_result(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """close() returned while a get ran on (CLOSE_WAIT); the get, the last, closes the file as
    it ends: that closing failing is logged, the get returns its tensor."""
    from ckptfmt.files import load

    monkeypatch.setattr(load, "CLOSE_WAIT", 0.2)
    path = str(tmp_path / "r.ckpt")
    state = {"a": torch.randn(1 << 16, generator=torch.Generator().manual_seed(7))}
    ckptfmt.save(state, path)
    r = ckptfmt.open(path)
    held, release = threading.Event(), threading.Event()
    read_into = ChunkReader.read_into

    def held_up(self: ChunkReader, *args: Any, **kwargs: Any) -> None:
        held.set()
        release.wait(60)
        read_into(self, *args, **kwargs)

    monkeypatch.setattr(ChunkReader, "read_into", held_up)
    close_file = r._gets._close_file

    def fails() -> None:
        close_file()
        raise OSError(5, "Input/output error")

    r._gets._close_file = fails
    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.WARNING, logger="ckptfmt"):
        try:
            got = pool.submit(r.get, "a")
            assert held.wait(30)
            r.close()
        finally:
            release.set()
        assert torch.equal(got.result(timeout=60), state["a"])
    assert "after its last get failed" in caplog.text
    assert r._file.chunk_reader.fd == -1

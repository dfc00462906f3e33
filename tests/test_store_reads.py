"""How a load reads an object's bytes off the wire, on every store ckptfmt serves: answers'
bodies go straight from the socket's reader into the spool (one copy) where nothing stands
between (client.Body), through urllib3 where something does (an encoding, chunks), and the
pages of ranges given back are freed off the reader's thread, never over bytes fetched
again meanwhile."""

from __future__ import annotations

import gzip
import http.server as http_server
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
import urllib3
from helpers import assert_same
from s3_server import s3_client

import ckptfmt
from ckptfmt.engine import native
from ckptfmt.errors import StorageError
from ckptfmt.storage import client, download, pools, spool
from ckptfmt.storage import http as store_http
from ckptfmt.storage.bodies import read_body
from ckptfmt.storage.download import RemoteObject

MiB = 1 << 20


def test_a_load_reads_bodies_straight_into_the_spool(store, monkeypatch):
    """urllib3's readinto reads into a fresh bytes object and copies it: a load's chunk
    data must not come that way (it bounded loads on fast stores)."""
    root, options = store
    state = {"w": torch.randn(3 * MiB, generator=torch.Generator().manual_seed(3)), "step": 1}
    url = f"{root}/direct/model.ckpt"
    ckptfmt.save(state, url, storage_options=options)
    through_urllib3 = [0]
    read = urllib3.response.HTTPResponse.read

    def counted(self, *args, **kwargs):
        data = read(self, *args, **kwargs)
        through_urllib3[0] += len(data)
        return data

    monkeypatch.setattr(urllib3.response.HTTPResponse, "read", counted)
    assert_same(state, ckptfmt.load(url, storage_options=options))
    assert through_urllib3[0] < MiB  # metadata answers only, of a 12 MiB object


class _Answers(http_server.BaseHTTPRequestHandler):
    """/gzip: a gzip-encoded answer with a length (read raw); /chunked: a chunked one."""

    payload = os.urandom(300_000)

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/gzip":
            body = gzip.compress(self.payload, mtime=0)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for at in range(0, len(self.payload), 70_000):
            piece = self.payload[at : at + 70_000]
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answers() -> Iterator[str]:
    server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path", ["/gzip", "/chunked"])
def test_a_chunked_or_encoded_body_is_read_through_urllib3(answers, path):
    """A chunked body's bytes on the wire are not the object's: it is read through urllib3,
    which takes the chunks apart; an encoded one comes as it was sent, as it always did (the
    stores are asked for none, and a body whose length is not the range's is refused)."""
    session = store_http.new_session({}, "gs")
    session.headers.pop("Accept-Encoding")
    answer = session.get(answers + path, stream=True, timeout=(10, 10))
    payload = _Answers.payload if path == "/chunked" else gzip.compress(_Answers.payload, mtime=0)
    buf = bytearray(len(payload))
    got, cut = read_body(client.Body(answer, answer.raw), memoryview(buf), 30.0)
    assert (got, cut) == (len(payload), False)
    assert buf == payload


def test_a_range_given_back_and_fetched_again_holds_its_bytes(store):
    """Ranges given back are freed on another thread; a fetch of the same bytes waits for
    that, so the freeing never wipes what it brought (and the pages are given back)."""
    root, options = store
    state = {"w": torch.arange(4 * MiB, dtype=torch.int32)}
    url = f"{root}/again/model.ckpt"
    ckptfmt.save(state, url, storage_options=options)
    remote = RemoteObject(url, options, fetch_index=False)
    try:
        assert remote.spool is not None
        remote.fetch([(0, 12 * MiB)])
        first = bytes(remote.spool.view(4096, 12 * MiB))
        assert os.fstat(remote.fd).st_blocks * 512 >= 12 * MiB
        for _ in range(5):
            remote.release([(0, 12 * MiB)])
            remote.fetch([(0, 12 * MiB)])
            assert bytes(remote.spool.view(4096, 12 * MiB)) == first
        remote.release([(0, 12 * MiB)])
        remote.fetch([(0, 4096)])  # waits until the range's pages are freed
        assert os.fstat(remote.fd).st_blocks * 512 < MiB
    finally:
        remote.close()


def test_a_release_that_close_overtakes_frees_through_the_mapping(monkeypatch):
    """close() on the caller's thread between a queued release's check of the mapping and its
    fallback to mmap's madvise: the release still frees the pages through the mapping it saw
    (which close leaves to the freeing executor), never a missing one."""
    pages = spool.Spool("overtaken", 4 * spool.PAGE)
    mapping = pages._map
    assert mapping is not None
    mapping[:] = b"x" * (4 * spool.PAGE)
    with ThreadPoolExecutor(1) as freer:
        gate = threading.Event()
        freer.submit(gate.wait, 30)  # the mapping is closed on it only after this

        def closed_meanwhile(address: int, length: int, advice: int) -> int:
            pages.close(free_on=freer)
            return -1  # libc's call failed: mmap's madvise is the fallback

        monkeypatch.setattr(spool, "_madvise", closed_meanwhile)
        pages.release(0, 4 * spool.PAGE)
        assert mapping[:] == bytes(4 * spool.PAGE)  # punched out: reads see zeros
        gate.set()


def test_a_fetch_waits_for_pages_being_freed_within_its_deadline(s3_bucket):
    """A fetch over pages still being freed waits for that (test above), and no longer than
    the operation's deadline: then a StorageError naming the URL."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/freeing/model.ckpt"
    ckptfmt.save({"w": torch.zeros(MiB)}, url, storage_options=options)
    remote = RemoteObject(url, options | {"deadline": 1}, fetch_index=False)
    stuck = threading.Event()
    try:
        assert remote.spool is not None
        remote.fetch([(0, MiB)])
        remote.spool.release = lambda lo, hi: stuck.wait(20)  # type: ignore[method-assign]
        remote.release([(0, MiB)])
        started = time.monotonic()
        with pytest.raises(StorageError, match="not freed within 1 s .*deadline") as e:
            remote.fetch([(0, MiB)])
        assert time.monotonic() - started < 15 and e.value.path == url
        # a reader within max_bytes waits for its window's pages to be freed: as long, no longer
        remote.fetch([(MiB, MiB + 4096)])
        started = time.monotonic()
        with pytest.raises(StorageError, match="give back bytes .* not freed within 1 s .*deadline") as e:
            remote.release([(MiB, MiB + 4096)], wait=True)
        assert time.monotonic() - started < 15 and e.value.path == url
    finally:
        stuck.set()
        remote.close()


def test_a_whole_load_asks_for_every_cell_before_the_first_comes(store_faults, monkeypatch):
    """A load's requests go out in one wave, as a plain parallel download's do: the cells are
    asked for with the tail, not once the index (which needs the prologue and the tail) is
    parsed; each byte is asked for once, by no more requests than a plain download's and the
    tail's; and the cells' bodies, read once the tensors exist, go straight into them: the
    spool holds the tail (with the index) and the chunk the tail cuts, no more (it held the
    whole object, whose chunks were then copied out of it)."""
    faults = store_faults
    options = faults.options | {"request_size": MiB}
    url = f"{faults.new_root()}/wave.ckpt"
    g = torch.Generator().manual_seed(4)
    state = {f"t{i}": torch.randn(400_000, generator=g) for i in range(4)}  # 6.4 MB: 7 cells
    ckptfmt.save(state, url, storage_options=options)
    size = faults.size(url)
    cells = -(-size // MiB)
    reads = faults.op("read", "wave.ckpt")
    faults.clear_counts()
    peaks = _peaks(monkeypatch)
    released = faults.hold(*reads)  # the first GET of the object waits, unanswered
    out: dict[str, object] = {}
    loading = threading.Thread(target=lambda: out.update(state=ckptfmt.load(url, storage_options=options)))
    loading.start()
    try:
        deadline = time.monotonic() + 30
        while faults.count(*reads) < cells and time.monotonic() < deadline:
            time.sleep(0.01)
        asked_while_held = faults.count(*reads)
    finally:
        released.set()
        loading.join(60)
    assert_same(state, out["state"])
    ranges = sorted(faults.ranges("wave.ckpt"))
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # every byte once
    assert cells <= asked_while_held == len(ranges) <= cells + 1
    assert all(lo // MiB == (hi - 1) // MiB for lo, hi in ranges[:-1])  # the grid's cells
    assert ranges[-1][1] - ranges[-1][0] <= download.TAIL_BYTES  # and the tail, in one request
    # the tail and the chunk it cuts (without the C engine every chunk goes through the spool)
    spooled = download.TAIL_BYTES + state["t3"].nbytes if native.available() else size
    assert 0 < peaks[url] <= spooled + 3 * 4096


def _save_ends_state(url: str, options: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(400_000, generator=g) for i in range(4)}  # 6.4 MB: 7 cells
    ckptfmt.save(state, url, storage_options=options)
    return state


def _probe_gets(url: str, options: dict, monkeypatch, refuse=lambda r: False, hold=lambda r: None):
    """The store's `get` for `url` wrapped: each range asked for noted in a log as
    ("ask", range), a range `refuse` says so raising ConnectionRefusedError (noted
    ("refused", range)), `hold(range)` called first (it may block); the ends' ranges."""
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.urls import parse_url

    size = download.head(parse_url(url), options)[0]
    shared = store_for(parse_url(url), options)
    log: list[tuple[str, tuple[int, int] | None]] = []
    get = shared.get

    def probing(u, byte_range, version):  # the real request, its range noted as it is made
        log.append(("ask", byte_range))
        hold(byte_range)
        if refuse(byte_range):
            log.append(("refused", byte_range))
            raise ConnectionRefusedError(111, "refused by the test")
        return get(u, byte_range, version)

    monkeypatch.setattr(shared, "get", probing)
    return log, (0, MiB), (size - download.TAIL_BYTES, size), shared


def test_a_whole_load_asks_for_the_ends_the_index_waits_for_first(store, monkeypatch):
    """The tail (footer and index) and the first cell (prologue), which the index waits for,
    are asked for before the wave's other cells, which go once both ends' requests are
    written (told by http.telling_sent, before the tail's answer's head is even read): sent
    all at once, the ends were answered after most of the cells (the stores serve requests in
    the order they come or share their work among them), and every cell's body waited unread
    for them (bench/store_timeline.py)."""
    prefix, options = store
    options = options | {"request_size": MiB}
    url = f"{prefix}/ends.ckpt"
    state = _save_ends_state(url, options)
    told: set[int] = set()  # the threads whose request http.telling_sent's hook was told of
    telling_sent = store_http.telling_sent

    def spying(hook):
        def noted() -> None:
            told.add(threading.get_ident())
            hook()

        return telling_sent(noted)

    monkeypatch.setattr(store_http, "telling_sent", spying)
    told_before_head: list[bool] = []
    log, first, tail, shared = _probe_gets(url, options, monkeypatch)
    probing = shared.get

    def tail_told(u, byte_range, version):  # the tail's answer: its hook fired before it came
        reply = probing(u, byte_range, version)
        if byte_range == tail:
            told_before_head.append(threading.get_ident() in told)
        return reply

    monkeypatch.setattr(shared, "get", tail_told)
    for _ in range(3):
        log.clear()
        told_before_head.clear()
        assert_same(state, ckptfmt.load(url, storage_options=options))
        asked = [r for _, r in log]
        assert set(asked[:2]) == {first, tail} and len(set(asked)) == len(asked) > 2, asked
        assert told_before_head == [True]


def test_a_tail_tried_again_holds_no_cell_of_the_wave_back(s3_bucket, monkeypatch):
    """The tail's request refused four times (then answered): the wave's other cells go once
    its first attempt failed, not after its retries and their backoff (0.75 s at least)."""
    bucket, options = s3_bucket
    options = options | {"request_size": MiB, "max_attempts": 5}
    url = f"s3://{bucket}/tail-again.ckpt"
    state = _save_ends_state(url, options)
    refusals = [0]

    def four_times(r) -> bool:
        if r != tail:
            return False
        refusals[0] += 1
        return refusals[0] <= 4

    log, first, tail, _ = _probe_gets(url, options, monkeypatch, refuse=four_times)
    assert_same(state, ckptfmt.load(url, storage_options=options))
    last_tail = max(i for i, (what, r) in enumerate(log) if what == "ask" and r == tail)
    cells = [i for i, (what, r) in enumerate(log) if what == "ask" and r not in (first, tail)]
    assert len(cells) > 2 and max(cells) < last_tail, log


def test_no_cell_of_the_wave_is_asked_for_once_the_tail_failed_for_good(s3_bucket, monkeypatch):
    """The tail's request refused every time: the load fails (StorageError naming its bytes),
    and no cell of the wave is asked for after its last attempt (the load is lost then)."""
    bucket, options = s3_bucket
    options = options | {"request_size": MiB, "max_attempts": 5}  # 0.75 s of backoff at least
    url = f"s3://{bucket}/tail-never.ckpt"
    _save_ends_state(url, options)
    log, first, tail, _ = _probe_gets(url, options, monkeypatch, refuse=lambda r: r == tail)
    with pytest.raises(StorageError, match=f"read bytes {tail[0]}-{tail[1] - 1}"):
        ckptfmt.load(url, storage_options=options)
    last_refusal = max(i for i, (what, r) in enumerate(log) if what == "refused")
    assert not [r for what, r in log[last_refusal:] if r not in (first, tail)], log


class _Interrupted(BaseException):
    """What the test's signal handler raises in the main thread (as Ctrl-C would)."""


def test_a_load_interrupted_while_the_tail_is_held_sends_no_more_cells(s3_bucket, monkeypatch):
    """A load interrupted (a signal) while the tail's request is held up and the wave's other
    cells wait for it: close() tells them never to go, and returns once the tail's request
    is over, not after the cells' answers."""
    import signal

    bucket, options = s3_bucket
    options = options | {"request_size": MiB}
    url = f"s3://{bucket}/tail-held.ckpt"
    _save_ends_state(url, options)
    release = threading.Event()
    main = threading.main_thread().ident
    assert main is not None
    timers: list[threading.Timer] = []

    def interrupt_then_release() -> None:  # the tail held 0.5 s more, close() by then begun
        signal.pthread_kill(main, signal.SIGUSR1)
        timers.append(threading.Timer(0.5, release.set))
        timers[-1].start()

    def hold(r) -> None:
        if r == (0, MiB) and not timers:  # the first cell asked: the wave is out, the load waits
            timers.append(threading.Timer(0.3, interrupt_then_release))
            timers[-1].start()
        if r == tail:
            release.wait(30)

    def interrupt(*_):
        raise _Interrupted

    log, first, tail, _ = _probe_gets(url, options, monkeypatch, hold=hold)
    earlier = signal.signal(signal.SIGUSR1, interrupt)
    try:
        began = time.monotonic()
        with pytest.raises(_Interrupted):
            ckptfmt.load(url, storage_options=options)
        took = time.monotonic() - began
    finally:
        if timers:  # its signal sent before the handler goes (the default one ends the process)
            timers[0].join(5)
        signal.signal(signal.SIGUSR1, earlier)
    assert release.is_set() and took < 20
    assert {r for _, r in log} == {first, tail}, log


def test_a_load_under_max_bytes_reads_ahead_no_more_than_that(store_faults):
    """A whole load under max_bytes asks for no cell ahead before its index is parsed (and its
    max_bytes checked against the index): only the prologue and the tail."""
    faults = store_faults
    options = faults.options | {"request_size": MiB}
    url = f"{faults.new_root()}/bounded.ckpt"
    state = {f"t{i}": torch.zeros(500_000) + i for i in range(4)}  # 8 MB: 8 cells
    ckptfmt.save(state, url, storage_options=options)
    faults.clear_counts()
    with pytest.raises(ckptfmt.LimitError):
        ckptfmt.load(url, max_bytes=2 * MiB, storage_options=options)
    assert sum(hi - lo for lo, hi in faults.ranges("bounded.ckpt")) <= 1 * MiB + 4096


def _peaks(monkeypatch) -> dict[str, int]:
    """The most bytes each RemoteObject's spool held or had asked for at once, by URL: the
    download's own count (peak_bytes, taken as it is closed), or where more, the memory its
    memfd held (its blocks, taken before each range read or copied out is given back, when it
    is fullest)."""
    peaks: dict[str, int] = {}
    close = RemoteObject.close
    give_back = RemoteObject._give_back

    def note(self: RemoteObject, held: int) -> None:
        peaks[self.path] = max(peaks.get(self.path, 0), held)

    def closing(self: RemoteObject) -> None:
        note(self, self.peak_bytes)
        close(self)

    def giving_back(self: RemoteObject, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if self.spool is not None:
            note(self, os.fstat(self.spool.fd).st_blocks * 512)
        return give_back(self, ranges)

    monkeypatch.setattr(RemoteObject, "close", closing)
    monkeypatch.setattr(RemoteObject, "_give_back", giving_back)
    return peaks


def _index_memory(url: str, options: dict[str, object]) -> int:
    return _memory(url, options)[0]


def _memory(url: str, options: dict[str, object]) -> tuple[int, int]:
    """What a load of the object takes besides its tensors and its spool: the index, and
    the decode buffers of all its chunks (the engine's, one per thread)."""
    from ckptfmt.engine import native
    from ckptfmt.engine.chunkread import decode_memory
    from ckptfmt.files.reader import CheckpointFile

    with CheckpointFile(url, storage_options=options) as f:
        return f.index_memory, decode_memory(f.chunks, native.available())


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_load_under_max_bytes_holds_the_spool_within_what_it_leaves(store, monkeypatch, compression):
    """A store load's peak (the spool's bytes held or in flight, beside the index and the
    tensors it fills) stays within max_bytes: no read-ahead wave before the index is parsed,
    and windows sized to what the bound leaves (it held the whole 8 MiB object in its spool
    beside 8 MiB of tensors, under max_bytes of 11 MiB and the index)."""
    root, options = store
    options = options | {"request_size": MiB}
    g = torch.Generator().manual_seed(6)
    state = {f"t{i}": torch.randn(MiB // 2, generator=g) for i in range(4)}  # 4 x 2 MiB
    url = f"{root}/bounded/model.ckpt"
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10, compression=compression)
    index, decode = _memory(url, options)
    assert (decode > 0) == bool(compression)
    bound = index + 8 * MiB + 3 * MiB + decode
    peaks = _peaks(monkeypatch)
    assert_same(state, ckptfmt.load(url, max_bytes=bound, storage_options=options))
    assert 0 < peaks.pop(url) <= bound - 8 * MiB - index - decode
    with ckptfmt.open(url, max_bytes=index + 2 * MiB + 2 * MiB + decode, storage_options=options) as r:
        assert_same(state["t1"], r.get("t1"))  # one tensor's chunks, two MiB beside them
    assert 0 < peaks.pop(url) <= 2 * MiB


def test_a_load_whose_max_bytes_leaves_no_room_to_fetch_through_is_refused(store):
    """Where max_bytes covers the index and the tensors but not one window to fetch chunks
    through beside them, the load is refused (LimitError naming the URL and the bound)."""
    root, options = store
    state = {f"t{i}": torch.zeros(MiB // 2) + i for i in range(4)}  # 4 x 2 MiB
    url = f"{root}/tight/model.ckpt"
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10)
    bound = _index_memory(url, options) + 8 * MiB + 64 * 1024
    with pytest.raises(ckptfmt.LimitError, match=f"max_bytes={bound} .* to fetch chunks through") as e:
        ckptfmt.load(url, max_bytes=bound, storage_options=options)
    assert e.value.path == url


def test_a_load_under_max_bytes_counts_the_objects_it_refers_to(s3_bucket, monkeypatch):
    """An incremental step's chunks that lie in an earlier step's object are fetched through
    that object's spool within what max_bytes leaves too, beside this object's own (both
    spools' peaks together, though not at once, within it: the referenced one held its whole
    8 MiB of chunks in flight before)."""
    bucket, options = s3_bucket
    monkeypatch.setenv("CKPTFMT_CHUNK_SIZE", str(256 << 10))
    options = options | {"request_size": MiB}
    run = f"s3://{bucket}/bounded-run"
    frozen = torch.randn(2 * MiB, generator=torch.Generator().manual_seed(7))  # 8 MiB, in step 1 only
    m = ckptfmt.CheckpointManager(run, incremental=True, storage_options=options)
    for step in (1, 2):
        m.save(step, {"frozen": frozen, "head": torch.full((1000,), float(step))})
    url, referred = f"{run}/step-000000002/state.ckpt", f"{run}/step-000000001/state.ckpt"
    assert m.latest().references == (referred,)
    index = _index_memory(url, options)
    room = 3 * MiB
    peaks = _peaks(monkeypatch)
    got = ckptfmt.load(url, max_bytes=index + frozen.nbytes + 4000 + room, storage_options=options)
    state = got["state"]  # a manager's state object: the state beside its RNG and resume entries
    assert torch.equal(state["frozen"], frozen) and torch.equal(state["head"], torch.full((1000,), 2.0))
    assert peaks[referred] > MiB and peaks[url] + peaks[referred] <= room


def test_a_small_object_held_whole_loads_under_a_bound_that_covers_it(store, monkeypatch):
    """An object whose tail, fetched with its index, holds all its chunks needs no window
    beside: a bound that covers the index, the tensors and that spool loads it (it was refused
    for want of a window's room)."""
    from ckptfmt.storage.download import head
    from ckptfmt.storage.urls import parse_url

    root, options = store
    state = {"w": torch.randn(50_000, generator=torch.Generator().manual_seed(8)), "step": 3}
    url = f"{root}/small/model.ckpt"
    ckptfmt.save(state, url, storage_options=options)
    size = head(parse_url(url), options)[0]
    bound = _index_memory(url, options) + state["w"].nbytes + size + 4096
    peaks = _peaks(monkeypatch)
    assert_same(state, ckptfmt.load(url, max_bytes=bound, storage_options=options))
    assert peaks[url] <= size + 4096  # its memfd holds whole pages


def test_a_load_under_max_bytes_counts_the_pages_small_chunks_with_gaps_hold(store, monkeypatch):
    """The spool holds whole pages: 1000 chunks of 256 bytes, each beside an 8 KiB one in the
    object, hold a page or two each, and a load of them under max_bytes keeps those pages,
    not their bytes, within what the bound leaves (it asked for all of them at once, 256 KB
    fitting the room: their pages held over 3 MB beside the tail, under 2 MiB of room)."""
    root, options = store
    options = options | {"request_size": MiB}
    g = torch.Generator().manual_seed(3)
    smalls = [torch.randn(64, generator=g) for _ in range(1000)]
    state = {"pairs": [(s, torch.randn(2048, generator=g)) for s in smalls], "smalls": smalls}
    url = f"{root}/sparse/model.ckpt"
    ckptfmt.save(state, url, storage_options=options)
    index, decode = _memory(url, options)
    room = 2 * MiB  # the index's tail (1 MiB) and a few windows of 256 KiB
    bound = index + 1000 * 256 + decode + room
    peaks = _peaks(monkeypatch)
    with ckptfmt.open(url, max_bytes=bound, storage_options=options) as r:
        assert_same(smalls, r.get("smalls"))
    assert 0 < peaks.pop(url) <= room


def _direct_state() -> dict[str, torch.Tensor]:
    """Four 1.6 MB tensors: raw chunks of well over directread.DIRECT_MIN, in cells of 1 MiB."""
    g = torch.Generator().manual_seed(9)
    return {f"t{i}": torch.randn(400_000, generator=g) for i in range(4)}


def test_planning_claims_no_request_of_the_wave(s3_bucket):
    """plan() only says which requests bytes wait for: a request of the read-ahead wave it
    names is still claimed by the read that starts it (start_into: its bytes go into that
    read's memory, not into the spool, which plan() once claimed it for as a side effect)."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/planned-wave.ckpt"
    options = options | {"request_size": MiB}
    ckptfmt.save(_direct_state(), url, storage_options=options)
    remote = RemoteObject(url, options, read_ahead=True)
    try:
        lo, hi = MiB + 100, 2 * MiB - 100  # within the wave's second cell
        assert (MiB, 2 * MiB) in remote.plan([(lo, hi)])
        into = bytearray(hi - lo)
        landed: list[tuple[int, int]] = []
        remote.wait(remote.start_into([(lo, memoryview(into))], landed.append))
        assert landed == [(MiB, 2 * MiB)]
        remote.fetch([(lo, hi)])  # the spool: asked for by a request of its own
        assert into == remote.spool.view(lo, hi)
    finally:
        remote.close()


def test_a_body_cut_while_read_into_a_tensor_is_resumed_there(store_faults):
    """A connection reset in the middle of a body read straight into a tensor (a cell of the
    wave, and one asked for once the index was parsed) is resumed from the byte it reached,
    into the same memory, and the tensors come out whole."""
    from ckptfmt.engine import directread

    faults = store_faults
    options = faults.options | {"request_size": MiB, "concurrency": 3}  # 2 cells in the wave
    url = f"{faults.new_root()}/cut.ckpt"
    state = _direct_state()
    ckptfmt.save(state, url, storage_options=options)
    reads = faults.op("read", "cut.ckpt")
    faults.reset_on(*reads, nth=2, download_bytes=300_000)  # a cell of the wave
    faults.reset_on(*reads, nth=4, download_bytes=200_000)  # one asked for after the index
    straight: list[int] = []
    start = directread.DirectReads.start

    def counted(self, remote, spooled, futures):
        straight.append(len(self.targets))
        return start(self, remote, spooled, futures)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(directread.DirectReads, "start", counted)
        assert_same(state, ckptfmt.load(url, storage_options=options))
    assert faults.pending_rules() == 0
    assert (straight and straight[0] >= 3) or not native.available()  # the engine checks them in place


def test_a_chunk_read_into_its_tensor_that_fails_its_checksum_is_refused(s3_bucket, monkeypatch):
    """A chunk whose bytes change on the store (the object rewritten in place, same length,
    the store's version checks passed) fails its checksum where it lies, in the tensor it
    was read into: a CorruptError naming the URL, the key and the chunk's offset; no load
    returns it."""
    from ckptfmt.engine import directread

    bucket, options = s3_bucket
    url = f"s3://{bucket}/flipped.ckpt"
    state = _direct_state()
    ckptfmt.save(state, url, storage_options=options)
    client = s3_client(options["endpoint_url"])
    data = bytearray(client.get_object(Bucket=bucket, Key="flipped.ckpt")["Body"].read())
    data[2 * MiB] ^= 0x40  # inside t1 (t0 is the first 1.6 MB of data, after the prologue)
    client.put_object(Bucket=bucket, Key="flipped.ckpt", Body=bytes(data))
    checked = []
    check = directread.check_in_place

    def counted(file_id, k, ch, base, path):
        checked.append(k)
        return check(file_id, k, ch, base, path)

    monkeypatch.setattr(directread, "check_in_place", counted)
    with pytest.raises(ckptfmt.CorruptError, match="checksum mismatch") as e:
        ckptfmt.load(url, storage_options=options | {"request_size": MiB})
    assert e.value.path == url and e.value.key == "state['t1']"
    assert checked or not native.available()  # checked in place, by the engine


def test_the_chunk_whose_end_the_index_tail_holds_is_read_into_its_tensor(s3_bucket, monkeypatch):
    """The tail fetched for the index (1 MiB) holds the end of the last chunk: that chunk is
    still read straight into its tensor, the bytes held copied from the spool and the rest
    fetched (it went through the spool whole: a page of the spool and a copy for each of its
    bytes), and the spool gives the copied bytes back."""
    from ckptfmt.engine import directread

    bucket, options = s3_bucket
    url = f"s3://{bucket}/tail-held.ckpt"
    state = _direct_state()
    ckptfmt.save(state, url, storage_options=options)
    straight: list[int] = []
    copies: list[tuple[int, int]] = []
    start, copy_held = directread.DirectReads.start, RemoteObject.copy_held

    def counted(self, remote, spooled, futures):
        straight.append(len(self._items))
        return start(self, remote, spooled, futures)

    def copying(self, targets):
        copied = copy_held(self, targets)
        copies.extend(copied)
        return copied

    monkeypatch.setattr(directread.DirectReads, "start", counted)
    monkeypatch.setattr(RemoteObject, "copy_held", copying)
    assert_same(state, ckptfmt.load(url, storage_options=options | {"request_size": MiB}))
    if not native.available():
        return
    assert straight == [4]
    size = download.head(download.parse_url(url), options)[0]
    assert len(copies) == 1 and copies[0][0] == size - download.TAIL_BYTES


def test_a_flipped_byte_in_the_copied_end_of_a_chunk_is_refused(s3_bucket):
    """The bytes of a chunk copied from the index's tail are checked with those fetched into
    its tensor: a byte changed there (the object rewritten in place, same length) is a
    CorruptError naming the URL and the key."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/tail-flipped.ckpt"
    state = _direct_state()
    ckptfmt.save(state, url, storage_options=options)
    client = s3_client(options["endpoint_url"])
    data = bytearray(client.get_object(Bucket=bucket, Key="tail-flipped.ckpt")["Body"].read())
    data[len(data) - download.TAIL_BYTES // 2] ^= 0x40  # inside t3, within the tail, before the index
    client.put_object(Bucket=bucket, Key="tail-flipped.ckpt", Body=bytes(data))
    with pytest.raises(ckptfmt.CorruptError, match="checksum mismatch") as e:
        ckptfmt.load(url, storage_options=options | {"request_size": MiB})
    assert e.value.path == url and e.value.key == "state['t3']"


def test_a_load_under_max_bytes_plans_its_requests_once_per_read(s3_bucket, monkeypatch):
    """A bounded load's chunk reads plan their requests once (counted in pages for the windows'
    size, then cut at their grid), not a second time under the object's lock to count pages."""
    from ckptfmt.engine import fetchread

    bucket, options = s3_bucket
    url = f"s3://{bucket}/planned/model.ckpt"
    state = _direct_state()
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10)
    plans, reads = [0], [0]
    plan, read_by_window = RemoteObject.plan, fetchread.read_by_window

    def planning(self, ranges, cut=True):
        plans[0] += 1
        return plan(self, ranges, cut)

    def reading(*args, **kwargs):
        reads[0] += 1
        return read_by_window(*args, **kwargs)

    monkeypatch.setattr(RemoteObject, "plan", planning)
    monkeypatch.setattr(fetchread, "read_by_window", reading)
    assert_same(state, ckptfmt.load(url, max_bytes=20 * MiB, storage_options=options))
    assert reads[0] >= 1 and plans[0] == reads[0]


def test_a_load_without_a_bound_does_not_count_the_spools_pages(s3_bucket, monkeypatch):
    """The spool's pages are summed (peak_bytes, under the object's lock) only for a load under
    max_bytes, whose windows are sized by them: a load without a bound never sums them (it did
    on every fetch, for a figure nothing read)."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/unbounded/model.ckpt"
    state = _direct_state()
    ckptfmt.save(state, url, storage_options=options, chunk_size=256 << 10)
    from ckptfmt.storage.holdings import Holdings

    sums = [0]
    occupied = Holdings.occupied

    def summed(self):
        sums[0] += 1
        return occupied(self)

    monkeypatch.setattr(Holdings, "occupied", summed)
    assert_same(state, ckptfmt.load(url, storage_options=options))
    assert sums[0] == 0
    assert_same(state, ckptfmt.load(url, max_bytes=20 * MiB, storage_options=options))
    assert sums[0] > 0


def test_a_store_load_without_a_built_engine_reads_through_the_spool(store, monkeypatch):
    """Without a built C engine (no ffi, no lib), a load from a store reads every chunk through
    the spool, one by one: none goes straight into its tensor, which needs the engine."""
    root, options = store
    url = f"{root}/no-engine.ckpt"
    state = {"w": torch.randn(100_000), "b": torch.randn(64)}  # 400 KB: a raw chunk over DIRECT_MIN
    ckptfmt.save(state, url, storage_options=options)
    monkeypatch.setattr(native, "ffi", None)
    monkeypatch.setattr(native, "lib", None)
    monkeypatch.setenv("CKPTFMT_BACKEND", "python")  # the slow path's warning silenced
    assert not native.available()
    assert_same(state, ckptfmt.load(url, storage_options=options))


def test_a_load_of_weights_and_small_biases_asks_for_each_cell_once(store_faults):
    """A state alternating raw weights (read straight into their tensors) and small biases (read
    through the spool) is fetched by one plan over all of its chunks, near neighbours merged
    and cut at the grid: about a GET per cell of request_size beyond the first wave, not one
    per tensor; every byte asked for once."""
    faults = store_faults
    options = faults.options | {"request_size": MiB, "concurrency": 3}  # 2 cells in the wave
    url = f"{faults.new_root()}/biased.ckpt"
    g = torch.Generator().manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    for i in range(40):  # 10.4 MB: 11 cells, 80 tensors
        state[f"w{i}"] = torch.randn(64 << 10, generator=g)  # 256 KiB: straight
        state[f"b{i}"] = torch.randn(1 << 10, generator=g)  # 4 KiB: through the spool
    ckptfmt.save(state, url, storage_options=options)
    cells = -(-faults.size(url) // MiB)
    faults.clear_counts()
    assert_same(state, ckptfmt.load(url, storage_options=options))
    ranges = sorted(faults.ranges("biased.ckpt"))
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # no byte twice
    assert len(ranges) <= cells + 3, ranges  # the cells, the tail, the index's rest


def _slow_index(monkeypatch, fails: bool) -> None:
    """The index parsed 2 s late (then refused where `fails`): the read-ahead wave's answers
    wait that long for their claim."""
    from ckptfmt.files import reader

    parse = reader.parse_index

    def slow(*args, **kwargs):
        time.sleep(2)
        if fails:
            raise ckptfmt.CorruptError("refused by the test", path="index")
        return parse(*args, **kwargs)

    monkeypatch.setattr(reader, "parse_index", slow)


@pytest.mark.parametrize("fails", [False, True], ids=["claimed", "abandoned"])
def test_a_wave_request_claimed_after_request_timeout_is_read_once(store_faults, monkeypatch, fails):
    """A request of the read-ahead wave waits for its claim outside its body's deadline
    (request_timeout) and its retries: claimed 2 s after it went out, under a 0.5 s
    request_timeout, its body is still read, by the one GET; abandoned (the load failed
    first), it is never asked for again."""
    faults = store_faults
    options = faults.options | {"request_size": MiB, "request_timeout": 0.5}
    url = f"{faults.new_root()}/late.ckpt"
    state = _direct_state()  # 6.4 MB: 7 cells
    ckptfmt.save(state, url, storage_options=options)
    cells = -(-faults.size(url) // MiB)
    faults.clear_counts()
    _slow_index(monkeypatch, fails)
    if fails:
        with pytest.raises(ckptfmt.CorruptError, match="refused by the test"):
            ckptfmt.load(url, storage_options=options)
    else:
        assert_same(state, ckptfmt.load(url, storage_options=options))
    ranges = sorted(faults.ranges("late.ckpt"))
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), ranges  # no byte twice
    assert len(ranges) <= cells + 1, ranges


def _raw_chunk(offset: int, n: int):
    from ckptfmt.format import layout
    from ckptfmt.format.chunks import Chunk

    return Chunk(offset, n, n, layout.CODEC_RAW, layout.FILTER_NONE, 1, 0, 0)


def test_a_raw_chunk_that_cannot_lie_where_it_is_read_is_refused_as_corrupt():
    """A chunk record whose offset lies beyond the memory it was read into, or whose length
    is not its destination's, is a CorruptError naming the file and the chunk (not a bare
    ValueError)."""
    from ckptfmt.engine import directread

    with pytest.raises(ckptfmt.CorruptError, match="chunk 3: its offset") as e:
        directread.check_in_place(b"\0" * 16, 3, _raw_chunk(1 << 62, 64 << 10), 4096, "s3://b/x.ckpt")
    assert e.value.path == "s3://b/x.ckpt"
    short = memoryview(bytearray(1000))
    with pytest.raises(ckptfmt.CorruptError, match="chunk 0 at offset 4096: 65536 bytes") as e:
        directread.DirectReads(
            "s3://b/x.ckpt", b"\0" * 16, [_raw_chunk(4096, 64 << 10)], [(0, short)], True, None
        )
    assert e.value.path == "s3://b/x.ckpt"


def test_requests_made_before_a_direct_read_fails_to_start_are_waited_for():
    """Where starting the direct fetches fails after some requests were made (or claimed),
    read_direct waits for those before it lets the tensors go, and raises the failure."""
    from ckptfmt.engine import directread

    made: Future[None] = Future()

    class Failing:
        def start_into(self, targets, landed, spooled, futures, copied):
            futures.append(made)
            threading.Timer(0.3, made.set_result, [None]).start()
            raise RuntimeError("the pool is shut down")

        def wait_quietly(self, futures):
            for f in futures:
                f.exception()

        def copy_held(self, targets):
            return []

    dest = memoryview(bytearray(64 << 10))
    reads = [(0, dest)]
    with pytest.raises(RuntimeError, match="pool is shut down"):
        directread.read_direct(
            Failing(), "x", b"\0" * 16, [_raw_chunk(4096, 64 << 10)], reads, [], True, None, print
        )
    assert made.done()


@pytest.mark.parametrize("compression", [None, "zstd"])  # straight into the tensor; through the spool
def test_a_request_that_could_not_be_sent_is_not_waited_for(s3_bucket, monkeypatch, compression):
    """A load's requests are registered as in flight, then handed to the pool one by one; when
    a hand-over fails (no thread can start), the read fails with that error, and the requests
    never sent are taken out of flight: they were waited for by that read's end and by every
    later read of their bytes, for ever."""
    bucket, options = s3_bucket
    options = options | {"request_size": MiB}
    url = f"s3://{bucket}/unsent-{compression}.ckpt"
    w = torch.randn(6 * MiB, generator=torch.Generator().manual_seed(1))
    ckptfmt.save({"w": w}, url, compression=compression, storage_options=options)
    real_start = threading.Thread.start
    started = [0]

    def start(self):
        if self.name.startswith("ckptfmt-download"):
            started[0] += 1
            if started[0] > 2:  # the prologue's and the tail's threads only
                raise RuntimeError("can't start new thread")
        return real_start(self)

    outcome: list[object] = []

    def read() -> None:
        with ckptfmt.open(url, storage_options=options) as f:
            monkeypatch.setattr(threading.Thread, "start", start)
            try:
                f.get("w")
                outcome.append("the first read did not fail")
            except RuntimeError as e:
                outcome.append(str(e))
            finally:
                monkeypatch.setattr(threading.Thread, "start", real_start)
            outcome.append(torch.equal(f.get("w"), w))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"the read hangs: {outcome}"
    assert outcome == ["can't start new thread", True]


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("n", [100_000, 400_000])  # one chunk; several
def test_load_into_targets_apart_whose_saved_tensors_share_a_storage(s3_bucket, tmp_path, n, verify):
    """The file stores one storage for keys a and b; the live state has two tensors.  Each
    chunk then has two destinations: fetched straight into them, each byte reached one, and a
    target came back zero, with verify=True as well."""
    bucket, options = s3_bucket
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    url = f"s3://{bucket}/shared-{n}.ckpt"
    ckptfmt.save({"a": x, "b": x}, url, storage_options=options, chunk_size=1 << 20)
    targets = {"a": torch.zeros(n), "b": torch.zeros(n)}
    ckptfmt.load_into(url, targets, storage_options=options, verify=verify)
    assert torch.equal(targets["a"], x) and torch.equal(targets["b"], x)


def test_a_read_of_an_object_closed_meanwhile_says_so(s3_bucket):
    """A read waiting for requests the object's close cancelled, and one that goes on with the
    object after it, fail with a CheckpointError saying the object was closed (never a bare
    CancelledError, an assertion or a closed spool's error)."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/closed-under.ckpt"
    ckptfmt.save({"w": torch.randn(MiB)}, url, storage_options=options)
    remote = RemoteObject(url, options | {"concurrency": 1}, fetch_index=False)
    release = threading.Event()
    get_range = RemoteObject._get_range

    def held_up(self: RemoteObject, *args: object, **kwargs: object) -> None:
        release.wait(30)
        get_range(self, *args, **kwargs)  # type: ignore[arg-type]

    remote._get_range = held_up.__get__(remote)  # type: ignore[method-assign]
    running = remote.start([(0, 4096)])  # holds the one thread
    queued = remote.start([(2 * MiB, 2 * MiB + 4096)])  # cancelled by close
    closing = threading.Thread(target=remote.close)
    closing.start()
    deadline = time.monotonic() + 30
    while not remote._pool._shutdown and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    release.set()
    closing.join(30)
    with pytest.raises(ckptfmt.CheckpointError, match="closed while a read of it was in progress"):
        remote.wait([*running, *queued])
    with pytest.raises(ckptfmt.CheckpointError, match="closed while a read of it was in progress"):
        remote.wait(remote.start([(MiB, MiB + 4096)]))
    with pytest.raises(ckptfmt.CheckpointError, match="closed while a read of it was in progress"):
        remote.dup_fd()


def test_one_reader_of_an_object_serves_several_threads(s3_bucket):
    """Each key asked for twice by four threads at once through one open reader: reads that
    overlapped gave back spool pages another was still reading (a false CorruptError)."""
    bucket, options = s3_bucket
    g = torch.Generator().manual_seed(3)
    sizes = [3000, 16384, 70000, 300000]
    state = {f"t{i:02d}": torch.randn(sizes[i % 4], generator=g) for i in range(12)}
    url = f"s3://{bucket}/threads.ckpt"
    ckptfmt.save(state, url, storage_options=options, chunk_size=1 << 18)
    keys = [*state, *reversed(state)]
    with ckptfmt.open(url, storage_options=options | {"request_size": MiB}) as r:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(r.get, keys))
    assert all(torch.equal(t, state[k]) for k, t in zip(keys, got))


def _finish_later(f: Future[None], delay: float, cancel: bool) -> None:
    threading.Timer(delay, f.cancel if cancel else lambda: f.set_result(None)).start()


def test_a_fetch_cancelled_while_waited_for_is_a_storage_error_and_the_rest_are_waited_for():
    """Cancelled under the wait (never sent): the wait ends in a StorageError after every
    fetch after it, not a bare CancelledError that leaves a fetch writing into memory its
    caller then lets go of.  (A read's wait for an object's requests asks for the bytes of
    another read's never sent again: test_concurrent_reads; one cancelled by close:
    test_a_read_of_an_object_closed_meanwhile_says_so.)"""
    for quietly in (False, True):
        cancelled, slow = Future(), Future()
        _finish_later(cancelled, 0.2, cancel=True)
        _finish_later(slow, 1.0, cancel=False)
        if quietly:
            RemoteObject.wait_quietly([cancelled, slow])
        else:
            with pytest.raises(StorageError, match="cancelled"):
                pools.wait_all([cancelled, slow])
        assert slow.done()

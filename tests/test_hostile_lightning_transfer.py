"""Hostile and odd input to the Lightning plugin's checkpoints on fsspec URLs (transfer.py):
remote names that mean something else locally, files that change or never end while they are
downloaded, uploads that fail half way, credentials in URLs.  Real fsspec filesystems
(``memory://``, and ``http://`` from a local server); the filesystems subclassed here stand
for a store that misbehaves, never for ckptfmt's own code."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import io
import os
import pathlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import test_lightning_fsspec
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from test_lightning_fsspec import _plugin

import ckptfmt
from ckptfmt.integrations.lightning import transfer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs ckptfmt[lightning]"
)

#: a fresh memory:// folder; the local temporary folder checked empty after the test
root = test_lightning_fsspec.root


@pytest.mark.parametrize("name", ["..", ".", "%2e%2e", "a\\..\\b", "-v1.ckpt"])
@pytest.mark.parametrize("blocking", [True, False])
def test_remote_names_that_mean_something_else_locally(root: str, name: str, blocking: bool) -> None:
    """A store's file may be called '..' or '.': the local copy it is written to and read from
    is never named after it (which would be the temporary folder's parent, or the folder)."""
    plugin = _plugin(blocking=blocking)
    url = f"{root}/sub/{name}"
    plugin.save_checkpoint({"w": torch.arange(5.0)}, url)
    plugin.teardown()
    assert torch.equal(plugin.load_checkpoint(url)["w"], torch.arange(5.0))


# ---------------------------------------------------------------------------
# downloads: files that change, never end, or do not fit


class _ChangingMemory(MemoryFileSystem):
    """fsspec's memory filesystem (its files shared with memory://) standing for a store whose
    files change under a reader: `size_shift` is added to the size it reports, and from a
    file's second read on, `then` is what the file holds."""

    protocol = "changingmem"
    size_shift = 0
    then: bytes | None = None

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return str(super()._strip_protocol(str(path).replace("changingmem://", "memory://", 1)))

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        found = dict(super().info(path, **kwargs))
        if found["type"] == "file":
            found["size"] += self.size_shift
        return found

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        return f if mode != "rb" or self.then is None else _Replaced(f.read(), self.then)


class _Replaced(io.BytesIO):
    """A file replaced by `then` after its first read."""

    def __init__(self, first: bytes, then: bytes) -> None:
        super().__init__(first)
        self.then = then
        self.reads = 0

    def read(self, n: int | None = -1) -> bytes:
        self.reads += 1
        if self.reads == 1:
            return super().read(n)
        at = self.tell()
        piece = self.then[at : at + (len(self.then) if n is None or n < 0 else n)]
        self.seek(at + len(piece))
        return piece


@pytest.fixture
def changing(root: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The changingmem:// URL of a checkpoint saved at memory:// (read a piece at a time)."""
    import fsspec

    monkeypatch.setattr(transfer, "COPY_BYTES", 4096)
    fsspec.register_implementation("changingmem", _ChangingMemory, clobber=True)
    _plugin().save_checkpoint({"w": torch.zeros(1 << 14)}, f"{root}/a.ckpt")
    return root.replace("memory://", "changingmem://") + "/a.ckpt"


def test_a_file_replaced_while_it_is_downloaded_is_refused(
    root: str, changing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another checkpoint of the same length takes the file's place after its first piece is
    fetched: the local copy is half of each, which the file id in the footer gives away."""
    import fsspec

    _plugin().save_checkpoint({"w": torch.ones(1 << 14)}, f"{root}/b.ckpt")
    monkeypatch.setattr(_ChangingMemory, "then", fsspec.filesystem("memory").cat_file(f"{root}/b.ckpt"))
    with pytest.raises(ckptfmt.CorruptError, match=f"^{changing}: .*another file"):
        _plugin().load_checkpoint(changing)


@pytest.mark.parametrize("shift", [-4096, 4096])
def test_a_file_whose_size_changes_is_never_read_past_it(
    changing: str, monkeypatch: pytest.MonkeyPatch, shift: int
) -> None:
    """The store said the file was shorter than it is (it grew): no more than that is fetched,
    and the truncated copy is refused; longer (it shrank): the download says it changed."""
    monkeypatch.setattr(_ChangingMemory, "size_shift", shift)
    with pytest.raises(ckptfmt.CheckpointError) as info:
        _plugin().load_checkpoint(changing)
    assert str(info.value).startswith(f"{changing}: ") and "\n" not in str(info.value)
    if shift > 0:
        assert isinstance(info.value, ckptfmt.StorageError) and "changed while it was downloaded" in str(
            info.value
        )
    else:
        assert isinstance(info.value, (ckptfmt.IncompleteError, ckptfmt.CorruptError))


def test_a_file_larger_than_the_free_disk_is_refused_before_a_byte_is_fetched(
    changing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_ChangingMemory, "size_shift", 1 << 62)
    monkeypatch.setattr(_ChangingMemory, "_open", _never_opened)
    with pytest.raises(
        ckptfmt.LimitError, match=f"^{changing}: a file of .* does not fit in the temporary folder"
    ):
        _plugin().load_checkpoint(changing)


def _never_opened(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the file was opened")


# ---------------------------------------------------------------------------
# http: a file without an end; credentials in URLs


@pytest.fixture
def http_root(tmp_path: pathlib.Path) -> Iterator[str]:
    """http://user:PASSWORD@127.0.0.1:PORT serving tmp_path/served, and /endless: a response
    with no length that goes on (1 GiB) for as long as it is read."""
    served = tmp_path / "served"
    served.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            if self.path.startswith("/endless"):
                self.send_response(200)
                self.end_headers()
                return
            super().do_HEAD()

        def do_GET(self) -> None:
            if not self.path.startswith("/endless"):
                return super().do_GET()
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(1024):
                    self.wfile.write(MAGIC + bytes(1 << 20))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://user:PASSWORD@127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join()


MAGIC = b"\x89CKF\r\n\x1a\n"


def test_credentials_in_a_url_never_appear_in_errors(
    http_root: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL's password and its query string (a signed URL's signature, a SAS token) are
    hidden wherever an error names the URL: a missing file, a damaged one, one of unknown
    length (never downloaded: an endless response would fill the disk), an unknown protocol."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    served = tmp_path / "served"
    ckptfmt.save({"w": torch.arange(4096.0)}, served / "a.ckpt")
    data = bytearray((served / "a.ckpt").read_bytes())
    data[len(data) // 3] ^= 0x40
    (served / "bad.ckpt").write_bytes(data)
    query = "?sig=SIGNATURE%2Bx&se=2030"
    plugin = _plugin()
    assert torch.equal(plugin.load_checkpoint(f"{http_root}/a.ckpt{query}")["w"], torch.arange(4096.0))
    shown = http_root.replace("PASSWORD", "***")
    cases = [
        ("none.ckpt", FileNotFoundError, "Checkpoint file not found"),
        ("bad.ckpt", ckptfmt.CorruptError, "checksum mismatch"),
        ("endless", ckptfmt.StorageError, "a file of unknown length is not downloaded"),
    ]
    for name, kind, words in cases:
        with pytest.raises(kind) as info:
            plugin.load_checkpoint(f"{http_root}/{name}{query}")
        text = str(info.value)
        assert words in text and f"{shown}/{name}?***" in text, text
        assert "PASSWORD" not in text and "SIGNATURE" not in text and "se=2030" not in text
    with pytest.raises(ckptfmt.StorageError) as refused:  # the server's refusal quotes the URL
        plugin.save_checkpoint({"w": torch.ones(2)}, f"{http_root}/up.ckpt{query}")
    text = str(refused.value)
    assert text.startswith(f"{shown}/up.ckpt?***: uploading the checkpoint failed: ") and "\n" not in text
    assert "PASSWORD" not in text and "SIGNATURE" not in text and "se=2030" not in text
    assert [p.name for p in temp.iterdir() if "ckptfmt" in p.name] == []
    from ckptfmt.integrations.lightning.paths import RemotePathError

    with pytest.raises(RemotePathError) as unknown:
        plugin.load_checkpoint("nosuchproto://user:PASSWORD@host/a.ckpt?token=SIGNATURE")
    assert "PASSWORD" not in str(unknown.value) and "SIGNATURE" not in str(unknown.value)


def test_a_file_from_a_server_without_ranges_is_downloaded_whole(
    http_root: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download reads the file once, a piece at a time, as a stream: an HTTP server that
    ignores range requests (Python's own) serves a file longer than fsspec's 5 MiB blocks."""
    monkeypatch.setattr(transfer, "COPY_BYTES", 4 << 20)
    big = torch.arange(float(3 << 20))  # 12 MiB
    ckptfmt.save({"w": big}, tmp_path / "served" / "big.ckpt")
    assert torch.equal(_plugin().load_checkpoint(f"{http_root}/big.ckpt")["w"], big)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("memory://a/b.ckpt", "memory://a/b.ckpt"),
        ("sftp://me:hunter22@host:22/x/p.ckpt", "sftp://me:***@host:22/x/p.ckpt"),
        ("ftp://me@host/p", "ftp://me@host/p"),
        ("simplecache::gs://b/k?X-Goog-Signature=ab", "simplecache::gs://b/k?***"),
        ("abfs://c@acct.dfs.core.windows.net/x?sv=2&sig=Z", "abfs://c@acct.dfs.core.windows.net/x?***"),
    ],
)
def test_a_url_is_shown_without_its_password_and_query(url: str, expected: str) -> None:
    from ckptfmt.integrations.lightning.paths import shown

    assert shown(url) == expected


# ---------------------------------------------------------------------------
# uploads that fail half way


class _FailingMemory(MemoryFileSystem):
    """fsspec's memory filesystem (files shared with memory://) standing for a store whose
    upload dies after `fail_after` bytes with `error` (the bytes before stay, as on a
    filesystem that writes in place)."""

    protocol = "failingmem"
    fail_after = 0
    error: type[BaseException] = ConnectionResetError

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return str(super()._strip_protocol(str(path).replace("failingmem://", "memory://", 1)))

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if mode != "wb":
            return f
        failing = _FailingFile(self, f.path, self.fail_after, self.error)
        failing.commit()
        return failing


class _FailingFile(MemoryFile):
    def __init__(self, fs: Any, path: str, budget: int, error: type[BaseException]) -> None:
        super().__init__(fs, path)
        self.budget = budget
        self.error = error

    def write(self, data: Any) -> int:
        room = max(0, self.budget - self.tell())
        if len(data) > room:
            super().write(bytes(data[:room]))
            raise self.error("the connection dropped")
        return super().write(data)


@pytest.mark.parametrize("error", [ConnectionResetError, KeyboardInterrupt])
def test_an_upload_that_dies_half_way_is_never_read_as_a_checkpoint(
    root: str, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    """put_file fails after 1000 bytes (an error, or an interrupt): the save raises, the local
    temporary file is gone, and the half file the store kept is refused by the loader; the
    next save there is whole."""
    import fsspec

    fsspec.register_implementation("failingmem", _FailingMemory, clobber=True)
    monkeypatch.setattr(_FailingMemory, "fail_after", 1000)
    monkeypatch.setattr(_FailingMemory, "error", error)
    url = f"{root}/last.ckpt"
    failing = url.replace("memory://", "failingmem://")
    state = {"w": torch.arange(1 << 12, dtype=torch.float32)}
    with pytest.raises(ckptfmt.StorageError if error is ConnectionResetError else error) as info:
        _plugin().save_checkpoint(state, failing)
    if error is ConnectionResetError:
        assert str(info.value).startswith(f"{failing}: uploading the checkpoint failed: ConnectionResetError")
    assert len(fsspec.filesystem("memory").cat_file(url)) == 1000
    with pytest.raises((ckptfmt.IncompleteError, ckptfmt.CorruptError), match=f"^{url}: "):
        _plugin().load_checkpoint(url)
    plugin = _plugin(blocking=False)
    plugin.save_checkpoint(state, url)
    plugin.teardown()
    assert torch.equal(_plugin().load_checkpoint(url)["w"], state["w"])


class _Blocked(BaseException):
    """Raised by the alarm: a BaseException, which no `except Exception` on the way swallows."""


@pytest.mark.parametrize("scheme", ["local://", "simplecache::file://"])
def test_a_fifo_on_an_fsspec_url_is_never_opened(tmp_path: pathlib.Path, scheme: str) -> None:
    """enable()'s loader asks whether a file is ckptfmt's by reading its head: a FIFO is not a
    file and is never opened (opening one waits for a writer, forever); the plugin's load says
    there is no checkpoint file."""
    from ckptfmt.integrations.lightning import loader

    os.mkfifo(tmp_path / "fifo")
    url = f"{scheme}{tmp_path}/fifo"

    def blocked(*_: object) -> None:
        raise _Blocked("blocked on the FIFO")

    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    try:
        assert loader._is_ckptfmt_file(url) is False
        with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
            _plugin().load_checkpoint(url)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_an_s3_torch_file_larger_than_the_free_disk_is_refused_before_it_is_fetched(
    s3_bucket: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch.save object on s3:// is copied to a local file for torch.load: with less room
    in the temporary folder than the object's size, LimitError names the URL and nothing is
    fetched (the disk is never filled)."""
    from s3_server import s3_client

    bucket, options = s3_bucket
    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.arange(5.0)}}, buffer)
    s3_client(options["endpoint_url"]).put_object(Bucket=bucket, Key="old.ckpt", Body=buffer.getvalue())
    url = f"s3://{bucket}/old.ckpt"
    plugin = _plugin(storage_options=options, read_torch_checkpoints=True)
    assert torch.equal(plugin.load_checkpoint(url)["state_dict"]["w"], torch.arange(5.0))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=100))
    with pytest.raises(
        ckptfmt.LimitError, match=f"^{url}: a file of {len(buffer.getvalue())} bytes does not fit"
    ):
        plugin.load_checkpoint(url)


def test_the_folders_a_killed_process_left_are_removed_by_the_next_save(root: str) -> None:
    """A process killed during an upload or a download removes nothing: its private folder
    (with a checkpoint-sized file) is removed by the next save or load of any process, and
    nothing else in the shared temporary folder is touched (another live process's folder, a
    name like ours that is not one, a link)."""
    import subprocess
    import sys

    from ckptfmt.engine import commit

    temp = pathlib.Path(tempfile.gettempdir())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)
    host = commit.host_token()
    left = [
        temp / f".{kind}{commit.TEMP_MARKER}{host}.{dead_pid}.0.0123abcd"
        for kind in ("ckptfmt-upload", "ckptfmt-download")
    ]
    for folder in left:
        folder.mkdir()
        (folder / "checkpoint").write_bytes(b"x" * 4096)
    kept = [
        temp / f".ckptfmt-upload{commit.TEMP_MARKER}{host}.1.0.0123abcd",  # pid 1 lives
        temp / f".ckptfmt-upload{commit.TEMP_MARKER}{host}.{dead_pid}.0.nothex",
        temp / f".ckptfmt-other{commit.TEMP_MARKER}{host}.{dead_pid}.0.0123abcd",
    ]
    for folder in kept:
        folder.mkdir()
        (folder / "file").write_bytes(b"y")
    link = temp / f".ckptfmt-download{commit.TEMP_MARKER}{host}.{dead_pid}.0.00000000"
    link.symlink_to(kept[0])
    _plugin().save_checkpoint({"w": torch.ones(3)}, f"{root}/a.ckpt")
    assert not any(folder.exists() for folder in left)
    assert all((folder / "file").read_bytes() == b"y" for folder in kept)
    assert link.is_symlink()
    for folder in kept:
        shutil.rmtree(folder)
    link.unlink()


def test_an_upload_thread_that_cannot_start_leaves_nothing_behind(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-blocking save whose upload thread cannot start (the process is out of threads)
    raises; the local save writing into the private folder is waited for before the folder
    goes, so no thread, no file and no folder is left (the root fixture checks)."""
    start = threading.Thread.start

    def refuse_uploads(thread: threading.Thread) -> None:
        if thread.name.startswith("ckptfmt-save-upload"):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse_uploads)
    plugin = _plugin(blocking=False)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        plugin.save_checkpoint({"w": torch.zeros(1 << 22)}, f"{root}/a.ckpt")
    monkeypatch.undo()
    plugin.teardown()


def test_a_live_folder_is_locked_for_processes_that_cannot_ask_about_its_owner(root: str) -> None:
    """A process of another host or pid namespace sharing the temporary folder cannot tell
    whether the owner of a folder lives: the folder is locked while it is held (the engine's
    rule then keeps it), and unlocked once removed."""
    import fcntl

    from ckptfmt.integrations.lightning import workdirs

    path = workdirs.make(workdirs.UPLOAD)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        workdirs.remove(path)
    assert not os.path.exists(path)


def test_an_upload_in_flight_is_named_without_the_credentials_of_its_url(root: str) -> None:
    """A non-blocking save's handle (printed at exit when its failure was never seen) and its
    upload thread name the URL with its query string hidden; a load there still waits for it."""
    from ckptfmt.background import inflight

    plugin = _plugin(blocking=False)
    url = f"{root}/a.ckpt?sig=SECRETSIG"
    state = {"w": torch.zeros(1 << 22)}
    plugin.save_checkpoint(state, url)
    names = [repr(h) for h in plugin._saves()._handles] + [t.name for t in threading.enumerate()]
    names += [repr(h) for h in list(inflight._in_flight.values())]
    assert any("a.ckpt?***" in n for n in names) and not [n for n in names if "SECRETSIG" in n]
    assert torch.equal(_plugin().load_checkpoint(url)["w"], state["w"])  # waited for the upload
    plugin.teardown()

"""Hostile and odd input to the Lightning plugin's checkpoints on fsspec URLs (transfer.py):
remote names that mean something else locally, files that change or never end while they are
downloaded, uploads that fail half way, credentials in URLs.  Real fsspec filesystems
(``memory://``, and ``http://`` from a local server); the filesystems subclassed here stand
for a store that misbehaves, never for ckptfmt's own code."""

from __future__ import annotations

import importlib.util
import io
from typing import Any

import pytest
import test_lightning_fsspec
import torch
from fsspec.implementations.memory import MemoryFileSystem
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

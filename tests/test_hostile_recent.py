"""Hostile input to recently added paths that read from disk or a store: the private
temporary folders of the Lightning transfers in a shared TMPDIR, ranged reads of objects."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from ckptfmt.engine import commit
from ckptfmt.engine.ckptdir import CheckpointDir


def _dead_pid() -> int:
    return int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
def test_a_dead_processs_folder_of_another_user_is_left(tmp_path: pathlib.Path) -> None:
    """A folder in the shared temporary folder named as a dead process's private folder but
    owned by another user was made by no process of ours: even a process that could remove
    it (root) leaves it and everything in it."""
    from ckptfmt.integrations.lightning import workdirs

    name = f".ckptfmt-upload{commit.TEMP_MARKER}{commit.host_token()}.{_dead_pid()}.0.0123abcd"
    theirs = tmp_path / name
    theirs.mkdir()
    (theirs / "their-file").write_bytes(b"y")
    os.chown(theirs, 65534, 65534)
    ours = tmp_path / name.replace("0123abcd", "4567cdef")
    ours.mkdir()
    with CheckpointDir.open(tmp_path) as d:
        assert workdirs.remove_abandoned(d) == [ours.name]
    assert (theirs / "their-file").read_bytes() == b"y"


def _encrypted_file(tmp_path: pathlib.Path) -> tuple[pathlib.Path, bytes, int]:
    """(an encrypted file, its key, where its encryption block starts)."""
    import torch

    import ckptfmt
    from ckptfmt.format import layout as fmt

    key = bytes(range(32))
    path = tmp_path / "e.ckpt"
    ckptfmt.save({"w": torch.ones(4)}, path, encrypt_with=key)
    data = path.read_bytes()
    prologue = fmt.parse_prologue(data[: fmt.PROLOGUE_SIZE], len(data), str(path))
    footer = fmt.parse_footer(data[-fmt.FOOTER_SIZE :], prologue, str(path))
    return path, key, len(data) - fmt.FOOTER_SIZE - footer.signature_length


@pytest.mark.parametrize("part", ["wrapped key", "index tag"])
def test_a_tampered_key_wrap_or_index_is_refused_without_cryptography(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """Where the engine's libcrypto seals and opens the key wrap and the index, the
    ``cryptography`` package need not be installed: a changed wrapped key or index tag is
    then a DecryptionError naming the file, never an ImportError."""
    import ckptfmt
    from ckptfmt.engine import native
    from ckptfmt.format import encryption as enc

    if not native.crypto_available():
        pytest.skip("needs the engine built with libcrypto")
    path, key, block_at = _encrypted_file(tmp_path)
    # the wrapped key follows the block's header and its nonce; the index tag ends the header
    at = (
        block_at + enc.HEADER_SIZE + enc.NONCE_SIZE
        if part == "wrapped key"
        else block_at + enc.HEADER_SIZE - 1
    )
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(data)
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "cryptography", None)
    with pytest.raises(ckptfmt.DecryptionError, match=f"^{path}: .*GCM tag"):
        ckptfmt.load(path, decrypt_with=key)


def test_a_temporary_folder_that_leads_to_a_fifo_is_named_for_what_it_is(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TMPDIR is the user's choice, and a link in it is followed: one that leads to a FIFO
    is refused as not a directory, not as a link that was never followed (it was)."""
    import tempfile

    from ckptfmt.engine.ckptdir import LinkError
    from ckptfmt.integrations.lightning import workdirs

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "link"))
    with pytest.raises(LinkError, match=f"^{tmp_path / 'link'}: not a directory where a directory must be$"):
        workdirs.make(workdirs.UPLOAD)
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    path = workdirs.make(workdirs.DOWNLOAD)
    try:
        assert os.path.dirname(path) == str(tmp_path / "link")
        assert [p.name for p in (tmp_path / "dir").iterdir()] == [os.path.basename(path)]
    finally:
        workdirs.remove(path)
    assert list((tmp_path / "dir").iterdir()) == []

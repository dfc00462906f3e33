"""upload_file (an archive copy's upload of a local file) on every store: an empty file is
uploaded as an empty object, created only if absent as any other."""

from __future__ import annotations

import os

import pytest

from ckptfmt.errors import ObjectExistsError
from ckptfmt.storage.backends import store_for
from ckptfmt.storage.upload import upload_file
from ckptfmt.storage.urls import parse_url


def _size(url: str, options: dict) -> int:
    where = parse_url(url)
    return int(store_for(where, options).head(where)[0])


def test_an_empty_file_is_uploaded_as_an_empty_object(store, tmp_path):
    root, options = store
    url = f"{root}/copies/empty.bin"
    src = tmp_path / "empty.bin"
    src.write_bytes(b"")
    fd = os.open(src, os.O_RDONLY)
    try:
        assert upload_file(fd, url, options, if_absent=True) == 0
        assert _size(url, options) == 0
        with pytest.raises(ObjectExistsError):  # created only if absent, as a file with bytes is
            upload_file(fd, url, options, if_absent=True)
    finally:
        os.close(fd)

"""Golden files written by an earlier version must keep loading to the same values."""

from __future__ import annotations

import os

import pytest
from golden.make_golden import FILES, expected
from helpers import assert_same

import ckptfmt

HERE = os.path.join(os.path.dirname(__file__), "golden")


@pytest.mark.parametrize("name", sorted(FILES))
def test_golden_file_loads_to_expected_values(name):
    path = os.path.join(HERE, name)
    # an encrypted golden file is read with its published test key
    key = os.path.join(HERE, str(FILES[name]["encrypt_with"])) if "encrypt_with" in FILES[name] else None
    assert ckptfmt.verify(path, decrypt_with=key).ok
    assert_same(expected(), ckptfmt.load(path, decrypt_with=key))
    with ckptfmt.open(path, decrypt_with=key) as r:
        assert r.metadata == {"golden": name}
        assert r.producer["format"] == "1.0"
        assert r.producer["created"] == "2025-11-30T00:00:00Z"


def test_golden_files_differ_only_where_expected():
    raw = open(os.path.join(HERE, "v1_0_raw.ckpt"), "rb").read()
    z = open(os.path.join(HERE, "v1_0_zstd.ckpt"), "rb").read()
    assert raw[:8] == z[:8] == b"\x89CKF\r\n\x1a\n" and raw[-8:] == z[-8:] == b"\x89CKFEND\n"
    assert len(z) < len(raw)

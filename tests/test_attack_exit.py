"""Signing at interpreter exit: a signed save made by an ``atexit`` handler runs once
concurrent.futures' exit hook has made every pool refuse new work.  The SHA-256 of a signed
commit record's files (an incremental step names its base's too) and of a signed file's chunks
are taken on a pool of threads; at exit they must be taken on the calling thread, and the save
end whole, not fail with a plain RuntimeError."""

from __future__ import annotations

import pytest
from test_store_exit import _run_child

_SIGNED_AT_EXIT = """
import atexit, sys, torch, ckptfmt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ckptfmt.files.signfile import sign_file
run, what = sys.argv[1], sys.argv[2]
key = Ed25519PrivateKey.generate()
manager = ckptfmt.CheckpointManager(run, sign_with=key, incremental=True)
manager.save(1, {"w": torch.ones(4), "big": torch.arange(100000.0)})

@atexit.register
def final():
    try:
        if what == "file":
            ckptfmt.save({"w": torch.ones(4)}, run + "/f.ckpt")
            sign_file(run + "/f.ckpt", key)
            ckptfmt.load(run + "/f.ckpt", trusted_keys=[key.public_key()])
        else:  # the step's record names state.ckpt and the base it refers to: two files hashed
            manager.save(2, {"w": torch.ones(4) * 2, "big": torch.arange(100000.0)})
            got = ckptfmt.CheckpointManager(run, trusted_keys=[key.public_key()]).load(2)
            assert torch.equal(got["w"], torch.ones(4) * 2)
        print("saved", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, e, flush=True)
"""


@pytest.mark.parametrize("what", ["incremental step", "file"])
def test_a_signed_save_in_an_atexit_handler_is_whole(tmp_path, what):
    done = _run_child(_SIGNED_AT_EXIT, str(tmp_path / "run"), what)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "saved", done.stdout + done.stderr[-3000:]

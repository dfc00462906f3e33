"""Hostile and odd input to the Lightning plugin's checkpoints on fsspec URLs (transfer.py):
remote names that mean something else locally, files that change or never end while they are
downloaded, uploads that fail half way, credentials in URLs.  Real fsspec filesystems
(``memory://``, and ``http://`` from a local server); the filesystems subclassed here stand
for a store that misbehaves, never for ckptfmt's own code."""

from __future__ import annotations

import importlib.util

import pytest
import test_lightning_fsspec
import torch
from test_lightning_fsspec import _plugin

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
    io = _plugin(blocking=blocking)
    url = f"{root}/sub/{name}"
    io.save_checkpoint({"w": torch.arange(5.0)}, url)
    io.teardown()
    assert torch.equal(io.load_checkpoint(url)["w"], torch.arange(5.0))

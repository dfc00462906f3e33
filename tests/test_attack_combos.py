"""Features in combination, attacked: background DCP saves staged in different ways, ..."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptfmt import dcp as cdcp


def test_a_background_save_waits_for_the_last_one_whatever_staged_it(tmp_path: Path) -> None:
    """Two background saves in flight run their collectives on the same group in threads of their
    own (a deadlock across ranks): each waits for the one before, also when another Stager (or
    the default one) staged that."""
    state = {"w": torch.randn(16 << 20)}  # 64 MiB: written well after the next one is staged
    first = cdcp.async_save(state, str(tmp_path / "a"))  # the default Stager
    second = cdcp.async_save(state, str(tmp_path / "b"), stager=cdcp.Stager())
    assert first.done()
    third = cdcp.async_save(state, str(tmp_path / "c"), stager=cdcp.Stager())
    assert second.done()
    fourth = cdcp.async_save(state, str(tmp_path / "d"))  # the default Stager after another
    assert third.done()
    fourth.result(timeout=120)
    back = {"w": torch.zeros(16 << 20)}
    cdcp.load(back, str(tmp_path / "d"))
    assert torch.equal(back["w"], state["w"])

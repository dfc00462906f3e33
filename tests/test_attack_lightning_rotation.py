"""ModelCheckpoint's rotation (save_top_k) with non-blocking saves: Lightning removes the
checkpoint a new one replaces right after the new one's save returns, while its file is still
being written.  The older checkpoint must stay until the new one is committed, or a process
killed in between (out of memory, a scheduler's SIGKILL) is left with no checkpoint at all."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptfmt

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs ckptfmt[lightning]"
)

#: a module large enough (64 MiB of parameters) that its save is still being written when the
#: batch after it starts; the checks below hold whatever the timing once the rotation is right
_MODULE = textwrap.dedent(
    """
    import os, sys
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    def committed(directory):
        # a ckptfmt save has its final name only once it is committed (a temp name before)
        return sorted(n for n in os.listdir(directory) if n.endswith(".ckpt") and not n.startswith("."))

    class Big(pl.LightningModule):
        def __init__(self, out, kill_at):
            super().__init__()
            self.out, self.kill_at = out, kill_at
            self.big = nn.Parameter(torch.randn(4096, 4096))
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y) + 0 * self.big.sum()

        def on_train_batch_end(self, *args):
            # runs after every callback's: ModelCheckpoint has saved this step and removed the
            # one the new save replaces
            if self.global_step == 1:
                self.trainer.strategy.checkpoint_io.wait()  # step 1's save is committed
            print("COMMITTED", self.global_step, " ".join(committed(self.out)), flush=True)
            if self.global_step == self.kill_at:
                os.kill(os.getpid(), 9)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    def fit(out, kill_at, steps):
        x = torch.randn(64, 4)
        data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
        mc = ModelCheckpoint(dirpath=out, monitor="step", mode="max", save_top_k=1, every_n_train_steps=1)
        trainer = pl.Trainer(max_steps=steps, plugins=[CkptfmtCheckpointIO(blocking=False)], callbacks=[mc],
                             logger=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Big(out, kill_at), data)

    fit(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    """
)


def _run(out: pathlib.Path, kill_at: int, steps: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", _MODULE, str(out), str(kill_at), str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _committed_at_batch_ends(stdout: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("COMMITTED "):
            step, *names = line.split()[1:]
            out[int(step)] = names
    return out


def test_a_process_killed_right_after_a_save_keeps_a_checkpoint(tmp_path: pathlib.Path) -> None:
    """save_top_k=1, non-blocking saves, step 1's save committed, SIGKILL right after step 2's
    save returned (and ModelCheckpoint asked for step 1's removal): step 1's checkpoint (or step
    2's, had it committed already) is there and verifies."""
    out = tmp_path / "ckpts"
    proc = _run(out, kill_at=2, steps=6)
    assert proc.returncode == -9, proc.stderr[-3000:]
    seen = _committed_at_batch_ends(proc.stdout)
    assert seen == {1: ["epoch=0-step=1.ckpt"], 2: ["epoch=0-step=1.ckpt"]}, proc.stdout
    left = sorted(n for n in os.listdir(out) if n.endswith(".ckpt") and not n.startswith("."))
    assert left, f"the killed run left no checkpoint: {sorted(os.listdir(out))}"
    for name in left:
        assert ckptfmt.verify(str(out / name)).ok, name


def test_rotation_still_keeps_top_k_once_the_saves_are_done(tmp_path: pathlib.Path) -> None:
    """The removals wait for the saves in flight, and are made: at the end of fit only the
    newest checkpoint is left (save_top_k=1), whole."""
    out = tmp_path / "ckpts"
    proc = _run(out, kill_at=-1, steps=5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["epoch=0-step=5.ckpt"]
    assert ckptfmt.verify(str(out / "epoch=0-step=5.ckpt")).ok


def test_a_removal_is_dropped_where_a_new_save_takes_its_path(tmp_path: pathlib.Path) -> None:
    """A removal waiting for the saves in flight is for the file there when it was asked for:
    a save made to that path afterwards is never deleted by it."""
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    io = CkptfmtCheckpointIO(blocking=False, restore_rng=False)
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    big = torch.randn(2048, 2048)
    io.save_checkpoint({"v": torch.zeros(1)}, a)
    io.wait()
    io.save_checkpoint({"v": torch.ones(1), "big": big}, b)
    io.remove_checkpoint(a)  # the save of b may still be in flight
    io.save_checkpoint({"v": torch.full((1,), 2.0)}, a)  # a new save at that path
    io.wait()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt"]
    assert ckptfmt.load(a)["v"].item() == 2.0


def test_a_removal_that_fails_is_logged_and_the_next_save_is_made(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A removal that cannot be made (here the path has become a directory) never stops the
    save after it: the new checkpoint is written, the failure is a WARNING naming the path."""
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    io = CkptfmtCheckpointIO(blocking=False, restore_rng=False)
    a, b, c = (str(tmp_path / n) for n in ("a.ckpt", "b.ckpt", "c.ckpt"))
    io.save_checkpoint({"v": torch.zeros(1)}, a)
    io.wait()
    os.unlink(a)
    os.makedirs(os.path.join(a, "not-a-checkpoint"))
    io.save_checkpoint({"v": torch.ones(1), "big": torch.randn(2048, 2048)}, b)
    with caplog.at_level("WARNING", logger="ckptfmt"):
        io.remove_checkpoint(a)  # made now, or deferred until b's save is committed
        io.save_checkpoint({"v": torch.full((1,), 2.0)}, c)
        try:
            io.wait()
        except IsADirectoryError:  # the removal was made by wait(), which raises it (no save failed)
            pass
    assert ckptfmt.load(c)["v"].item() == 2.0
    assert os.path.isdir(a)
    assert any(r.levelname == "WARNING" and a in r.getMessage() for r in caplog.records), caplog.text


_EXIT_WITHOUT_TEARDOWN = textwrap.dedent(
    """
    import os, sys
    import torch
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    out = sys.argv[1]
    io = CkptfmtCheckpointIO(blocking=False, restore_rng=False)
    a, b = os.path.join(out, "a.ckpt"), os.path.join(out, "b.ckpt")
    io.save_checkpoint({"v": torch.zeros(1)}, a)
    io.wait()
    io.save_checkpoint({"v": torch.ones(1), "big": torch.randn(4096, 4096)}, b)
    io.remove_checkpoint(a)
    if not io._saves().removals._pending:
        sys.exit(3)  # b was committed already: the removal was made at once
    # the process ends here, with neither wait() nor teardown()
    """
)


def test_a_removal_still_waiting_at_exit_is_made_once_the_save_committed(tmp_path: pathlib.Path) -> None:
    """Fabric and direct users may exit without teardown: the removal waiting for the save in
    flight is made at exit, after that save committed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_TEARDOWN, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 3:
        pytest.skip("the save committed before the removal was asked for: nothing was deferred")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]
    assert ckptfmt.verify(str(tmp_path / "b.ckpt")).ok


#: a real Trainer whose last save is still in flight when the process exits, with the removal
#: of the checkpoint it replaces waiting for it: made by a callback's on_fit_end (after the
#: strategy's teardown waited for the fit's saves) or by an atexit handler registered after
#: ckptfmt's (atexit handlers run last-registered first: it runs before ckptfmt's).  Every
#: removal is watched: it must find the final checkpoint committed.
_EXIT_WITH_A_SAVE_IN_FLIGHT = textwrap.dedent(
    """
    import atexit, os, sys
    import torch
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import ckptfmt
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO
    from ckptfmt.integrations.lightning import plugin as plugin_module

    out, when = sys.argv[1], sys.argv[2]
    old, new = os.path.join(out, "old.ckpt"), os.path.join(out, "final.ckpt")
    remove_now = plugin_module._remove_now

    def watched_remove(where, options):  # the real removal, told what it finds first
        print("REMOVED, final committed:", os.path.exists(new) and ckptfmt.verify(new).ok, flush=True)
        remove_now(where, options)

    plugin_module._remove_now = watched_remove

    class Big(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.big = nn.Parameter(torch.randn(4096, 4096))  # 64 MiB: its save takes a while
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y) + 0 * self.big.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    def final(trainer):
        trainer.save_checkpoint(new)  # non-blocking: in flight
        in_flight = not os.path.exists(new)  # its final name appears once it is committed
        trainer.strategy.remove_checkpoint(old)
        print("IN FLIGHT" if in_flight else "COMMITTED ALREADY", flush=True)

    class Final(pl.Callback):
        def on_fit_end(self, trainer, module):  # after the strategy's teardown
            trainer.save_checkpoint(old)
            trainer.strategy.checkpoint_io.wait()
            if when == "on_fit_end":
                final(trainer)

    x = torch.randn(16, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=2, plugins=[CkptfmtCheckpointIO(blocking=False)], callbacks=[Final()], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Big(), data)
    if when == "atexit":
        atexit.register(final, trainer)
    """
)


@pytest.mark.parametrize("when", ["on_fit_end", "atexit"])
def test_a_trainer_exiting_with_a_save_in_flight_removes_nothing_before_it_commits(
    tmp_path: pathlib.Path, when: str
) -> None:
    """The removal a save in flight holds back is made at exit only once that save committed
    (the exit waits for it first): a kill at any instant leaves a whole checkpoint.  Saved by
    on_fit_end, the removal is made at exit; saved by an atexit handler that runs before
    ckptfmt's own, the removal finds the save still running and keeps the old file (one more
    than asked, never none)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_SAVE_IN_FLIGHT, str(tmp_path), when],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "COMMITTED ALREADY" in proc.stdout:
        pytest.skip("the final save committed before the removal was asked for: nothing was deferred")
    assert "IN FLIGHT" in proc.stdout, proc.stdout
    removals = [line for line in proc.stdout.splitlines() if line.startswith("REMOVED")]
    assert all(line.endswith("True") for line in removals), proc.stdout
    assert ckptfmt.verify(str(tmp_path / "final.ckpt")).ok
    left = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    if when == "on_fit_end":
        assert removals and left == ["final.ckpt"], (proc.stdout, left)
    else:
        assert left in (["final.ckpt"], ["final.ckpt", "old.ckpt"]), left
        assert ckptfmt.verify(str(tmp_path / left[-1])).ok

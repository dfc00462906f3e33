"""Crash safety: SIGKILL a saver at random moments; the path always holds a whole checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch
from crash_server import make_states

import ckptfmt
from ckptfmt.engine import commit

KILLS = int(os.environ.get("CKPTFMT_CRASH_KILLS", "80"))


def test_sigkill_during_saves_never_leaves_a_partial_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    states = make_states()
    ckptfmt.save(states[0], path)
    server = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "crash_server.py"), str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rng = random.Random(1234)
    seen_tags = set()
    temps_seen = 0
    temps_whole = 0
    try:
        for n in range(KILLS):
            server.stdin.write(f"{n}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            assert server.stdout.readline().strip() == "reaped"
            # the target is always a whole, valid checkpoint: the old one or the new one
            report = ckptfmt.verify(path)
            assert report.ok, f"kill {n}: {report.problems}"
            loaded = ckptfmt.load(path)
            tag = loaded["tag"]
            seen_tags.add(tag)
            expected = states[tag]
            assert loaded["model"].keys() == expected["model"].keys()
            for k, v in expected["model"].items():
                assert torch.equal(loaded["model"][k], v), f"kill {n}: {k} differs"
            assert torch.equal(loaded["step"], expected["step"])
            temps = list(commit.iter_temp_files(str(path)))
            temps_seen += bool(temps)
            # Temps do not pile up: a save creates its own temp, then removes the ones killed
            # saves left (its temp's mtime is the filesystem's clock for their ages).  A kill
            # between those two steps (a window of well under a millisecond) leaves one more,
            # which the next save removes; after the loop one clean save leaves none.
            assert len(temps) <= 3, temps
            for t in temps:  # a temp is refused unless it was whole (killed between fsync and rename)
                try:
                    whole = ckptfmt.load(t)
                except ckptfmt.CheckpointError:
                    continue
                temps_whole += 1
                assert all(
                    torch.equal(whole["model"][k], v) for k, v in states[whole["tag"]]["model"].items()
                )
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    assert seen_tags == {0, 1}
    assert temps_seen > 0, "no kill landed inside a save; the test would prove nothing"
    print(f"{KILLS} kills, {temps_seen} inside a save, {temps_whole} after the temp was complete")
    ckptfmt.save(states[1], path)
    assert list(commit.iter_temp_files(str(path))) == []

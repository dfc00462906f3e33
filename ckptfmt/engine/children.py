"""Child processes this process forked (the writers of fork snapshots, csrc/snapshot.c): waits
for them with a deadline, and killing them.  Nothing here blocks without one."""

from __future__ import annotations

import os
import signal
import time

#: seconds a child sent SIGKILL is given to end (its exit unmaps its memory: a second or so
#: for a large process); one stuck in the kernel past that is beyond any signal, and left
KILL_GRACE = 60.0


def wait_child(pid: int, timeout: float) -> tuple[bool, int | None]:
    """Wait at most `timeout` seconds for the child `pid` to end, and reap it: (True, its wait
    status) once it has, (True, None) where something else reaped it (SIGCHLD ignored, a
    handler that waits for any child), (False, None) while it still runs."""
    end = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True, None
        if done:
            return True, status
        left = end - time.monotonic()
        if left <= 0:
            return False, None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.1)  # an exit is seen within 0.1 s, a quick one within a few ms


def stop_child(pid: int) -> int | None:
    """Kill a child nobody will wait for, and reap it (within KILL_GRACE): its wait status, or
    None where something else reaped it or it would not end."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return wait_child(pid, KILL_GRACE)[1]

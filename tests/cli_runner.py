"""The command line run in this process, as a subprocess would report it.

Each ``python -m ckptfmt`` costs a fresh interpreter and a torch import (seconds on a
2-core machine); ``main`` in this process gives the same status and output.  A few tests
still start the real entry point (test_cli.py) so that ``python -m ckptfmt`` itself stays
covered.
"""

from __future__ import annotations

import contextlib
import io
import subprocess

from ckptfmt.cli import main


def run_cli(*args: object, rc: int | None = None) -> subprocess.CompletedProcess[str]:
    """``ckptfmt ARGS`` in this process: its status (argparse's exits included) and output;
    with `rc`, assert the status first."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's usage errors and --help
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    proc = subprocess.CompletedProcess(["ckptfmt", *argv], status, out.getvalue(), err.getvalue())
    if rc is not None:
        assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc

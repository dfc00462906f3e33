"""A warm process for running the documentation's examples: it imports torch and the trainer
libraries once, then forks a fresh child for each request, so that ten pages and a dozen
`ckptfmt` commands do not each spend seconds importing torch on a busy 2-core machine.

A request comes over a Unix socket: a JSON header and the caller's stdin, stdout and stderr
(passed as file descriptors). The child takes them as its own, moves to the request's working
directory, replaces its environment with the request's, and runs either a page's examples
(`kind: "page"`: each Python block exec'd in one namespace, each shell block run by bash) or
ckptfmt's command line (`kind: "cli"`: `python -m ckptfmt ARGS`). ckptfmt itself is imported
by the child, never here, so an environment variable it reads at import (CKPTFMT_BACKEND ...)
takes effect as in a new process. The child answers with its pid, then its exit status.

    python tests/docs_zygote.py SOCKET           # serve until killed
    python -S tests/docs_zygote.py --cli ARGS    # the `ckptfmt` command of the shell examples
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import traceback
from typing import Any

SOCKET_ENV = "CKPTFMT_DOCS_ZYGOTE"
HEADER_MAX = 1 << 24
WORD = struct.Struct("!i")  # the pid, then the exit status


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    size_msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
    (size,) = WORD.unpack(size_msg)
    data = b""
    while len(data) < size:
        part = conn.recv(min(HEADER_MAX, size - len(data)))
        if not part:
            raise ConnectionError("the request ended early")
        data += part
    return json.loads(data), list(fds)


class ChildTimeout(TimeoutError):
    """A child ran past its time; `pid` is the child's (the caller kills it)."""

    def __init__(self, pid: int, timeout: float | None) -> None:
        super().__init__(f"child {pid} ran past {timeout} s")
        self.pid = pid


def request(path: str, header: dict[str, Any], fds: list[int], timeout: float | None) -> tuple[int, int]:
    """Send one request to the zygote at `path`; (the child's pid, its exit status).  Raises
    ChildTimeout past `timeout` seconds."""
    data = json.dumps(header).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(path)
        socket.send_fds(conn, [WORD.pack(len(data))], fds)
        conn.sendall(data)
        pid = WORD.unpack(_recv_exact(conn, 4))[0]
        try:
            status = WORD.unpack(_recv_exact(conn, 4))[0]
        except TimeoutError:
            raise ChildTimeout(pid, timeout) from None
    return pid, status


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("the zygote's child closed the connection without a status")
        data += part
    return data


def _run_page(blocks: list[list[Any]]) -> int:
    ns: dict[str, Any] = {"__name__": "__main__"}
    for path, line, lang, code in blocks:
        print(f"--- {path}:{line}", flush=True)
        if lang == "python":
            # the page's own line numbers in a traceback
            exec(compile("\n" * (line - 1) + code, path, "exec"), ns)
        else:
            subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], check=True)
    return 0


def _run_cli(argv: list[str]) -> int:
    import runpy

    sys.argv = ["ckptfmt", *argv]
    try:
        runpy.run_module("ckptfmt", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _child(conn: socket.socket, header: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the caller's descriptors, directory and environment, run, report."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # subprocess must wait for its children
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        conn.sendall(WORD.pack(os.getpid()))
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        sys.path.insert(0, header["root"])
        status = _run_page(header["blocks"]) if header["kind"] == "page" else _run_cli(header["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.sendall(WORD.pack(status))
        finally:
            os._exit(status)


def serve(path: str) -> None:
    import torch  # noqa: F401  (the seconds every child is spared)

    try:  # the trainer pages' libraries, where installed
        import lightning.pytorch  # noqa: F401
        from transformers import GPT2LMHeadModel, Trainer  # noqa: F401
    except ImportError:
        pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(16)
        print("ready", flush=True)
        while True:
            conn, _ = server.accept()
            header, fds = _recv_request(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                server.close()
                _child(conn, header, fds)
            for fd in fds:
                os.close(fd)
            conn.close()


def cli() -> int:
    """The `ckptfmt` command of the shell examples: ckptfmt's command line, run by the zygote."""
    header = {
        "kind": "cli",
        "argv": sys.argv[2:],
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "root": os.environ["PYTHONPATH"].split(os.pathsep)[0],
    }
    return request(os.environ[SOCKET_ENV], header, [0, 1, 2], None)[1]


if __name__ == "__main__":
    if sys.argv[1] == "--cli":
        sys.exit(cli())
    serve(sys.argv[1])

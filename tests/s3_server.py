"""A real S3-compatible HTTP server for the tests: moto's standalone server (`moto[server]`)
started as a subprocess on 127.0.0.1, spoken to over HTTP by the real client.

What moto 5.2.1's server does, measured with boto3 1.43 (tests/test_s3_server.py checks each):

* Conditional create: PutObject with `If-None-Match: *` answers 412 PreconditionFailed when
  the key exists and creates it otherwise; CompleteMultipartUpload with `If-None-Match: *`
  does the same (412 when the key exists; the existing object is kept).
* Conditional read: GetObject with `IfMatch` (ranged or not) answers 206/200 when the ETag
  matches and 412 PreconditionFailed when it does not; `IfNoneMatch` equal to the ETag: 304.
* Multipart: parts may be uploaded in any order under explicit part numbers; every part but
  the last must be at least 5 MiB (400 EntityTooSmall at completion, as on AWS; moto reads
  S3_UPLOAD_PART_MIN_SIZE from its environment to lower that); a completion naming a part
  never uploaded, or with a wrong ETag, answers 400 InvalidPart.  ListMultipartUploads lists
  open uploads; AbortMultipartUpload removes one (then ListParts answers 404 NoSuchUpload, but
  UploadPart to it answers 500, where AWS answers 404 NoSuchUpload).  A multipart object's
  ETag is `"<md5 of the part md5s>-<parts>"`.
* Ranges: a range running past the end is clipped (206, `Content-Range: bytes 3-10/11`); one
  starting past the end answers 416 InvalidRange.
* Cost: every GET, ranged or not, reads the whole object inside the server (objects over
  ~5 MiB are spooled to a temporary file), so N ranged GETs of an object of size S cost the
  server N * S bytes of copying: ranged reads of large objects are limited by the server,
  not the client.  Its HTTP server (Werkzeug's) answers every request with `Connection:
  close`, so each request pays a new TCP connection (the fault proxy keeps the client's
  connections alive, as a real store does).  boto3 sends `Expect: 100-continue` with every
  PutObject and UploadPart.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from types import TracebackType
from typing import Any

REGION = "us-east-1"
ACCESS_KEY = "ckptfmt-test-access-key"
SECRET_KEY = "ckptfmt-test-secret-key"  # a dummy: moto's server checks no signature
START_TIMEOUT = 30.0
PORT_TRIES = 5


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (another process may take it
    before we do: callers retry on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def storage_options(endpoint_url: str) -> dict[str, str]:
    """The storage_options a ckptfmt call takes to reach a test server at endpoint_url."""
    return {
        "endpoint_url": endpoint_url,
        "region": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
    }


def s3_client(endpoint_url: str, max_attempts: int | None = None, **config: Any) -> Any:
    """A boto3 S3 client for a test server; max_attempts: attempts in all, the first one
    included (1 turns retries off, so that an injected fault reaches the caller as it
    happened; botocore's own `retries={"max_attempts": n}` counts retries after the first,
    so n=1 still retries once); `config`: more botocore Config settings (read_timeout, ...)."""
    import boto3
    from botocore.config import Config

    if max_attempts is not None:
        config["retries"] = {"total_max_attempts": max_attempts}
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}, **config),
    )


def create_bucket(endpoint_url: str, name: str | None = None) -> str:
    """Create a bucket (a fresh, uniquely named one unless named) and return its name."""
    name = name or f"ckptfmt-test-{uuid.uuid4().hex[:16]}"
    s3_client(endpoint_url).create_bucket(Bucket=name)
    return name


def answers(endpoint_url: str) -> bool:
    """Whether an HTTP server answers at endpoint_url (any HTTP status counts)."""
    try:
        with urllib.request.urlopen(endpoint_url + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class S3Server:
    """moto's S3 server on a free port of 127.0.0.1, for the life of a `with` block.

    Its request log goes to a temporary file, read back (its tail) only to explain a server
    that did not start.
    """

    def __init__(self, start_timeout: float = START_TIMEOUT) -> None:
        self.start_timeout = start_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> dict[str, str]:
        return storage_options(self.endpoint_url)

    def client(self, max_attempts: int | None = None) -> Any:
        return s3_client(self.endpoint_url, max_attempts)

    def new_bucket(self, name: str | None = None) -> str:
        return create_bucket(self.endpoint_url, name)

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        problems = []
        for _ in range(PORT_TRIES):
            problem = self._start_on(free_port())
            if problem is None:
                return
            problems.append(problem)
            if "address already in use" not in problem.lower():
                break
        raise RuntimeError(f"moto's S3 server did not start: {problems[-1]}")

    def _start_on(self, port: int) -> str | None:
        """Start the server on port and wait until it answers; None, or why it did not start."""
        self.port = port
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                why = f"it exited with status {self._proc.returncode}: {self.log_tail()}"
                self.stop()
                return why
            if answers(self.endpoint_url):
                return None
            time.sleep(0.05)
        why = f"no answer at {self.endpoint_url} within {self.start_timeout:.0f} s: {self.log_tail()}"
        self.stop()
        return why

    def log_tail(self, nbytes: int = 2000) -> str:
        """The end of the server's output (its request log and errors)."""
        if self._log is None:
            return ""
        self._log.flush()
        size = self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, size - nbytes))
        return self._log.read().decode(errors="replace").strip()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

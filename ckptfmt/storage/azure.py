"""The Azure Blob Storage store (az:// and abfs:// URLs) over the Blob service's REST API,
through requests, signed with the account's Shared Key (or a SAS token).

Why this client: the Blob REST API is a handful of requests ckptfmt already makes of S3 and
GCS (a ranged GET, a PUT, blocks and a block list, a DELETE, a listing page), and requests is
already the GCS client; the azure-storage-blob SDK would add its own retries, buffering and
a large dependency for the same requests.  Credentials as Azure's own tools take them: the
connection string in AZURE_STORAGE_CONNECTION_STRING (what Azurite, the emulator, is reached
through), else AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN; storage
options ``connection_string``, ``account_name``, ``account_key``, ``sas_token`` override them.
Azure AD (Entra ID): storage option ``credential``, any object with azure-core's
``get_token(scope)`` (azure-identity's DefaultAzureCredential, a managed identity ...), whose
bearer token signs every request instead of a key (Azure's tools have no environment variable
holding a token: azure-identity's own credentials read theirs).  An account with none of these
takes azure-identity's DefaultAzureCredential (its environment service principal, workload
identity, managed identity, Azure CLI ...), as adlfs does, unless anonymous access is asked for
(storage option ``anon``, else AZURE_STORAGE_ANON, read as adlfs reads it).

Each guarantee by Azure's own mechanism: the version of a blob is its ETag; ranged reads name
it (``If-Match``); a commit record is created only if absent (``If-None-Match: *``); a
conditional delete names the ETag listed.  An upload in parts stores each part as an
uncommitted block of the blob (block ids carry the upload's id) and commits the block list,
which makes the blob appear whole, or not at all, in one request (``If-None-Match: *`` where
created only if absent).  Uncommitted blocks cost nothing to list or abort: Azure discards
them a week after their last block, so ``list_uploads`` is empty.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import hashlib
import hmac
import math
import os
import threading
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any

from ..errors import StorageError
from . import answers, client, http
from .store import WRITE_TOKEN, Entry, Head, Page, Reply, UploadPage, ViewFile
from .urls import ObjectURL

CONNECTION_VARIABLE = "AZURE_STORAGE_CONNECTION_STRING"
#: the entries (blobs and prefixes) one listing page is asked for (maxresults)
PAGE_ENTRIES = answers.PAGE_ENTRIES
ANON_VARIABLE = "AZURE_STORAGE_ANON"
API_VERSION = "2021-08-06"
#: the header of the blob metadata that holds a create-only write's token
TOKEN_HEADER = f"x-ms-meta-{WRITE_TOKEN}"
#: the scope of an Azure AD token for Azure Storage, and how long before its expiry a token
#: is asked for again
TOKEN_SCOPE = "https://storage.azure.com/.default"
TOKEN_MARGIN = 300.0
#: the longest a token is kept, whatever expiry its credential gives (Azure AD's tokens live
#: a day at most)
MAX_TOKEN_LIFE = 86400.0
#: how long a credential's get_token may stay unanswered before it is given up and one new
#: request started (a hung one keeps its daemon thread: at most one more each such period)
TOKEN_ASK_LIMIT = 300.0
#: the environment Azure's tools read (az CLI, the SDKs)
ENVIRONMENT = (
    CONNECTION_VARIABLE,
    "AZURE_STORAGE_ACCOUNT",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    ANON_VARIABLE,
    # what DefaultAzureCredential's chain is made from (a change to them makes a new store)
    "AZURE_TOKEN_CREDENTIALS",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_CLIENT_CERTIFICATE_PATH",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_AUTHORITY_HOST",
    "IDENTITY_ENDPOINT",
    "IDENTITY_HEADER",
    "IDENTITY_SERVER_THUMBPRINT",
    "IMDS_ENDPOINT",
    "MSI_ENDPOINT",
    "MSI_SECRET",
)
#: where no key, SAS token or credential is given: the chain azure-identity's
#: DefaultAzureCredential tries, for errors
DEFAULT_CHAIN = (
    "azure-identity's DefaultAzureCredential (AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, "
    "workload identity, managed identity, az login ...)"
)


def environment() -> tuple[tuple[str, str], ...]:
    names = (*ENVIRONMENT, client.DEADLINE_VARIABLE)
    return tuple((k, os.environ[k]) for k in names if k in os.environ)


class Account:
    """Where a storage account's blob service is and how requests to it are signed."""

    def __init__(
        self, endpoint: str, name: str, key: bytes | None, sas: str | None, credential: Any = None
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.name = name
        self.key = key
        self.sas = sas.lstrip("?") if sas else None
        #: an Azure AD credential (get_token): its bearer tokens sign requests, before a key
        self.credential = credential
        # the path of the endpoint (Azurite's /devstoreaccount1) is part of what is signed
        self.base_path = urllib.parse.urlsplit(self.endpoint).path


def account_from(options: Mapping[str, Any], named: str | None = None) -> Account:
    """The account of the storage options, else of the environment, else the one a URL
    `named` (adlfs's CONTAINER@ACCOUNT.dfs.core.windows.net); StorageError naming what is
    missing or malformed, or where the credentials are another account's than the URL's."""
    text = options.get("connection_string") or (
        None
        if {"account_name", "account_key", "sas_token"} & set(options)
        else os.environ.get(CONNECTION_VARIABLE)
    )
    if text:
        fields = _connection_fields(str(text))
        name = fields.get("AccountName", "")
        endpoint = fields.get("BlobEndpoint") or (
            f"{fields.get('DefaultEndpointsProtocol', 'https')}://{name}.blob."
            f"{fields.get('EndpointSuffix', 'core.windows.net')}"
        )
        key, sas = fields.get("AccountKey"), fields.get("SharedAccessSignature")
    else:
        name = str(options.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT") or named or "")
        endpoint = f"https://{name}.blob.core.windows.net"
        key = options.get("account_key") or os.environ.get("AZURE_STORAGE_KEY")
        sas = options.get("sas_token") or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    if not name and not sas:
        raise StorageError(
            "az:// URLs need an account: AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT "
            "with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or the storage options "
            "connection_string, account_name, account_key, sas_token"
        )
    if named is not None and name != named:
        raise StorageError(
            f"the URL names the storage account {named!r} but the credentials are for {name!r} "
            "(the connection string, account_name, AZURE_STORAGE_ACCOUNT)"
        )
    credential = options.get("credential")
    anonymous = _anonymous(options)
    signers = [n for n, v in (("account key", key), ("SAS token", sas), ("credential", credential)) if v]
    if options.get("anon") is True and signers:  # unsigned requests cannot carry them
        raise StorageError(f"storage option anon=True cannot be honoured with a {signers[0]}")
    if credential is not None and (key or sas):  # one way to sign each request: say which
        raise StorageError(
            f"storage option credential cannot be honoured beside a {signers[0]}: give one of them"
        )
    if credential is not None:
        if not callable(getattr(credential, "get_token", None)):
            raise StorageError(
                "storage option credential must have azure-core's get_token(scope), "
                f"not be a {type(credential).__name__}"
            )
        return Account(endpoint, name, None, None, credential)
    if not key and not sas:
        # adlfs's rule (AzureBlobFileSystem.__init__): no credential, key, SAS token (or, in
        # adlfs, connection string) and not anonymous: DefaultAzureCredential.  A connection
        # string holding neither key nor SAS only says where the account is (an emulator, a
        # private endpoint): it takes the chain too, where adlfs would be anonymous; ckptfmt
        # is anonymous only where asked.
        if anonymous:
            return Account(endpoint, name, None, None)
        return Account(endpoint, name, None, None, default_credential(name))
    try:
        secret = base64.b64decode(str(key), validate=True) if key else None
    except ValueError:
        raise StorageError(f"the key of the account {name!r} is not base64") from None
    return Account(endpoint, name, secret, str(sas) if sas else None)


def _anonymous(options: Mapping[str, Any]) -> bool:
    """Whether requests go unsigned (public containers): storage option anon, else
    AZURE_STORAGE_ANON as adlfs reads it (anything but "false", "0", "f" or empty is true)."""
    if "anon" in options:
        if not isinstance(options["anon"], bool):
            raise StorageError(f"storage option anon must be True or False, not {options['anon']!r}")
        return options["anon"]
    return os.environ.get(ANON_VARIABLE, "false").lower() not in ("false", "0", "f", "")


def default_credential(name: str) -> Any:
    """azure-identity's DefaultAzureCredential, with its own defaults (as adlfs makes it: a
    user's az login is part of the chain); StorageError saying what to install where
    azure-identity is missing."""
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise StorageError(
            f"az:// URLs of the account {name!r} with no key or SAS token (AZURE_STORAGE_KEY, "
            f"AZURE_STORAGE_SAS_TOKEN, the connection string's, storage options account_key, "
            f"sas_token) nor storage option credential take {DEFAULT_CHAIN}: pip install "
            f"azure-identity (or set {ANON_VARIABLE}=true for public containers)"
        ) from None
    try:
        return DefaultAzureCredential()
    except ValueError as e:  # an AZURE_TOKEN_CREDENTIALS it does not know
        raise StorageError(f"azure-identity's DefaultAzureCredential refused its settings: {e}") from None


def _connection_fields(text: str) -> dict[str, str]:
    fields = {}
    for part in text.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name.strip()] = value.strip()
    return fields


def new_store(options: Mapping[str, Any], account: str | None = None) -> AzureStore:
    """The store of the account of `options` (or the environment), which must be `account`
    where a URL names one."""
    return AzureStore(
        http.new_session(options, "az"), account_from(options, account), client.timeouts(options)
    )


class AzureStore:
    """The Store interface (storage/store.py) over the Blob service's REST API."""

    scheme = "az"
    version_name = "ETag"
    pin_is_advisory = True
    parts_outlive_completion = False

    def __init__(self, session: Any, account: Account, timeouts: tuple[float, float]) -> None:
        self.session = session
        self.account = account
        self.timeouts = timeouts
        self._token: tuple[str, float] | None = None  # the bearer token and when it expires
        self._asking: _TokenAsk | None = None  # the credential's get_token under way
        self._token_lock = threading.Lock()

    # -- requests ----------------------------------------------------------------------

    def _call(
        self,
        method: str,
        url: ObjectURL,
        key: str | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        data: Any = None,
        length: int = 0,
    ) -> Any:
        """One signed request to the blob `key` of `url`'s container (None: the container
        itself); AnswerError for a status of 300 or more, naming Azure's error code."""
        path = f"/{urllib.parse.quote(url.bucket, safe='')}"
        if key is not None:
            path += "/" + urllib.parse.quote(key, safe="/")
        params = dict(params or {})
        headers = {"x-ms-version": API_VERSION, "x-ms-date": email.utils.formatdate(usegmt=True)} | (
            headers or {}
        )
        if method in ("PUT", "POST"):
            headers["Content-Length"] = str(length)
        if self.account.credential is not None:
            headers["Authorization"] = f"Bearer {self._bearer(url, key)}"
        elif self.account.key is not None:
            headers["Authorization"] = self._signature(method, path, params, headers)
        query = urllib.parse.urlencode(sorted(params.items()))
        if self.account.sas and self.account.key is None and self.account.credential is None:
            query = f"{query}&{self.account.sas}" if query else self.account.sas
        target = f"{self.account.endpoint}{path}" + (f"?{query}" if query else "")
        return http.send(self.session, method, target, self.timeouts, _code, data=data, headers=headers)

    def _bearer(self, url: ObjectURL, key: str | None) -> str:
        """The credential's token for Azure Storage, asked for again TOKEN_MARGIN seconds
        before it expires (as azure-core's own policy does); StorageError naming the URL
        where the credential fails, answers something else than a token, or gives none
        within what remains of the operation's deadline.  One request for a token at a time:
        an operation finding one under way (a credential that hangs) waits for that one,
        unless it has been under way for TOKEN_ASK_LIMIT seconds: then a new one is made."""
        with self._token_lock:
            if self._token is not None and self._token[1] - time.time() >= TOKEN_MARGIN:
                return self._token[0]
            ask = self._asking
            if ask is None or ask.overdue():
                ask = self._asking = _TokenAsk(self.account.credential)
        where = str(url.with_key(key)) if key is not None else str(url)
        if not ask.done.wait(http.time_left()):
            budget = client.current_budget()
            limit = budget.deadline if budget is not None else client.DEFAULT_DEADLINE
            raise StorageError(
                f"the Azure AD credential's token for {TOKEN_SCOPE} "
                f"{client.missed_deadline(limit, 'deadline')}",
                path=where,
            )
        with self._token_lock:
            if self._asking is ask:  # its answer is taken: the next one needed is asked afresh
                self._asking = None
        token = ask.token(where)
        with self._token_lock:
            self._token = token
        return token[0]

    def _signature(self, method: str, path: str, params: dict[str, str], headers: dict[str, str]) -> str:
        """The Authorization header of a request signed with the account's Shared Key."""
        assert self.account.key is not None
        h = {k.lower(): v for k, v in headers.items()}
        length = h.get("content-length", "")
        standard = [
            method,
            h.get("content-encoding", ""),
            h.get("content-language", ""),
            "" if length == "0" else length,
            h.get("content-md5", ""),
            h.get("content-type", ""),
            "",  # Date: x-ms-date is sent instead
            h.get("if-modified-since", ""),
            h.get("if-match", ""),
            h.get("if-none-match", ""),
            h.get("if-unmodified-since", ""),
            h.get("range", ""),
        ]
        ms = "".join(f"{k}:{v.strip()}\n" for k, v in sorted(h.items()) if k.startswith("x-ms-"))
        resource = f"/{self.account.name}{self.account.base_path}{path}"
        resource += "".join(f"\n{k.lower()}:{v}" for k, v in sorted(params.items()))
        text = "\n".join(standard) + "\n" + ms + resource
        digest = hmac.new(self.account.key, text.encode("utf-8"), hashlib.sha256).digest()
        return f"SharedKey {self.account.name}:{base64.b64encode(digest).decode()}"

    def _listing(self, url: ObjectURL, params: dict[str, str]) -> tuple[ET.Element, object]:
        """A listing's XML, read within the operation's deadline, bounded in bytes and in what
        parsing it builds (answers.parse_xml), and refused where it declares a DTD (entities
        are never expanded); and the answer's Date header as sent (None where none came)."""
        answer = self._call("GET", url, None, params)
        body = http.read_answer(answer, "a listing's answer")
        return answers.parse_xml(body, answers.page_nodes(PAGE_ENTRIES)), answer.headers.get("Date")

    # -- reading ---------------------------------------------------------------------

    def head(self, url: ObjectURL) -> Head:
        answer = self._call("HEAD", url, url.key)
        answer.close()
        headers = answer.headers
        token = headers.get(TOKEN_HEADER)
        return Head(http.size_of(headers.get("Content-Length")), headers.get("ETag"), token)

    def get(self, url: ObjectURL, byte_range: tuple[int, int] | None, version: str | None) -> Reply:
        headers = {}
        if byte_range is not None:
            headers["x-ms-range"] = f"bytes={byte_range[0]}-{byte_range[1] - 1}"
        if version is not None:
            headers["If-Match"] = version
        answer = self._call("GET", url, url.key, headers=headers)
        return Reply(
            http.size_of(answer.headers.get("Content-Length")),
            answer.headers.get("Content-Range"),
            answer.headers.get("ETag"),
            http.body_of(answer),
        )

    # -- writing ---------------------------------------------------------------------

    def put(
        self, url: ObjectURL, body: memoryview, *, if_absent: bool, token: str | None = None
    ) -> str | None:
        headers = {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream"}
        headers |= _metadata(token)
        if if_absent:
            headers["If-None-Match"] = "*"
        answer = self._call("PUT", url, url.key, headers=headers, data=ViewFile(body), length=len(body))
        answer.close()
        return _etag(answer.headers.get("ETag"))

    def start_upload(self, url: ObjectURL, token: str | None = None) -> str:
        return uuid.uuid4().hex[:16]  # the block ids carry it: nothing to ask the store

    def put_part(self, url: ObjectURL, upload_id: str, number: int, body: memoryview) -> str:
        block = _block_id(upload_id, number)
        params = {"comp": "block", "blockid": block}
        answer = self._call("PUT", url, url.key, params, data=ViewFile(body), length=len(body))
        answer.close()
        return block

    def complete_upload(
        self,
        url: ObjectURL,
        upload_id: str,
        parts: dict[int, str],
        *,
        if_absent: bool,
        token: str | None = None,
    ) -> str | None:
        listed = "".join(f"<Latest>{parts[n]}</Latest>" for n in sorted(parts))
        data = f'<?xml version="1.0" encoding="utf-8"?><BlockList>{listed}</BlockList>'.encode()
        headers = {"Content-Type": "application/xml"} | ({"If-None-Match": "*"} if if_absent else {})
        headers |= _metadata(token)  # Put Block List sets the blob's metadata
        answer = self._call("PUT", url, url.key, {"comp": "blocklist"}, headers, data, len(data))
        answer.close()
        return _etag(answer.headers.get("ETag"))

    def abort_upload(self, url: ObjectURL, upload_id: str) -> None:
        pass  # uncommitted blocks are discarded by Azure; nothing is visible meanwhile

    # -- deleting --------------------------------------------------------------------

    def delete(self, url: ObjectURL, version: str | None) -> None:
        self._delete(url, url.key, version)

    def _delete(self, url: ObjectURL, key: str, version: str | None) -> None:
        headers = {"If-Match": version} if version is not None else {}
        try:
            self._call("DELETE", url, key, headers=headers).close()
        except client.AnswerError as e:
            if e.status != 404:  # absent is no error
                raise

    def delete_many(self, url: ObjectURL, keys: list[str]) -> None:
        for key in keys:
            self._delete(url, key, None)

    # -- listing ---------------------------------------------------------------------

    def list_page(self, url: ObjectURL, prefix: str, delimiter: str | None, token: object) -> Page:
        params = {"restype": "container", "comp": "list", "prefix": prefix, "maxresults": str(PAGE_ENTRIES)}
        if delimiter:
            params["delimiter"] = delimiter
        if token is not None:
            params["marker"] = str(token)
        root, date = self._listing(url, params)
        blobs = root.find("Blobs")
        entries: list[Entry] = []
        prefixes: list[object] = []
        for node in list(blobs) if blobs is not None else []:
            if node.tag == "BlobPrefix":
                prefixes.append(node.findtext("Name"))
            elif node.tag == "Blob":
                props = node.find("Properties")
                entries.append(
                    Entry(
                        node.findtext("Name"),
                        http.size_of(props.findtext("Content-Length") if props is not None else None),
                        _time(props.findtext("Last-Modified") if props is not None else None),
                        _quoted(props.findtext("Etag") if props is not None else None),
                    )
                )
        answers.check_page_size(len(entries) + len(prefixes))
        following = root.findtext("NextMarker") or None
        return Page(entries, prefixes, following is not None, following, date)

    def list_uploads(self, url: ObjectURL, prefix: str, marker: dict[str, str]) -> UploadPage:
        return UploadPage([], False)  # see abort_upload


class _TokenAsk:
    """One credential.get_token(TOKEN_SCOPE), on a thread of its own: a credential's own waits
    (a managed-identity endpoint's retries, a CLI's subprocess) know nothing of an operation's
    deadline, so each operation waits for it at most what remains of its own.  A call that
    never returns keeps its thread (a daemon), and no other is started beside it until it is
    overdue."""

    def __init__(self, credential: Any) -> None:
        self.done = threading.Event()
        self.started = time.monotonic()
        self._got: object = None
        self._error: Exception | None = None
        worker = threading.Thread(
            target=self._ask, args=(credential,), name="ckptfmt-azure-token", daemon=True
        )
        worker.start()

    def overdue(self) -> bool:
        """Whether it is still unanswered TOKEN_ASK_LIMIT seconds after it started."""
        return not self.done.is_set() and time.monotonic() - self.started >= TOKEN_ASK_LIMIT

    def _ask(self, credential: Any) -> None:
        try:
            self._got = credential.get_token(TOKEN_SCOPE)
        except Exception as e:  # the credential's own errors (azure-identity's, ...)
            self._error = e
        finally:
            self.done.set()

    def token(self, where: str) -> tuple[str, float]:
        """(token, expiry as a time.time()) of the answer once done; StorageError naming
        `where` for an error or anything but a token (its text quoted without secrets).  An
        expiry past MAX_TOKEN_LIFE from now is taken as that: a token is asked for again at
        least that often, whatever an endpoint says (a far expiry would keep one for ever)."""
        if self._error is not None:
            e = self._error
            raise StorageError(
                f"the Azure AD credential gave no token for {TOKEN_SCOPE}: "
                f"{type(e).__name__}: {client.quoted(str(e))}",
                path=where,
            )
        token, expires = getattr(self._got, "token", None), getattr(self._got, "expires_on", None)
        if not isinstance(token, str) or not token or not _is_time(expires):
            raise StorageError(
                "the Azure AD credential's get_token answered no (token, expires_on)", path=where
            )
        assert isinstance(expires, (int, float))
        bounded = float(max(-(2**53), min(expires, 2**53)))  # an int of any size, either sign
        return token, min(bounded, time.time() + MAX_TOKEN_LIFE)


def _is_time(value: object) -> bool:
    """Whether `value` is a number of seconds since the epoch (finite, not a bool)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)  # of any size: token() bounds it


def _code(answer: Any) -> str:
    """Azure's error code for a refused request (its x-ms-error-code header, which HEAD
    answers carry too); the status where there is none."""
    return str(answer.headers.get("x-ms-error-code") or answer.status_code)[:100]


def _metadata(token: str | None) -> dict[str, str]:
    """The header storing a write's token as the blob's metadata (none where no token)."""
    return {TOKEN_HEADER: token} if token is not None else {}


def _block_id(upload_id: str, number: int) -> str:
    """A block's id: of one length for every block of a blob (Azure's rule), naming the
    upload, so two uploads of one blob never commit each other's blocks."""
    return base64.b64encode(f"{upload_id}-{number:05d}".encode()).decode()


def _quoted(etag: str | None) -> str | None:
    """A listing's ETag in the form its headers give (quoted), which conditions name."""
    return f'"{etag}"' if etag and not etag.startswith('"') else etag


def _etag(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _time(value: str | None) -> datetime.datetime | None:
    if not value or len(value) > 64:
        return None
    try:
        return email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None

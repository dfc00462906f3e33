"""What the stores spoken to over plain HTTP (gcs, azure) share: a requests session made for
ckptfmt's requests, and an answer's body as download.read_body reads it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError
from . import client


def import_requests(scheme: str) -> Any:
    try:
        import requests
    except ImportError:
        extra = {"gs": "gcs", "az": "azure"}.get(scheme, scheme)
        raise CheckpointError(f"{scheme}:// URLs need requests: pip install 'ckptfmt[{extra}]'") from None
    return requests


def new_session(options: Mapping[str, Any], scheme: str, session: Any = None) -> Any:
    """`session` (a plain requests session where None) made ready: a connection pool for
    the transfers' concurrency, requests' retries off (client.request retries), bodies not
    compressed in transit (they are read raw, bounded, within deadlines), and requests'
    and urllib3's errors counted as a request's failures."""
    requests = import_requests(scheme)
    import urllib3

    client.add_transfer_errors(requests.RequestException, urllib3.exceptions.HTTPError)
    session = requests.Session() if session is None else session
    size = max(10, 2 * client.concurrency(options))
    adapter = requests.adapters.HTTPAdapter(pool_connections=size, pool_maxsize=size, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers["Accept-Encoding"] = "identity"
    return session


class Body:
    """An answer's body as download.read_body reads it: readinto, close, and the urllib3
    answer (``_raw_stream``) its watchdog cuts."""

    def __init__(self, answer: Any) -> None:
        self._answer = answer
        self._raw_stream = answer.raw

    def readinto(self, view: memoryview) -> int:
        return int(self._raw_stream.readinto(view))

    def close(self) -> None:
        self._answer.close()


def size_of(value: object) -> object:
    """A size a store gives as a decimal string, as an int; any other value as it came
    (refused by the caller's checks)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return value


def send(
    session: Any,
    method: str,
    url: str,
    timeouts: tuple[float, float],
    reason: Callable[[Any], str],
    **kwargs: Any,
) -> Any:
    """One request, its answer's body not yet read (streamed, never redirected: a store
    answers where it was asked); AnswerError for a status of 300 or more, with the store's
    `reason` for it."""
    answer = session.request(method, url, timeout=timeouts, stream=True, allow_redirects=False, **kwargs)
    if answer.status_code >= 300:
        why = reason(answer)
        answer.close()
        raise client.AnswerError(why, answer.status_code)
    return answer


def read_answer(answer: Any, what: str) -> bytes:
    """The whole body of `answer`, read within what remains of the operation's deadline and
    refused above client.MAX_LISTING_BODY before it is parsed (client.read_listing)."""
    budget = client.current_budget()
    timeout = budget.remaining() if budget is not None else client.DEFAULT_DEADLINE
    try:
        return client.read_listing(answer.raw, max(timeout, 0.001), what)
    finally:
        answer.close()

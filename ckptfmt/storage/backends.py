"""Which store serves a URL: one shared Store (storage/store.py) per scheme, storage options
and environment, its module (and client package) imported only when its scheme is used."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ..errors import StorageError, UnsupportedError
from . import client
from .store import Store
from .urls import ObjectURL

_stores: dict[tuple[object, ...], Store] = {}
_lock = threading.Lock()


def store_for(url: ObjectURL, options: Mapping[str, Any]) -> Store:
    """The shared store for `url`'s scheme and these (checked) storage options: options that
    do not apply to the scheme are refused (UnsupportedError)."""
    options = client.check_options(options)  # some callers hand theirs on unchecked
    module = _module(url.scheme)
    takes = client.STORE_OPTIONS[url.scheme] + client.TUNING_OPTIONS
    foreign = sorted(set(options) - set(takes))
    if foreign:
        raise UnsupportedError(
            f"storage option {foreign[0]!r} does not apply to {url.scheme}:// URLs "
            f"(they take {', '.join(takes)})",
            path=str(url),
        )
    cache_key = (url.scheme, tuple(sorted((k, repr(v)) for k, v in options.items())), module.environment())
    with _lock:
        found = _stores.get(cache_key)
        if found is None:
            try:
                found = _stores[cache_key] = module.new_store(options)
            except StorageError as e:
                if e.path is not None:
                    raise
                raise StorageError(e.reason, path=str(url)) from None  # credentials: where needed
        return found


def _module(scheme: str) -> Any:
    """The module of `scheme`'s store (urls.parse_url admits only the schemes served)."""
    if scheme == "gs":
        from . import gcs

        return gcs
    if scheme in ("az", "abfs"):
        from . import azure

        return azure
    from . import s3

    return s3

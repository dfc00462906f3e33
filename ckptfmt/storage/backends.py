"""Which store serves a URL: one shared Store (storage/store.py) per scheme, storage options
and environment, its module (and client package) imported only when its scheme is used."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from ..errors import StorageError, UnsupportedError
from . import client
from .store import Store
from .urls import ObjectURL

_stores: dict[tuple[object, ...], Store] = {}
_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child makes stores of its own: the parent's hold its connections (a pooled
    socket read by two processes mixes their answers) and threads the child lacks, and the
    lock may have been held at the fork."""
    global _lock
    _lock = threading.Lock()
    _stores.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def store_for(url: ObjectURL, options: Mapping[str, Any]) -> Store:
    """The shared store for `url`'s scheme and these (checked) storage options: options that
    do not apply to the scheme are refused (UnsupportedError)."""
    options = client.check_options(options)  # some callers hand theirs on unchecked
    module = _module(url.store)
    takes = client.STORE_OPTIONS[url.store] + client.TUNING_OPTIONS
    foreign = sorted(set(options) - set(takes))
    if foreign:
        raise UnsupportedError(
            f"storage option {foreign[0]!r} does not apply to {url.scheme}:// URLs "
            f"(they take {', '.join(takes)})",
            path=str(url),
        )
    # an Azure URL naming its account (adlfs's CONTAINER@ACCOUNT... form) has a store of its own
    account = url.account
    settings = tuple(sorted((k, repr(v)) for k, v in options.items()))
    cache_key = (url.store, account, settings, module.environment())
    with _lock:
        found = _stores.get(cache_key)
        if found is None:
            try:
                made = module.new_store(options, account) if account else module.new_store(options)
                found = _stores[cache_key] = made
            except StorageError as e:
                if e.path is not None:
                    raise
                raise StorageError(e.reason, path=str(url)) from None  # credentials: where needed
        return found


def _module(store: str) -> Any:
    """The module of a store ("s3", "gs", "az": urls.STORE_OF)."""
    if store == "gs":
        from . import gcs

        return gcs
    if store == "az":
        from . import azure

        return azure
    from . import s3

    return s3

"""A listing of several pages runs to its own deadline (storage option deadline), every page
within it: not a page's whole deadline past it."""

from __future__ import annotations

import pytest

from ckptfmt.errors import StorageError
from ckptfmt.storage import gcs, listing
from ckptfmt.storage.urls import parse_url


@pytest.mark.parametrize("store_faults", ["gs"], indirect=True)
def test_a_listings_last_page_is_cut_at_the_listings_deadline(store_faults, monkeypatch):
    """Two pages of one object each (fake-gcs-server honours maxResults), each answered 2 s
    late: the listing's deadline of 3 s passes during the second page."""
    root = store_faults.new_root()
    for name in ("a", "b"):
        store_faults.put_raw(f"{root}/run/{name}", b"x")
    monkeypatch.setattr(gcs, "PAGE_ENTRIES", 1)
    method, target = store_faults.op("list")
    store_faults.delay(method, target, seconds=2)
    url = parse_url(f"{root}/run", need_key=False)
    with pytest.raises(StorageError, match="deadline"):
        listing.objects(url, store_faults.options | {"deadline": 3})
    store_faults.clear_rules()
    assert set(listing.objects(url, store_faults.options)) == {"a", "b"}


@pytest.mark.parametrize("store_faults", ["gs"], indirect=True)
def test_a_page_failing_once_the_listings_time_is_spent_reports_the_listings_deadline(
    store_faults, monkeypatch
):
    """The second page's attempts are cut by what was left of the listing's 3 s: the error
    names the listing's deadline (the one the user set), not the page's remainder."""
    root = store_faults.new_root()
    for name in ("a", "b"):
        store_faults.put_raw(f"{root}/run/{name}", b"x")
    monkeypatch.setattr(gcs, "PAGE_ENTRIES", 1)
    store_faults.delay(*store_faults.op("list"), seconds=2)
    url = parse_url(f"{root}/run", need_key=False)
    with pytest.raises(
        StorageError, match=r"the listing took more than 3 s \(storage option deadline\) after 1 pages"
    ):
        listing.objects(url, store_faults.options | {"deadline": 3})

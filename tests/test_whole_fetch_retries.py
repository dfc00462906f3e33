"""A small object read whole (storage/wholeget.py: a commit record) is retried by the same
policy as every other request (client.Budget.run): what may succeed again is tried again
within the storage options' attempts and deadline, then refused with a StorageError naming the
object; what would come again is not tried again."""

from __future__ import annotations

import pytest

from ckptfmt.errors import StorageError
from ckptfmt.storage.wholeget import fetch_whole

DATA = b"a small object read whole, as a commit record is"


def _object(f) -> str:
    url = f"{f.new_root()}/whole/record"
    f.put_raw(url, DATA)
    f.clear_counts()
    return url


def _fetched(url: str, options: dict) -> bytes:
    spool = fetch_whole(url, options, 1 << 20)
    try:
        return bytes(spool.view(0, spool.size))
    finally:
        spool.close()


def test_a_whole_fetch_that_fails_within_its_attempts_is_retried(store_faults):
    f = store_faults
    url = _object(f)
    f.fail_next(*f.op("read", "whole/record"), status=503, count=2)
    assert _fetched(url, f.options | {"max_attempts": 3}) == DATA
    assert f.count(*f.op("read", "whole/record")) == 3
    assert f.pending_rules() == 0


def test_a_whole_fetch_that_fails_past_its_attempts_names_the_object(store_faults):
    f = store_faults
    url = _object(f)
    f.fail_next(*f.op("read", "whole/record"), status=503, count=3)
    with pytest.raises(StorageError, match=r"read failed after 3 attempt\(s\)") as e:
        _fetched(url, f.options | {"max_attempts": 3})
    assert e.value.path == url
    assert f.count(*f.op("read", "whole/record")) == 3


def test_a_whole_fetch_past_its_deadline_is_not_tried_again(store_faults):
    """The deadline bounds the attempts too: a backoff that would end past it is not slept."""
    f = store_faults
    url = _object(f)
    f.fail_next(*f.op("read", "whole/record"), status=503, count=100)
    with pytest.raises(StorageError, match=r"deadline 0.3 s") as e:
        _fetched(url, f.options | {"max_attempts": 50, "deadline": 0.3})
    assert e.value.path == url
    assert f.count(*f.op("read", "whole/record")) < 5


def test_a_refusal_that_would_come_again_is_not_retried(store_faults):
    f = store_faults
    url = _object(f)
    f.fail_next(*f.op("read", "whole/record"), status=403, count=5)
    with pytest.raises(StorageError, match="access denied") as e:
        _fetched(url, f.options | {"max_attempts": 5})
    assert e.value.path == url
    assert f.count(*f.op("read", "whole/record")) == 1

"""S3's DeleteObjects answers 200 and names, key by key, what it failed to delete: a store's
transient failure (InternalError, SlowDown) is tried again within the deadline, for those
keys alone; another (AccessDenied) is an error naming the key."""

from __future__ import annotations

import pytest

from ckptfmt.errors import StorageError
from ckptfmt.storage import listing
from ckptfmt.storage.urls import parse_url


def _per_key_errors(keys: list[str], code: str) -> bytes:
    errors = "".join(f"<Error><Key>{k}</Key><Code>{code}</Code><Message>m</Message></Error>" for k in keys)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{errors}</DeleteResult>'
    ).encode()


def _three(store_faults) -> tuple[str, list[str]]:
    root = store_faults.new_root()
    bucket = root.removeprefix("s3://")
    names = ["a", "b", "c"]
    for name in names:
        store_faults.put_raw(f"{root}/run/{name}", b"x")
    return bucket, names


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
@pytest.mark.parametrize("code", ["InternalError", "SlowDown"])
def test_per_key_transient_errors_of_a_batch_delete_are_tried_again(store_faults, code):
    bucket, names = _three(store_faults)
    url = parse_url(f"s3://{bucket}/run", need_key=False)
    body = _per_key_errors([f"run/{n}" for n in names], code)
    store_faults.fail_next("POST", "?delete", status=200, body=body)  # unforwarded: none deleted
    listing.delete_prefix(url, store_faults.options, lambda name: True)
    store_faults.clear_rules()
    assert listing.objects(url, store_faults.options) == {}


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_per_key_refusal_of_a_batch_delete_names_the_key(store_faults):
    bucket, names = _three(store_faults)
    url = parse_url(f"s3://{bucket}/run", need_key=False)
    store_faults.fail_next("POST", "?delete", status=200, body=_per_key_errors(["run/b"], "AccessDenied"))
    with pytest.raises(StorageError, match="run/b: AccessDenied"):
        listing.delete_prefix(url, store_faults.options, lambda name: True)


def _mixed_errors(pairs: list[tuple[str, str]]) -> bytes:
    errors = "".join(f"<Error><Key>{k}</Key><Code>{c}</Code><Message>m</Message></Error>" for k, c in pairs)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{errors}</DeleteResult>'
    ).encode()


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_batch_delete_refused_beside_a_transient_failure_names_the_refused_key(store_faults):
    bucket, _ = _three(store_faults)
    url = parse_url(f"s3://{bucket}/run", need_key=False)
    body = _mixed_errors([("run/a", "InternalError"), ("run/b", "AccessDenied")])
    store_faults.fail_next("POST", "?delete", status=200, body=body)
    with pytest.raises(StorageError, match="delete run/b: AccessDenied"):
        listing.delete_prefix(url, store_faults.options, lambda name: True)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_batch_delete_whose_retries_run_out_names_the_keys_still_pending(store_faults):
    bucket, _ = _three(store_faults)
    url = parse_url(f"s3://{bucket}/run", need_key=False)
    body = _per_key_errors(["run/b"], "SlowDown")
    store_faults.fail_next("POST", "?delete", status=200, body=body, count=10)
    with pytest.raises(StorageError, match=r"SlowDown.*1 of 3 keys still not deleted: run/b$"):
        listing.delete_prefix(url, store_faults.options | {"max_attempts": 2}, lambda name: True)

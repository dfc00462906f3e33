"""The URL forms the clouds' fsspec filesystems take, beside gs:// and az://: gcsfs's gcs://,
adlfs's abfs:// and abfss://, and the Azure form that names its account in the host
(``CONTAINER@ACCOUNT.dfs.core.windows.net``, or ``.blob.``), each saved, loaded and run on
its emulator; a malformed one, or one naming another account than the credentials', is
refused with a typed error naming it."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import assert_same

import ckptfmt
from ckptfmt.errors import StorageError, UnsupportedError
from ckptfmt.storage.urls import parse_url

ACCOUNT = "devstoreaccount1"  # Azurite's, as its connection string names it
FROZEN = torch.randn(100_000, generator=torch.Generator().manual_seed(5))


def _state(step: int) -> dict[str, object]:
    return {"frozen": FROZEN, "head": torch.full((100,), float(step)), "step": step}


def _round_trip(root: str) -> None:
    """A file saved and loaded, and an incremental run whose step 2 reads step 1's object
    (a reference resolved beneath `root`, in its form) resumed by a fresh manager."""
    ckptfmt.save(_state(0), f"{root}/one.ckpt")
    assert_same(_state(0), ckptfmt.load(f"{root}/one.ckpt"))
    assert ckptfmt.verify(f"{root}/one.ckpt").ok
    m = ckptfmt.CheckpointManager(f"{root}/run", incremental=True, keep_last=1)
    m.save(1, _state(1))
    m.save(2, _state(2))
    assert m.latest().references == (f"{root}/run/step-000000001/state.ckpt",)
    fresh = ckptfmt.CheckpointManager(f"{root}/run", incremental=True)
    assert [c.step for c in fresh.checkpoints()] == [2]
    assert_same(_state(2), fresh.load())


def test_gcsfs_gcs_urls_are_gs_urls(gcs_bucket):
    _round_trip(f"gcs://{gcs_bucket}")
    # the same objects as gs:// names them
    assert_same(_state(0), ckptfmt.load(f"gs://{gcs_bucket}/one.ckpt"))
    assert str(parse_url(f"gcs://{gcs_bucket}/a/b")) == f"gcs://{gcs_bucket}/a/b"


@pytest.mark.parametrize(
    "form",
    [
        "abfs://{c}",
        "abfss://{c}",
        "abfs://{c}@{a}.dfs.core.windows.net",
        "abfss://{c}@{a}.dfs.core.windows.net",
        "az://{c}@{a}.blob.core.windows.net",
    ],
)
def test_adlfs_forms_reach_the_container(azure_container, form):
    root = form.format(c=azure_container, a=ACCOUNT)
    _round_trip(root)
    assert_same(_state(0), ckptfmt.load(f"az://{azure_container}/one.ckpt"))  # the same blob


@pytest.mark.parametrize(
    "url, reason",
    [
        ("gcs://Not_A_Bucket/x", "not a valid bucket name"),
        ("gs://bucket@account.dfs.core.windows.net/x", "not a bucket name"),
        ("abfs://container@evil.example.com/x", r"names its account as CONTAINER@ACCOUNT"),
        ("abfs://container@/x", r"names its account as CONTAINER@ACCOUNT"),
        ("az://container@Upper.blob.core.windows.net/x", r"names its account as CONTAINER@ACCOUNT"),
        ("abfss://bad--name@acct.dfs.core.windows.net/x", "not a valid bucket name"),
    ],
)
def test_malformed_forms_are_refused_naming_the_url(url, reason):
    with pytest.raises(UnsupportedError, match=reason) as e:
        ckptfmt.load(url)
    assert e.value.path == url


def test_an_account_in_the_url_must_be_the_credentials_account(azure_container, monkeypatch):
    url = f"abfs://{azure_container}@otheraccount.dfs.core.windows.net/x.ckpt"
    with pytest.raises(StorageError, match="names the storage account 'otheraccount'") as e:
        ckptfmt.save({"w": torch.zeros(2)}, url)
    assert e.value.path == url and f"for {ACCOUNT!r}" in str(e.value)
    # without a connection string the URL's account is the one whose key is looked for
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AZURE_STORAGE_SAS_TOKEN", raising=False)
    # with none of its keys, azure-identity's chain (here as if not installed: its error
    # names the account looked for, without asking any identity for a token)
    monkeypatch.setitem(sys.modules, "azure.identity", None)
    with pytest.raises(StorageError, match="of the account 'otheraccount' with no key"):
        ckptfmt.load(url)

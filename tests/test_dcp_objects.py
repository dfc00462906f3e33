"""ckptfmt's DCP storage layer on an object store (a real moto S3 server over HTTP, faults
injected by tests/s3_faults.py's proxy in front of it).

One spawned gloo group of two ranks (tests/dcp_worker.py) runs every multi-process task: a
sharded save to ``s3://`` through the proxy with a 503 on one rank's upload (retried), a load
back on two ranks, an async save with a connection reset mid-upload, and a save the store
refuses.  The single-process tests load what the group saved into one process (resharded),
count the requests a partial load makes, and refuse hostile store contents.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_dcp import run_group

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.errors import (
    CheckpointError,
    CorruptError,
    IncompleteError,
    SignatureError,
    StorageError,
)
from ckptfmt.files import multifile
from ckptfmt.files.places import ObjectPlace

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


@pytest.fixture(scope="module")
def group(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the two-rank group once, through a fault proxy; what it saved and answered."""
    from s3_faults import FaultProxy

    work = tmp_path_factory.mktemp("dcp-objects")
    with FaultProxy(s3_server.endpoint_url) as proxy:
        bucket = proxy.new_bucket()
        options = proxy.storage_options()
        url = f"s3://{bucket}"
        # a 503 on rank 1's upload (retried by the client), a reset mid-upload of the async
        # save, and every upload of the failing save refused (not retried: 403)
        proxy.fail_next("PUT", f"/{bucket}/dt/rank-00001.ckpt", status=503, count=1)
        proxy.reset_on("PUT", f"/{bucket}/async/rank-00000.ckpt", upload_bytes=4096)
        proxy.fail_next("PUT", f"/{bucket}/refused/", status=403, count=1000)
        common = {"storage_options": options}
        tasks = [
            {"op": "save", "name": "save", "scenario": "dtensor", "seed": 7, "dir": f"{url}/dt", **common},
            {
                "op": "load",
                "name": "load",
                "scenario": "dtensor",
                "seed": 8,
                "src": f"{url}/dt",
                "ref": str(work / "dt.ref"),
                **common,
            },
            {"op": "async", "name": "async", "scenario": "ddp", "seed": 9, "dir": f"{url}/async", **common},
            {
                "op": "fail",
                "name": "fail",
                "scenario": "ddp",
                "seed": 10,
                "pad_mib": 20,
                "dir": f"{url}/refused",
                **common,
            },
        ]
        # a checkpoint manager's run on the store, saved by both ranks (step 3 after step 2,
        # keep_last=1), then resumed by both
        run = {"scenario": "dtensor", "run": f"{url}/run", **common}
        tasks += [
            {"op": "msave", "name": "msave2", "seed": 11, "step": 2, "keep_last": 1, "ref": None, **run},
            {
                "op": "msave",
                "name": "msave3",
                "seed": 12,
                "step": 3,
                "keep_last": 1,
                "ref": str(work / "m.ref"),
                **run,
            },
            {"op": "mload", "name": "mload", "seed": 13, "ref": str(work / "m.ref"), **run},
        ]
        tasks[0]["ref"] = str(work / "dt.ref")
        results = run_group(2, tasks, work, "objects")
        left = proxy.pending_rules()
        proxy.clear_rules()
    return {
        "bucket": bucket,
        "url": url,
        "ref": str(work / "dt.ref"),
        "results": {t["name"]: [r[i] for r in results] for i, t in enumerate(tasks)},
        "rules_left": left,
    }


def _ok(group: dict[str, Any], name: str) -> list[dict[str, Any]]:
    got = group["results"][name]
    for r in got:
        assert r.get("ok"), f"{name}: {r.get('error')}\n{r.get('trace', '')}"
    return got


def test_two_ranks_save_to_the_store_and_load_back(group, s3_server):
    _ok(group, "save")
    loaded = _ok(group, "load")
    assert all(r["values"] > 10 and r["chunks_read"] > 0 for r in loaded)
    names = sorted(ObjectPlace(f"{group['url']}/dt", s3_server.storage_options()).names())
    assert names == ["COMMIT", "rank-00000.ckpt", "rank-00001.ckpt"]


def test_async_save_to_the_store_survives_a_reset_mid_upload(group):
    _ok(group, "async")
    # the 503 and the reset fired (and were retried); the 403 rule stays (count 1000)
    assert group["rules_left"] == 1


def test_a_refused_save_leaves_no_commit_and_no_upload(group, s3_server):
    for r in _ok(group, "fail"):
        assert r["error"] is not None and "no commit record was written" in r["error"], r
    client = s3_server.client()
    keys = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=group["bucket"], Prefix="refused/").get("Contents", [])
    ]
    assert keys == []
    uploads = client.list_multipart_uploads(Bucket=group["bucket"]).get("Uploads", [])
    assert uploads == []


def _empty_like(reader: cdcp.Reader, fqns: set[str] | None = None) -> dict[str, Any]:
    """A flat state of full tensors shaped as the checkpoint's (one process: resharded)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = reader.read_metadata()
    return {
        fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for fqn, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and (fqns is None or fqn in fqns)
    }


def test_one_process_loads_what_two_ranks_saved(group, s3_server):
    _ok(group, "save")
    url = f"{group['url']}/dt"
    reader = cdcp.Reader(url, storage_options=s3_server.storage_options())
    state = _empty_like(reader)
    cdcp.load(state, url, storage_options=s3_server.storage_options())
    ref = ckptfmt.load(group["ref"])
    assert len(state) > 10
    for k, v in state.items():
        assert torch.equal(v, ref[k]), k


def _two_tensor_checkpoint(url: str, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    state = {"big": torch.arange(6 * MiB // 4, dtype=torch.float32), "small": torch.arange(10.0)}
    cdcp.save(state, url, storage_options=options)
    return state


def test_a_partial_load_fetches_only_the_ranges_it_needs(s3_faults):
    bucket = s3_faults.new_bucket()
    options = s3_faults.storage_options() | {"request_size": MiB}
    url = f"s3://{bucket}/partial"
    saved = _two_tensor_checkpoint(url, options)
    s3_faults.clear_counts()
    small = {"small": torch.zeros(10)}
    cdcp.load(small, url, storage_options=options)
    assert torch.equal(small["small"], saved["small"])
    partial = s3_faults.count("GET", "rank-00000.ckpt")
    s3_faults.clear_counts()
    big = {"big": torch.zeros(6 * MiB // 4)}
    cdcp.load(big, url, storage_options=options)
    assert torch.equal(big["big"], saved["big"])
    whole = s3_faults.count("GET", "rank-00000.ckpt")
    # the 6 MiB tensor needs its 1 MiB ranges; the small one only the file's head and tail
    assert partial <= 3 and whole >= partial + 5, (partial, whole)


def test_a_record_that_lies_about_a_rank_file_is_refused(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/lies"
    _two_tensor_checkpoint(url, options)
    place = ObjectPlace(url, options)
    record = place.read_record()
    part = record.files[0]
    lying = dataclasses.replace(record, files=(dataclasses.replace(part, length=part.length + 4096),))
    ckptfmt.save(lying.as_value(), f"{url}/COMMIT", storage_options=options)
    with pytest.raises(CorruptError, match=r"rank-00000\.ckpt .*the commit record says") as e:
        cdcp.load({"small": torch.zeros(10)}, url, storage_options=options)
    assert url in str(e.value)


def test_a_replaced_rank_file_is_refused(s3_bucket, s3_server):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/replaced"
    _two_tensor_checkpoint(url, options)
    _two_tensor_checkpoint(f"s3://{bucket}/other", options)  # the same state, another file id
    client = s3_server.client()
    body = client.get_object(Bucket=bucket, Key="other/rank-00000.ckpt")["Body"].read()
    client.put_object(Bucket=bucket, Key="replaced/rank-00000.ckpt", Body=body)
    with pytest.raises(CorruptError, match="not the file the commit record names"):
        cdcp.load({"small": torch.zeros(10)}, url, storage_options=options)


def test_a_checkpoint_without_its_record_is_not_one(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/uncommitted"
    _two_tensor_checkpoint(url, options)
    ObjectPlace(url, options).remove(multifile.COMMIT_NAME)
    with pytest.raises(IncompleteError, match="no commit record"):
        cdcp.load({"small": torch.zeros(10)}, url, storage_options=options)


def test_overwrite_false_refuses_a_committed_prefix_and_encryption_works(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/enc"
    key = bytes(range(32))
    cdcp.save({"w": torch.arange(100.0)}, url, storage_options=options, encrypt_with=key)
    with pytest.raises(CheckpointError, match="overwrite=False"):
        cdcp.save({"w": torch.zeros(100)}, url, storage_options=options, overwrite=False)
    got = {"w": torch.zeros(100)}
    cdcp.load(got, url, storage_options=options, decrypt_with=key)
    assert torch.equal(got["w"], torch.arange(100.0))
    with pytest.raises(CheckpointError):
        cdcp.load({"w": torch.zeros(100)}, url, storage_options=options)


def test_a_signed_dcp_save_on_the_store(s3_server, s3_bucket):
    """sign_with on a store: the record carries each rank object's SHA-256 (read back whole)
    and is signed; trusted_keys loads it, refuses another key, and refuses a changed byte of
    a rank object before any target is written."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/signed"
    key = _signing_key()
    w = torch.arange(5000.0)
    cdcp.save({"w": w}, url, storage_options=options, sign_with=key)
    got = {"w": torch.zeros(5000)}
    cdcp.load(got, url, storage_options=options, trusted_keys=[key.public_key()])
    assert torch.equal(got["w"], w)
    with pytest.raises(SignatureError):
        cdcp.load(
            {"w": torch.zeros(5000)}, url, storage_options=options, trusted_keys=[_signing_key().public_key()]
        )
    client = s3_server.client()
    name = next(
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix="signed/")["Contents"]
        if "rank" in o["Key"]
    )
    data = bytearray(client.get_object(Bucket=bucket, Key=name)["Body"].read())
    data[100] ^= 0x40
    client.put_object(Bucket=bucket, Key=name, Body=bytes(data))
    target = {"w": torch.zeros(5000)}
    with pytest.raises(SignatureError):
        cdcp.load(target, url, storage_options=options, trusted_keys=[key.public_key()])
    assert not target["w"].any()


def _signing_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.generate()


def test_a_two_rank_run_of_the_manager_on_the_store(group, s3_server):
    """CheckpointManager("s3://...") with two ranks: each step a DCP checkpoint on the store
    (each rank its own object, the record last), rotated, resumed by both ranks bit-exactly,
    each rank's RNG restored."""
    r = group["results"]
    assert [x["error"] for x in r["msave2"] + r["msave3"]] == [None] * 4
    assert r["msave3"][0]["steps"] == [3]  # keep_last=1 rotated step 2 away
    for rank, got in enumerate(r["mload"]):
        assert got["latest"] == 3 and got["layout"] == "dcp" and got["values"] > 0  # every value equal
        assert got["rng_restored"] and got["draw"] == r["msave3"][rank]["draw"]
    run = ckptfmt.CheckpointManager(f"{group['url']}/run", storage_options=s3_server.storage_options())
    assert run.verify().ok
    assert set(run.load()) == {"model", "optim"}  # both ranks' state, as full tensors, in this process


def test_a_rank_object_replaced_mid_load_is_an_error(s3_faults, s3_server):
    """The rank object is replaced after the load looked it up (its HEAD) and before its bytes
    are fetched: every GET is pinned to that ETag, so the load fails, never mixing versions."""
    import threading

    bucket = s3_faults.new_bucket()
    options = s3_faults.storage_options() | {"request_size": MiB}
    url = f"s3://{bucket}/swap"
    _two_tensor_checkpoint(url, options)
    _two_tensor_checkpoint(f"s3://{bucket}/other", options)  # the same bytes but another file id
    client = s3_server.client()
    other = client.get_object(Bucket=bucket, Key="other/rank-00000.ckpt")["Body"].read()
    s3_faults.clear_counts()
    s3_faults.delay("GET", "swap/rank-00000.ckpt", seconds=0.5)
    failure: list[BaseException] = []

    def load() -> None:
        try:
            cdcp.load({"big": torch.zeros(6 * MiB // 4)}, url, storage_options=options)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=load)
    t.start()
    for _ in range(400):  # the load has looked the object up: replace it while its GETs wait
        if s3_faults.count("HEAD", "swap/rank-00000.ckpt"):
            break
        threading.Event().wait(0.01)
    client.put_object(Bucket=bucket, Key="swap/rank-00000.ckpt", Body=other)
    t.join(60)
    s3_faults.clear_rules()
    assert failure and isinstance(failure[0], StorageError), failure
    assert "swap/rank-00000.ckpt" in str(failure[0]) and "changed while it was being read" in str(failure[0])

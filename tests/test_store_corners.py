"""What the s3:// tests check that gs:// (fake-gcs-server) and az:// (Azurite) had not yet been
checked for, one body run on each: the command line's consolidate of a DCP checkpoint on the
store (with ls, verify and inspect of a run and a file), a DCP save and load by two ranks, and
an upload that the store refuses half-way, which leaves nothing visible behind."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runner import run_cli
from helpers import assert_same, run_ranks

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt import dcp as cdcp
from ckptfmt.storage import listing
from ckptfmt.storage.urls import parse_url

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20
FULL = torch.arange(1 << 14, dtype=torch.float32).reshape(128, 128)


@pytest.fixture(params=["gs", "az"])
def root(request) -> str:
    """A fresh bucket (container) on one emulator, reached through its cloud's environment
    variable: its URL."""
    if request.param == "gs":
        return f"gs://{request.getfixturevalue('gcs_bucket')}"
    return f"az://{request.getfixturevalue('azure_container')}"


def _dcp_state() -> dict[str, object]:
    return {"w": torch.arange(3000.0).reshape(30, 100), "b": torch.ones(7, dtype=torch.bfloat16), "epoch": 3}


def test_ls_verify_inspect_and_consolidate_on_the_store(root, tmp_path):
    url = f"{root}/dcp/step-1"
    state = _dcp_state()
    cdcp.save(state, url)
    info = json.loads(run_cli("ls", url, "--json", rc=0).stdout)
    assert info["complete"] and [f["status"] for f in info["files"]] == ["ok"]
    assert run_cli("verify", url, rc=0).stdout.strip() == f"{url}: OK"
    assert "DCP checkpoint, complete" in run_cli("inspect", url, rc=0).stdout
    local = tmp_path / "full.ckpt"
    out = json.loads(run_cli("consolidate", url, local, "--json", rc=0).stdout)
    assert out["ok"] and out["source_format"] == "ckptfmt-dcp" and out["tensors"] == 2
    assert_same(state, ckptfmt.load(local))
    remote = f"{root}/full.ckpt"
    assert "one file with full tensors" in run_cli("consolidate", url, remote, rc=0).stdout
    assert_same(state, ckptfmt.load(remote))
    # a run and a file on the store
    run = f"{root}/run"
    m = CheckpointManager(run)
    m.save(1, {"w": torch.zeros(10)})
    m.save(2, {"w": torch.ones(10)})
    steps = json.loads(run_cli("ls", run, "--json", rc=0).stdout)["steps"]
    assert [(r["step"], r["status"]) for r in steps] == [(1, "complete"), (2, "complete")]
    res = json.loads(run_cli("verify", run, "--json", rc=0).stdout)
    assert [f["status"] for f in res["files"]] == ["ok", "ok"]
    step = m.latest().path
    assert "self-contained copy" in run_cli("consolidate", step, tmp_path / "s.ckpt", rc=0).stdout
    assert torch.equal(ckptfmt.load(tmp_path / "s.ckpt")["state"]["w"], torch.ones(10))
    one = f"{root}/one.ckpt"
    ckptfmt.save({"w": torch.arange(6)}, one)
    assert run_cli("verify", one, rc=0).stdout.strip() == f"{one}: OK"
    info = json.loads(run_cli("inspect", one, "--json", rc=0).stdout)
    assert info["chunks"] == 1 and info["file_bytes"] > 48
    assert "no object and no step" in run_cli("verify", f"{root}/nothing", rc=0).stdout
    run_cli("inspect", f"{root}/nothing.ckpt", rc=2)


def _save_and_load_on_two_ranks(rank: int, world: int, urls: list[str]) -> dict[str, object]:
    """At each URL, each rank saves its row shard of FULL, then loads the checkpoint into
    fresh shards: whether each came back whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, object] = {}
    for url in urls:
        cdcp.save({"w": distribute_tensor(FULL, mesh, [Shard(0)]), "step": 5}, url)
        got: dict[str, object] = {"w": distribute_tensor(torch.zeros_like(FULL), mesh, [Shard(0)]), "step": 0}
        cdcp.load(got, url)
        out[url] = bool(torch.equal(got["w"].full_tensor(), FULL)) and got["step"] == 5  # type: ignore[union-attr]
    return out


def test_two_ranks_save_and_load_a_dcp_checkpoint_on_gs_and_az(gcs_bucket, azure_container, tmp_path):
    """One gloo group of two ranks (its start costs seconds) for both stores."""
    urls = [f"gs://{gcs_bucket}/dcp2", f"az://{azure_container}/dcp2"]
    results = run_ranks(_save_and_load_on_two_ranks, 2, tmp_path, urls)
    assert results == [dict.fromkeys(urls, True)] * 2, results
    for url in urls:
        names = sorted(listing.objects(parse_url(url, need_key=False), {}))
        assert names == ["COMMIT", "rank-00000.ckpt", "rank-00001.ckpt"], url


@pytest.fixture(params=["gs", "az"])
def faults(request):
    """(the store's URL root, a FaultProxy in front of its emulator, what the targets that
    upload part 2 and that commit the parts into the object hold)."""
    if request.param == "gs":
        proxy = request.getfixturevalue("gcs_faults")
        return f"gs://{proxy.bucket}", proxy, ("-00002", "/compose")  # a part's name ends -NNNNN
    proxy = request.getfixturevalue("azure_faults")
    # a block id is base64 of "UPLOADID-NNNNN" (16 + 1 + 5 bytes): "00002" ends it "MDAwMg=="
    return f"az://{proxy.container}", proxy, ("MDAwMg%3D%3D", "comp=blocklist")


@pytest.mark.parametrize("refused", ["part", "commit"])
def test_an_upload_refused_half_way_leaves_nothing_visible(faults, refused):
    """Step 2's state (three parts) refused at a part's upload, or after every part is up at
    the request that makes them the object: its save fails naming the URL, no object, no part
    and no listing entry is left, and step 1 loads."""
    root, proxy, (part, commit) = faults
    url = f"{root}/run"
    options = {"part_size": 8 * MiB}
    m = CheckpointManager(url, storage_options=options)
    m.save(1, {"w": torch.ones(10)})
    before = listing.objects(parse_url(url, need_key=False), {})
    target = part if refused == "part" else commit
    proxy.fail_next(None, target, status=403, count=1000)
    with pytest.raises(ckptfmt.CheckpointError, match="step-000000002"):
        m.save(2, {"w": torch.randn(5 * MiB)})  # 20 MiB
    proxy.clear_rules()
    assert proxy.count(None, target) > 0
    after = listing.objects(parse_url(url, need_key=False), {})
    assert sorted(after) == sorted(before)
    assert not any("step-000000002" in k for k in _every_name(proxy, root))
    fresh = CheckpointManager(url, storage_options=options)
    assert [c.step for c in fresh.checkpoints()] == [1]
    assert_same({"w": torch.ones(10)}, fresh.load())


def _every_name(proxy, root: str) -> list[str]:
    """Every name in the bucket as the emulator lists it, GCS part objects included (Azure
    lists no uncommitted block)."""
    if root.startswith("gs://"):
        from urllib.request import urlopen

        with urlopen(f"{proxy.upstream}/storage/v1/b/{root[5:]}/o") as answer:
            return [item["name"] for item in json.loads(answer.read()).get("items", [])]
    return list(listing.objects(parse_url(root, need_key=False), {}))


def test_a_dcp_save_refused_half_way_leaves_no_record_and_no_object(faults):
    root, proxy, (part, _) = faults
    url = f"{root}/dcp"
    proxy.fail_next(None, part, status=403, count=1000)
    with pytest.raises(ckptfmt.CheckpointError, match="no commit record was written"):
        cdcp.save({"w": torch.randn(5 * MiB)}, url, storage_options={"part_size": 8 * MiB})
    proxy.clear_rules()
    assert proxy.count(None, part) > 0
    assert not any(k.startswith("dcp/") for k in _every_name(proxy, root))
    with pytest.raises(ckptfmt.CheckpointError):
        cdcp.load({"w": torch.zeros(5 * MiB)}, url)

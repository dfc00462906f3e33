"""The command line on multi-file checkpoints on an object store (a real moto S3 server),
credentials and endpoint from the AWS_* environment: ls, verify, inspect and consolidate of a
DCP checkpoint's prefix, consolidate of a run's step on the store, and a damaged rank object."""

from __future__ import annotations

import json
import os

import pytest
import torch
from cli_runner import run_cli

import ckptfmt
from ckptfmt import dcp as cdcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, object]:
    return {"w": torch.arange(3000.0).reshape(30, 100), "b": torch.ones(7, dtype=torch.bfloat16), "epoch": 3}


def test_ls_verify_inspect_and_consolidate_a_dcp_checkpoint_on_the_store(env_bucket, tmp_path):
    url = f"s3://{env_bucket}/dcp/step-1"
    state = _state()
    cdcp.save(state, url)
    info = json.loads(run_cli("ls", url, "--json", rc=0).stdout)
    assert info["complete"] and [f["status"] for f in info["files"]] == ["ok"]
    assert info["tensors"] == 2 and info["values"] == 1
    assert run_cli("verify", url, rc=0).stdout.strip() == f"{url}: OK"
    assert "DCP checkpoint, complete" in run_cli("inspect", url, rc=0).stdout
    local = tmp_path / "full.ckpt"
    out = json.loads(run_cli("consolidate", url, local, "--json", rc=0).stdout)
    assert out["ok"] and out["source_format"] == "ckptfmt-dcp" and out["tensors"] == 2
    back = ckptfmt.load(local)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"]) and back["epoch"] == 3
    remote = f"s3://{env_bucket}/full.ckpt"
    assert "one file with full tensors" in run_cli("consolidate", url, remote, rc=0).stdout
    assert torch.equal(ckptfmt.load(remote)["w"], state["w"])


def test_consolidate_a_step_of_a_run_on_the_store(env_bucket, tmp_path):
    run = f"s3://{env_bucket}/run"
    m = ckptfmt.CheckpointManager(run)
    m.save(1, {"w": torch.arange(5000.0)})
    step = m.latest().path
    local = tmp_path / "s.ckpt"
    assert "self-contained copy" in run_cli("consolidate", step, local, rc=0).stdout
    assert torch.equal(ckptfmt.load(local)["state"]["w"], torch.arange(5000.0))
    remote = f"{run}-copy.ckpt"
    run_cli("consolidate", step, remote, rc=0)
    assert torch.equal(ckptfmt.load(remote)["state"]["w"], torch.arange(5000.0))
    assert "OK" in run_cli("verify", step, rc=0).stdout  # a step's prefix is one checkpoint too
    # a step saved where a crashed save left its state object: its own is named for the save
    from s3_server import s3_client

    c = s3_client(os.environ["AWS_ENDPOINT_URL"])
    c.put_object(Bucket=env_bucket, Key="run/step-000000002/state.ckpt", Body=b"a crashed save's")
    m.save(2, {"w": torch.arange(7.0)})
    assert m.run.record(2).files[0].name != "state.ckpt"
    run_cli("consolidate", m.latest().path, tmp_path / "s2.ckpt", rc=0)
    assert torch.equal(ckptfmt.load(tmp_path / "s2.ckpt")["state"]["w"], torch.arange(7.0))


def test_a_damaged_rank_object_fails_verify_and_ls(env_bucket):
    from s3_server import s3_client

    url = f"s3://{env_bucket}/bad"
    cdcp.save(_state(), url)
    c = s3_client(os.environ["AWS_ENDPOINT_URL"])
    data = bytearray(c.get_object(Bucket=env_bucket, Key="bad/rank-00000.ckpt")["Body"].read())
    data[300] ^= 1  # a chunk's byte: the identity in the record still matches
    c.put_object(Bucket=env_bucket, Key="bad/rank-00000.ckpt", Body=bytes(data))
    out = run_cli("verify", url, rc=1).stdout
    assert "FAILED corrupt" in out and "rank-00000.ckpt" in out
    c.delete_object(Bucket=env_bucket, Key="bad/rank-00000.ckpt")
    info = json.loads(run_cli("ls", url, "--json", rc=0).stdout)
    assert not info["complete"] and info["files"][0]["status"] == "missing"
    assert "missing" in run_cli("consolidate", url, f"s3://{env_bucket}/x.ckpt", rc=1).stderr


def test_verify_of_a_dcp_prefix_demands_what_load_demands(env_bucket, tmp_path):
    """--trusted-key on a DCP checkpoint's prefix: unsigned fails as cdcp.load refuses it,
    signed by the key is OK."""
    run_cli("keygen", str(tmp_path / "k"), rc=0)
    plain, signed = f"s3://{env_bucket}/plain", f"s3://{env_bucket}/signed"
    cdcp.save(_state(), plain)
    cdcp.save(_state(), signed, sign_with=tmp_path / "k")
    pub = str(tmp_path / "k.pub")
    res = json.loads(run_cli("verify", plain, "--trusted-key", pub, "--json", rc=1).stdout)
    assert res["files"][0]["problems"][0]["kind"] == "signature"
    with pytest.raises(ckptfmt.SignatureError):
        cdcp.load(_state(), plain, trusted_keys=[pub])
    assert run_cli("verify", signed, "--trusted-key", pub, rc=0).stdout.strip() == f"{signed}: OK"

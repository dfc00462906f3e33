"""The command line on s3:// URLs (a real moto S3 server), credentials and endpoint from
the AWS_* environment as for the AWS CLI: ls and verify of a run, verify and inspect of a
file, a damaged object, a missing one, and a store that refuses."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runner import run_cli

import ckptfmt


def test_ls_and_verify_a_run_on_the_store(env_bucket):
    url = f"s3://{env_bucket}/run"
    m = ckptfmt.CheckpointManager(url)
    m.save(1, {"w": torch.zeros(10)}, metrics={"loss": 2.0})
    m.save(2, {"w": torch.ones(10)}, metrics={"loss": 1.0})
    out = json.loads(run_cli("ls", url, "--json", rc=0).stdout)
    assert [(r["step"], r["status"]) for r in out["steps"]] == [(1, "complete"), (2, "complete")]
    assert out["steps"][1]["metrics"] == {"loss": 1.0}
    assert "OK" in run_cli("verify", url, rc=0).stdout
    res = json.loads(run_cli("verify", url, "--step", "2", "--json", rc=0).stdout)
    assert [f["status"] for f in res["files"]] == ["ok"]


def test_a_fresh_process_lists_and_verifies_a_run_on_the_store(env_bucket, tmp_path):
    """python -m ckptfmt imports no manager until a command needs one: a run's URL still
    reaches the object-store manager (CheckpointManager(url)), not a local directory."""
    import os
    import subprocess
    import sys

    url = f"s3://{env_bucket}/fresh"
    ckptfmt.CheckpointManager(url).save(3, {"w": torch.zeros(4)})
    out = {}
    for command in ("ls", "verify"):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptfmt", command, url, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ckptfmt.__file__))},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[command] = json.loads(proc.stdout)
    assert [(r["step"], r["status"]) for r in out["ls"]["steps"]] == [(3, "complete")]
    assert [f["status"] for f in out["verify"]["files"]] == ["ok"]
    assert os.listdir(tmp_path) == []  # nothing made a local directory of the URL


def test_verify_of_a_run_on_the_store_demands_what_load_demands(env_bucket, tmp_path):
    """--trusted-key on a run's URL: a step no trusted key signed fails verify as load refuses
    it; --decrypt-key reads an encrypted run."""
    pytest.importorskip("cryptography")
    run_cli("keygen", str(tmp_path / "k"), rc=0)
    url = f"s3://{env_bucket}/signed"
    ckptfmt.CheckpointManager(url, sign_with=tmp_path / "k").save(1, {"w": torch.zeros(10)})
    ckptfmt.CheckpointManager(url).save(2, {"w": torch.ones(10)})
    res = json.loads(run_cli("verify", url, "--trusted-key", str(tmp_path / "k.pub"), "--json", rc=1).stdout)
    assert [(f["step"], f["status"]) for f in res["files"]] == [(1, "ok"), (2, "failed")]
    assert res["files"][1]["problems"][0]["kind"] == "signature"
    with pytest.raises(ckptfmt.SignatureError):
        ckptfmt.CheckpointManager(url, trusted_keys=[tmp_path / "k.pub"]).load(2)

    key = tmp_path / "data.key"
    key.write_bytes(bytes(range(32)))
    enc = f"s3://{env_bucket}/encrypted"
    ckptfmt.CheckpointManager(enc, encrypt_with=key).save(1, {"w": torch.ones(10)})
    assert "OK" in run_cli("verify", enc, "--decrypt-key", str(key), rc=0).stdout


def test_verify_and_inspect_a_file_on_the_store(env_bucket):
    url = f"s3://{env_bucket}/one.ckpt"
    ckptfmt.save({"a": torch.arange(1000), "meta": {"epoch": 3}}, url)
    assert run_cli("verify", url, rc=0).stdout.strip() == f"{url}: OK"
    info = json.loads(run_cli("inspect", url, "--json", rc=0).stdout)
    assert info["chunks"] == 1 and info["file_bytes"] > 8000


def test_a_damaged_object_fails_and_a_missing_one_is_a_usage_error(env_bucket):
    import os

    from s3_server import s3_client

    url = f"s3://{env_bucket}/bad.ckpt"
    ckptfmt.save({"a": torch.arange(1000)}, url)
    c = s3_client(os.environ["AWS_ENDPOINT_URL"])
    data = bytearray(c.get_object(Bucket=env_bucket, Key="bad.ckpt")["Body"].read())
    data[300] ^= 1
    c.put_object(Bucket=env_bucket, Key="bad.ckpt", Body=bytes(data))
    assert "FAILED corrupt: checksum mismatch" in run_cli("verify", url, rc=1).stdout
    assert "no object and no step" in run_cli("verify", f"s3://{env_bucket}/nothing", rc=0).stdout
    run_cli("inspect", f"s3://{env_bucket}/nothing.ckpt", rc=2)
    run_cli("inspect", "hdfs://bucket/x.ckpt", rc=1)


def test_a_refusing_store_is_exit_2_naming_the_url(s3_faults, monkeypatch):
    options = s3_faults.storage_options()
    bucket = s3_faults.new_bucket()
    url = f"s3://{bucket}/x.ckpt"
    ckptfmt.save({"a": torch.zeros(3)}, url, storage_options=options)
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["aws_secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3_faults.fail_next(None, "x.ckpt", status=403, code="AccessDenied", count=50)
    err = run_cli("inspect", url, rc=2).stderr
    assert url in err and "access denied" in err


def test_ls_verify_and_inspect_on_gs(gcs_bucket):
    """The same commands on gs:// URLs, the emulator reached through STORAGE_EMULATOR_HOST as
    gcloud reaches it."""
    url = f"gs://{gcs_bucket}/run"
    m = ckptfmt.CheckpointManager(url)
    m.save(1, {"w": torch.zeros(10)}, metrics={"loss": 2.0})
    m.save(2, {"w": torch.ones(10)}, metrics={"loss": 1.0})
    out = json.loads(run_cli("ls", url, "--json", rc=0).stdout)
    assert [(r["step"], r["status"]) for r in out["steps"]] == [(1, "complete"), (2, "complete")]
    res = json.loads(run_cli("verify", url, "--json", rc=0).stdout)
    assert [f["status"] for f in res["files"]] == ["ok", "ok"]
    one = f"gs://{gcs_bucket}/one.ckpt"
    ckptfmt.save({"w": torch.arange(6)}, one)
    assert "OK" in run_cli("verify", one, rc=0).stdout
    assert "w" in run_cli("inspect", one, rc=0).stdout
    run_cli("inspect", f"gs://{gcs_bucket}/nothing.ckpt", rc=2)

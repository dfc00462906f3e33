"""Attacks on `ckptfmt verify` of an object, or of a run, whose store fails (503 SlowDown):
the exit statuses say 1 for a file that failed verification and 2 for "an object store that
refuses or fails a request" (cli/exitcodes.py).  A script that deletes what verify calls
damaged must never be told so of a sound checkpoint on a store that is down for a while."""

from __future__ import annotations

import json

import torch

import ckptfmt


def test_verify_of_a_sound_file_on_a_failing_store_is_exit_2_not_damaged(s3_faults, monkeypatch):
    from cli_runner import run_cli

    options = s3_faults.storage_options()
    url = f"s3://{s3_faults.new_bucket()}/x.ckpt"
    ckptfmt.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, url, storage_options=options)
    for name, var in (
        ("endpoint_url", "AWS_ENDPOINT_URL"),
        ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
        ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ):
        monkeypatch.setenv(var, options[name])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("CKPTFMT_STORAGE_DEADLINE", "5")
    s3_faults.fail_next("GET", "/x.ckpt", status=503, count=1000)
    out = run_cli("verify", url, "--json")
    statuses = [f["status"] for f in json.loads(out.stdout)["files"]]
    assert (out.returncode, statuses) == (2, ["unreadable"]), out.stdout
    s3_faults.clear_rules()
    run_cli("verify", url, rc=0)  # the file was sound all along


def test_verify_of_a_run_whose_store_refuses_a_record_never_calls_the_step_damaged(s3_faults, monkeypatch):
    from cli_runner import run_cli

    options = s3_faults.storage_options()
    url = f"s3://{s3_faults.new_bucket()}/run"
    manager = ckptfmt.CheckpointManager(url, storage_options=options)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((3,), float(step))})
    for name, var in (
        ("endpoint_url", "AWS_ENDPOINT_URL"),
        ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
        ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ):
        monkeypatch.setenv(var, options[name])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("CKPTFMT_STORAGE_DEADLINE", "5")
    s3_faults.fail_next("GET", "step-000000002/COMMIT", status=503, count=1000)
    out = run_cli("verify", url)
    assert "DAMAGED" not in out.stdout and out.returncode == 2, (out.returncode, out.stdout)


def test_verify_of_a_step_prefix_whose_store_fails_is_exit_2_unreadable(s3_faults, monkeypatch):
    """A URL naming one multi-file checkpoint (a prefix holding a commit record: here a run's
    step) whose store fails reading its state object: an "unreadable" entry in the JSON
    document, exit 2, never "failed"."""
    from cli_runner import run_cli

    options = s3_faults.storage_options()
    url = f"s3://{s3_faults.new_bucket()}/run"
    ckptfmt.CheckpointManager(url, storage_options=options).save(1, {"w": torch.full((3,), 1.0)})
    for name, var in (
        ("endpoint_url", "AWS_ENDPOINT_URL"),
        ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
        ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ):
        monkeypatch.setenv(var, options[name])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("CKPTFMT_STORAGE_DEADLINE", "5")
    s3_faults.fail_next("GET", "step-000000001/state", status=503, count=1000)
    out = run_cli("verify", f"{url}/step-000000001", "--json")
    statuses = [f["status"] for f in json.loads(out.stdout)["files"]]
    assert (out.returncode, statuses) == (2, ["unreadable"]), (out.returncode, out.stdout)

"""`ckptfmt ls DIR` and `ckptfmt verify DIR` on a checkpoint manager's run directory."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from cli_runner import run_cli

import ckptfmt


def run(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args)


@pytest.fixture()
def run_dir(tmp_path):
    """Steps 1..3 complete (loss 1/step), step 4 started but never committed."""
    mgr = ckptfmt.CheckpointManager(tmp_path / "run")
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((64,), float(step)), "step": step}, metrics={"loss": 1 / step})
    os.mkdir(tmp_path / "run" / "step-000000004")
    return tmp_path / "run"


def test_ls_lists_complete_and_incomplete_steps(run_dir):
    out = run("ls", str(run_dir))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["1", "2", "3", "4"]
    assert [line.split()[1] for line in lines] == ["complete"] * 3 + ["incomplete"]
    assert "loss=0.5" in lines[1] and "ago" in lines[1]
    assert "no commit record" in lines[3]


def test_ls_json_is_one_document_with_sizes_and_metrics(run_dir):
    out = run("ls", str(run_dir), "--json")
    assert out.returncode == 0
    doc = json.loads(out.stdout)
    steps = {s["step"]: s for s in doc["steps"]}
    assert steps[3]["status"] == "complete" and steps[3]["metrics"] == {"loss": 1 / 3}
    info = ckptfmt.CheckpointManager(run_dir).checkpoints()[-1]
    assert steps[3]["size"] == info.size > 0
    assert steps[4]["status"] == "incomplete"


def test_ls_shows_a_damaged_commit_record(run_dir):
    commit = run_dir / "step-000000002" / "COMMIT"
    data = bytearray(commit.read_bytes())
    data[80] ^= 1
    commit.write_bytes(bytes(data))
    doc = json.loads(run("ls", str(run_dir), "--json").stdout)
    row = next(s for s in doc["steps"] if s["step"] == 2)
    assert row["status"] == "damaged" and "COMMIT" in row["reason"]


def test_ls_of_a_missing_directory_is_a_usage_error(tmp_path):
    out = run("ls", str(tmp_path / "nope"))
    assert out.returncode == 2 and "not a directory" in out.stderr


def test_verify_run_directory_ok_and_incomplete_listed(run_dir):
    out = run("verify", str(run_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[:3] == [f"{run_dir}/step-00000000{n}: OK" for n in (1, 2, 3)]
    assert lines[3].startswith(f"{run_dir}/step-000000004: INCOMPLETE")


def test_verify_names_the_damaged_file_key_and_chunk(run_dir):
    state = run_dir / "step-000000002" / "state.ckpt"
    with ckptfmt.open(state) as r:
        k = r._file.storages[0].first_chunk
        offset = r._file.chunks[k].offset
    data = bytearray(state.read_bytes())
    data[offset + 3] ^= 0x10
    state.write_bytes(bytes(data))
    out = run("verify", str(run_dir), "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    failed = [f for f in doc["files"] if f["status"] == "failed"]
    assert [f["path"] for f in failed] == [str(run_dir / "step-000000002")]
    problem = failed[0]["problems"][0]
    assert problem["message"].startswith("state.ckpt: checksum mismatch")
    assert problem["key"] == "state['state']['w']" and problem["chunk"] == k


def test_verify_one_step_and_a_step_directory(run_dir):
    assert run("verify", str(run_dir), "--step", "3").returncode == 0
    out = run("verify", str(run_dir), "--step", "4")  # asked for it, and it is not a checkpoint
    assert out.returncode == 1 and "INCOMPLETE" in out.stdout
    assert run("verify", str(run_dir), "--step", "9").returncode == 1
    out = run("verify", str(run_dir / "step-000000001"))
    assert out.returncode == 0 and out.stdout.strip().endswith("step-000000001: OK")


def test_convert_and_ls_of_a_dcp_directory(tmp_path):
    from ckptfmt import dcp as cdcp

    sd = {"w": torch.arange(12.0).reshape(3, 4), "n": {"step": 7}}
    cdcp.save(sd, str(tmp_path / "dcp"))  # one process, no process group
    out = run("ls", str(tmp_path / "dcp"), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["complete"] and [f["status"] for f in info["files"]] == ["ok"]
    out = run("convert", str(tmp_path / "dcp"), str(tmp_path / "one.ckpt"))
    assert out.returncode == 0, out.stderr
    one = ckptfmt.load(tmp_path / "one.ckpt")
    assert torch.equal(one["w"], sd["w"]) and one["n"]["step"] == 7
    os.unlink(tmp_path / "dcp" / "rank-00000.ckpt")
    out = run("verify", str(tmp_path / "dcp"))
    assert out.returncode == 1 and "rank-00000.ckpt" in out.stdout
    assert run("convert", str(tmp_path / "dcp"), str(tmp_path / "two.ckpt")).returncode == 1

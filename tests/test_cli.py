"""The ckptfmt command, run for real in a subprocess: output and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_runner import run_cli

import ckptfmt

CORPUS = os.path.join(os.path.dirname(__file__), "corpus")


def run_entry_point(*args: str, check_rc: int | None = None) -> subprocess.CompletedProcess:
    """``python -m ckptfmt ARGS`` in a fresh interpreter: the real entry point."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfmt", *args], capture_output=True, text=True, timeout=120
    )
    if check_rc is not None:
        assert proc.returncode == check_rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def run(*args: str, check_rc: int | None = None) -> subprocess.CompletedProcess:
    """The command line in this process (no interpreter and torch import per call)."""
    return run_cli(*args, rc=check_rc)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(300, 200, generator=g), "b": torch.zeros(200)},
        "step": 5,
        "rng": np.random.get_state(),
    }
    good = d / "good.ckpt"
    ckptfmt.save(state, good, compression="zstd", metadata={"run": "cli"}, chunk_size=1 << 16)
    bad = d / "bad.ckpt"
    data = bytearray(good.read_bytes())
    with ckptfmt.open(good) as r:
        ch = r._file.chunks[1]
    data[ch.offset + 5] ^= 0x04
    bad.write_bytes(bytes(data))
    trunc = d / "trunc.ckpt"
    trunc.write_bytes(good.read_bytes()[:5000])
    pt = d / "model.pt"
    torch.save({"w": torch.arange(6.0).view(2, 3), "n": torch.tensor(3)}, pt)
    return {"dir": d, "good": good, "bad": bad, "trunc": trunc, "pt": pt, "state": state}


def test_verify_ok(files):
    out = run_entry_point("verify", str(files["good"]), check_rc=0)
    assert out.stdout == f"{files['good']}: OK\n"
    assert out.stderr == ""


def test_verify_failed_names_key_chunk_offset(files):
    out = run("verify", str(files["good"]), str(files["bad"]), check_rc=1)
    lines = out.stdout.splitlines()
    assert lines[0] == f"{files['good']}: OK"
    assert lines[1].startswith(
        f"{files['bad']}: FAILED corrupt: checksum mismatch [key state['model']['w'], chunk 1, offset "
    )


def test_verify_truncated_is_incomplete(files):
    out = run("verify", str(files["trunc"]), check_rc=1)
    assert "FAILED incomplete" in out.stdout


def test_verify_json_is_one_document(files):
    out = run("verify", "--json", str(files["good"]), str(files["bad"]), check_rc=1)
    doc = json.loads(out.stdout)
    assert [f["status"] for f in doc["files"]] == ["ok", "failed"]
    p = doc["files"][1]["problems"][0]
    assert p["kind"] == "corrupt" and p["chunk"] == 1 and p["key"] == "state['model']['w']"
    assert isinstance(p["offset"], int)


def test_verify_quick_skips_chunks(files):
    run("verify", "--quick", str(files["bad"]), check_rc=0)
    run("verify", "--quick", str(files["trunc"]), check_rc=1)


def test_verify_recognises_other_formats_by_magic(files):
    renamed = files["dir"] / "looks_like.ckpt"
    renamed.write_bytes(files["pt"].read_bytes())
    out = run("verify", str(renamed), check_rc=2)
    assert "NOT CKPTFMT torch.save zip archive" in out.stdout
    from safetensors.torch import save_file

    st = files["dir"] / "x.ckpt"
    save_file({"a": torch.ones(2)}, str(st))
    out = run("verify", str(st), check_rc=2)
    assert "NOT CKPTFMT safetensors file" in out.stdout


def test_verify_missing_file_and_usage(files):
    out = run_entry_point("verify", str(files["dir"] / "missing"), check_rc=2)
    assert "UNREADABLE" in out.stdout
    run("verify", check_rc=2)
    run("frobnicate", check_rc=2)
    run_entry_point(check_rc=2)


def test_corpus_through_cli():
    names = sorted(f for f in os.listdir(CORPUS) if f.endswith(".ckpt"))
    out = run("verify", "--json", *[os.path.join(CORPUS, n) for n in names], check_rc=2)
    doc = json.loads(out.stdout)
    statuses = {os.path.basename(f["path"]): f["status"] for f in doc["files"]}
    assert statuses.pop("not_ckptfmt.ckpt") == "not-ckptfmt"
    assert set(statuses.values()) == {"failed"}


def test_inspect_shows_the_first_nodes_and_says_so(tmp_path):
    """A file of many nodes: inspect lists the first 1000 (--max-nodes N, 0 for all) and says
    how many there are, instead of printing them all (10^6 small nodes took over 20 s)."""
    p = tmp_path / "many.ckpt"
    ckptfmt.save({"l": list(range(5000))}, p)
    out = run("inspect", str(p), check_rc=0).stdout
    assert "  [997]: 997" in out and "[998]" not in out
    assert "the first 1000 nodes shown, of 5003 in the file" in out and "--max-nodes 0 all" in out
    assert "  [4999]: 4999" in run("inspect", "--max-nodes", "0", str(p), check_rc=0).stdout
    doc = json.loads(run("inspect", "--json", "--max-nodes", "10", str(p), check_rc=0).stdout)
    assert len(doc["tree"]) == 10 and doc["tree_truncated"] and doc["nodes"] == 5003
    doc = json.loads(run("inspect", "--json", "--max-nodes", "0", str(p), check_rc=0).stdout)
    assert len(doc["tree"]) == 5002 and not doc["tree_truncated"]
    assert "non-negative" in run("inspect", "--max-nodes", "-1", str(p), check_rc=2).stderr


@pytest.mark.parametrize("cmd", ["verify", "inspect", "convert", "diff", "info"])
def test_help_documents_exit_codes(cmd):
    out = run(cmd, "--help", check_rc=0)
    assert "exit status:" in out.stdout and "  2  usage error" in out.stdout


def test_inspect(files):
    out = run("inspect", str(files["good"]), check_rc=0)
    assert "['w']: tensor float32 [300, 200] 240000 B zstd" in out.stdout
    assert 'metadata: {"run": "cli"}' in out.stdout
    doc = json.loads(run("inspect", "--json", str(files["good"]), check_rc=0).stdout)
    w = next(r for r in doc["tree"] if r["key"] == "state['model']['w']")
    assert w["dtype"] == "float32" and w["shape"] == [300, 200] and w["codec"] in ("zstd", "raw+zstd")
    b = next(r for r in doc["tree"] if r["key"] == "state['model']['b']")
    assert b["ratio"] > 10  # zeros compress
    assert doc["metadata"] == {"run": "cli"} and doc["producer"]["format"] == "1.0"


def test_convert_torch_save_and_back_to_safetensors(files):
    d = files["dir"]
    dst = d / "converted.ckpt"
    run("convert", str(files["pt"]), str(dst), "--compression", "zstd", check_rc=0)
    back = ckptfmt.load(dst)
    assert torch.equal(back["w"], torch.arange(6.0).view(2, 3)) and back["n"].item() == 3
    st = d / "out.safetensors"
    run("convert", str(dst), str(st), check_rc=0)
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(st))["w"], back["w"])
    again = d / "again.ckpt"
    run("convert", str(st), str(again), check_rc=0)
    assert torch.equal(ckptfmt.load(again)["w"], back["w"])


def test_convert_non_tensor_state_to_safetensors_fails_clearly(files):
    out = run("convert", str(files["good"]), str(files["dir"] / "x.safetensors"), check_rc=2)
    assert "cannot convert to safetensors" in out.stderr and "state" not in out.stdout


def test_convert_refuses_pickle_that_weights_only_rejects(files):
    evil = files["dir"] / "evil.pt"
    torch.save({"obj": np.random.get_state()}, evil)  # needs a non-allow-listed global
    out = run("convert", str(evil), str(files["dir"] / "evil.ckpt"), check_rc=1)
    assert "UnpicklingError" in out.stderr
    assert not (files["dir"] / "evil.ckpt").exists()


def test_diff(files):
    d = files["dir"]
    run("diff", str(files["good"]), str(files["good"]), check_rc=0)
    state = files["state"]
    changed = {
        "model": {"w": state["model"]["w"].clone(), "b": state["model"]["b"]},
        "step": 6,
        "extra": 1,
        "rng": state["rng"],
    }
    changed["model"]["w"][0, 0] += 0.5
    other = d / "other.ckpt"
    ckptfmt.save(changed, other)
    out = run("diff", str(files["good"]), str(other), check_rc=1)
    assert "state['model']['w']: values (differing 1, max_abs_diff 0.5)" in out.stdout
    assert "state['step']: value (a 5, b 6)" in out.stdout
    assert "state['extra']: only in B" in out.stdout
    doc = json.loads(run("diff", "--json", str(files["good"]), str(other), check_rc=1).stdout)
    assert doc["identical"] is False and len(doc["differences"]) == 3
    run("diff", str(files["good"]), str(files["bad"]), check_rc=1)  # a damaged file: 1, as from every command


def test_info():
    doc = json.loads(run("info", "--json", check_rc=0).stdout)
    assert doc["ckptfmt"] == ckptfmt.__version__ and doc["format"] == "1.0"
    assert doc["backend"] == ckptfmt.backend()

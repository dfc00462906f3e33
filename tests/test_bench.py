"""The benchmark harness runs end to end on a tiny state; its report is complete and consistent.

No timing assertions: only that every figure is there and the ratios agree with
the raw times they were computed from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
RUN = os.path.join(HERE, "..", "bench", "run.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [
            sys.executable,
            RUN,
            "--sizes",
            "4M",
            "--dtypes",
            "bf16",
            "--rounds",
            "2",
            "--targets",
            "tmpfs,disk",
            "--tools",
            "ckptfmt,ckptfmt-zstd,torch,safetensors",
            "--out",
            str(out),
            "--disk-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round 2/2" in proc.stdout  # progress is printed
    doc = json.loads((out / "latest.json").read_text())
    doc["_md"] = (out / "latest.md").read_text()
    doc["_png"] = (out / "latest.png").read_bytes()
    return doc


def test_report_has_every_field(report):
    for key in ("command", "started", "machine", "versions", "notes", "cases", "seconds", "cache_eviction"):
        assert key in report
    assert report["machine"]["cores"] >= 1 and report["machine"]["memory_bytes"] > 0
    assert set(report["machine"]["targets"]) == {"tmpfs", "disk"}
    assert report["versions"]["ckptfmt_backend"] in ("python", "c")
    assert "fsync added" in report["notes"]["torch"]
    assert len(report["cases"]) == 2  # 2 targets
    for case in report["cases"]:
        assert case["state_bytes"] > 3 << 20
        stats = case["stats"]
        assert set(stats) == {"dd", "ckptfmt", "ckptfmt-zstd", "torch", "safetensors"}
        assert set(stats["ckptfmt"]) == {
            "save",
            "save_nb_blocked",
            "save_nb_durable",
            "load_cold",
            "load_warm",
            "load_mmap_cold",
            "load_mmap_warm",
            "lazy",
            "load_into",
            "verify_cold",
            "verify_warm",
        }
        assert {
            "save",
            "load_cold",
            "load_warm",
            "load_mmap_cold",
            "load_mmap_warm",
            "lazy",
            "load_into",
        } <= set(stats["torch"])
        assert set(stats["dd"]) == {"save", "load_cold", "load_warm"}
        for tool in stats.values():
            for op in tool.values():
                assert op["seconds"]["n"] == 2
                assert op["seconds"]["min"] <= op["seconds"]["median"] <= op["seconds"]["max"]
        assert stats["ckptfmt-zstd"]["save"]["file_bytes"] < stats["ckptfmt"]["save"]["file_bytes"]


def test_ratios_agree_with_raw_figures(report):
    for case in report["cases"]:
        stats, ratios = case["stats"], case["ratios"]
        for peer, ops in ratios.items():
            for op, r in ops.items():
                mine = stats["ckptfmt"][op]["seconds"]
                theirs = stats[peer][op]["seconds"]
                # each per-round ratio lies between the extreme quotients of the raw times
                assert (
                    theirs["min"] / mine["max"] - 1e-9
                    <= r["min"]
                    <= r["max"]
                    <= theirs["max"] / mine["min"] + 1e-9
                )
        gb = stats["ckptfmt"]["save"]["gbps"]["median"]
        secs = stats["ckptfmt"]["save"]["seconds"]
        assert case["state_bytes"] / secs["max"] / 1e9 <= gb <= case["state_bytes"] / secs["min"] / 1e9


def test_markdown_and_chart(report):
    md = report["_md"]
    assert "| operation | dd | ckptfmt |" in md and "durable save" in md and "File sizes:" in md
    assert report["_png"][:8] == b"\x89PNG\r\n\x1a\n"

"""Checkpoint files and runs on az:// (and abfs://) URLs: a real Azurite blob service over HTTP
(tests/azure_server.py), reached through AZURE_STORAGE_CONNECTION_STRING as Azure's own tools
reach it.  Azurite checks every condition ckptfmt relies on (If-None-Match: * on a blob and on
a block list, If-Match on reads and deletes), so each guarantee is tested here."""

from __future__ import annotations

import json
import re

import pytest
import torch
from cli_runner import run_cli
from helpers import assert_same

import ckptfmt
from ckptfmt.errors import LimitError, ObjectExistsError, StorageError, UnsupportedError
from ckptfmt.storage import listing
from ckptfmt.storage.upload import ObjectFile
from ckptfmt.storage.urls import parse_url
from ckptfmt.storage.wholeget import fetch_whole

MiB = 1 << 20


def _state(n: int = 1000, seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=g),
        "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "step": 12,
    }


@pytest.mark.parametrize("scheme", ["az", "abfs"])
def test_save_load_open_load_into_and_verify_on_azure(azure_container, scheme):
    url = f"{scheme}://{azure_container}/runs/x.ckpt"
    state = _state()
    ckptfmt.save(state, url)
    assert_same(state, ckptfmt.load(url))
    with ckptfmt.open(url) as f:
        assert torch.equal(f.get("w"), state["w"])
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    ckptfmt.load_into(url, into)
    assert_same(state, into)
    assert ckptfmt.verify(url).ok
    prefix = parse_url(f"{scheme}://{azure_container}/runs", need_key=False)
    assert set(listing.objects(prefix, {})) == {"x.ckpt"}


def test_a_large_object_commits_its_block_list_whole(azure_container):
    url = f"az://{azure_container}/big.ckpt"
    state = {"w": torch.randn(5 * MiB)}  # 20 MiB: three blocks of 8 MiB, the first sent last
    ckptfmt.save(state, url, storage_options={"part_size": 8 * MiB})
    assert_same(state, ckptfmt.load(url, storage_options={"request_size": 4 * MiB}))


@pytest.mark.parametrize("size", [5, 20 * MiB], ids=["one-put", "block-list"])
def test_an_object_is_created_only_if_absent(azure_container, size):
    url = f"az://{azure_container}/step/COMMIT"
    options = {"part_size": 8 * MiB}
    for fill, refused in ((b"a", False), (b"b", True)):
        with ObjectFile(url, options, size, if_absent=True) as out:
            assert out.spool is not None
            out.spool.view(0, size)[:] = fill * size
            out.written(size)
            if refused:
                with pytest.raises(ObjectExistsError, match="exists already"):
                    out.commit()
            else:
                out.commit()
    assert bytes(fetch_whole(url, {}, size + 1).view(0, 1)) == b"a"


def test_an_object_replaced_while_it_is_read_fails_instead_of_mixing_versions(azure_container):
    url = f"az://{azure_container}/x.ckpt"
    ckptfmt.save({"w": torch.zeros(300_000)}, url)
    with ckptfmt.open(url) as f:
        ckptfmt.save({"w": torch.ones(300_000)}, url)
        with pytest.raises(StorageError, match="changed while it was being read"):
            f.get("w")


def test_a_conditional_delete_spares_another_writers_version(azure_container):
    url = f"az://{azure_container}/x.ckpt"
    ckptfmt.save({"w": torch.zeros(10)}, url)
    prefix = parse_url(f"az://{azure_container}", need_key=False)
    stale = listing.versions(prefix, {})["x.ckpt"]
    ckptfmt.save({"w": torch.ones(10)}, url)  # another writer's version now
    assert listing.delete_object(parse_url(url), {}, if_match=stale) is False
    assert torch.equal(ckptfmt.load(url)["w"], torch.ones(10))
    assert listing.delete_object(parse_url(url), {}, if_match=listing.versions(prefix, {})["x.ckpt"])
    with pytest.raises(FileNotFoundError):
        ckptfmt.load(url)


def test_a_run_on_azure_saves_rotates_and_resumes_on_a_fresh_manager(azure_container):
    url = f"az://{azure_container}/run"
    m = ckptfmt.CheckpointManager(url, keep_last=2)
    for step in (1, 2, 3):
        m.save(step, _state(seed=step), metrics={"loss": 1.0 / step})
    m.wait()
    fresh = ckptfmt.CheckpointManager(url)
    assert [c.step for c in fresh.checkpoints()] == [2, 3]
    assert_same(_state(seed=3), fresh.load())
    assert fresh.verify().ok


def test_a_tiered_run_archives_to_azure_and_a_fresh_node_resumes_bit_exactly(azure_container, tmp_path):
    archive = f"az://{azure_container}/archive"
    m = ckptfmt.CheckpointManager(tmp_path / "node1", archive=archive, keep_last=1)
    for step in (1, 2):
        m.save(step, _state(seed=step))
    m.wait()
    assert m.archive_failures() == {}
    fresh = ckptfmt.CheckpointManager(tmp_path / "node2", archive=archive)
    info = fresh.latest()
    assert info is not None and info.step == 2
    assert_same(_state(seed=2), fresh.load())


def test_ls_verify_and_inspect_on_azure(azure_container):
    url = f"az://{azure_container}/run"
    ckptfmt.CheckpointManager(url).save(1, {"w": torch.zeros(10)})
    out = json.loads(run_cli("ls", url, "--json", rc=0).stdout)
    assert [(r["step"], r["status"]) for r in out["steps"]] == [(1, "complete")]
    assert [f["status"] for f in json.loads(run_cli("verify", url, "--json", rc=0).stdout)["files"]] == ["ok"]
    one = f"abfs://{azure_container}/one.ckpt"
    ckptfmt.save({"w": torch.arange(6)}, one)
    assert "w" in run_cli("inspect", one, rc=0).stdout


def test_credentials_options_and_names_are_checked(azure_container, azure_server, monkeypatch):
    with pytest.raises(UnsupportedError, match="'token' does not apply to az://"):
        ckptfmt.save({"w": torch.zeros(2)}, f"az://{azure_container}/x", storage_options={"token": "anon"})
    with pytest.raises(UnsupportedError, match="not a valid bucket name"):
        ckptfmt.load("az://bad--name/x")
    ckptfmt.save({"w": torch.zeros(2)}, f"az://{azure_container}/x")
    wrong = re.sub("AccountKey=[^;]*", "AccountKey=d3Jvbmc=", azure_server.connection_string)
    with pytest.raises(StorageError, match="access denied") as e:
        ckptfmt.load(f"az://{azure_container}/x", storage_options={"connection_string": wrong})
    assert f"az://{azure_container}/x" in str(e.value)
    with pytest.raises(StorageError, match="not base64") as e:
        ckptfmt.load(
            f"az://{azure_container}/x", storage_options={"connection_string": wrong + "AccountKey=%;"}
        )
    assert f"az://{azure_container}/x" in str(e.value)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StorageError, match="AZURE_STORAGE_CONNECTION_STRING"):
        ckptfmt.load(f"az://{azure_container}/x")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_cdcp_and_the_lightning_plugin_on_azure(azure_container):
    pytest.importorskip("lightning")
    from ckptfmt import dcp as cdcp
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    state = {"big": torch.arange(MiB, dtype=torch.float32), "small": torch.arange(10.0)}
    cdcp.save(state, f"az://{azure_container}/dcp")
    got = {"big": torch.zeros(MiB), "small": torch.zeros(10)}
    cdcp.load(got, f"az://{azure_container}/dcp")
    assert_same(state, got)
    io = CkptfmtCheckpointIO(blocking=False)
    url = f"abfs://{azure_container}/run/a.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(5)}, "global_step": 3}, url)
    io.teardown()
    assert io.load_checkpoint(url)["global_step"] == 3
    io.remove_checkpoint(url)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(url)


def test_a_reset_mid_download_is_resumed_and_5xx_answers_are_retried(azure_faults):
    url = f"az://{azure_faults.container}/x.ckpt"
    state = {"w": torch.randn(3 * MiB)}
    azure_faults.fail_next("PUT", "x.ckpt", status=503, count=2)
    ckptfmt.save(state, url)  # two refusals, then stored
    azure_faults.reset_on("GET", "x.ckpt", nth=3, download_bytes=100_000)
    assert_same(state, ckptfmt.load(url, storage_options={"request_size": 4 * MiB}))
    assert azure_faults.pending_rules() == 0
    azure_faults.fail_next("GET", "", status=503, count=10**6)
    with pytest.raises(StorageError, match=r"max_attempts 2.*HTTP 503") as e:
        ckptfmt.load(url, storage_options={"max_attempts": 2})
    assert url in str(e.value)


@pytest.mark.parametrize(
    "body",
    [
        b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa">]><EnumerationResults/>',
        b"<EnumerationResults><Blobs><Blob><Name>other/secret</Name><Properties>"
        b"<Content-Length>1</Content-Length></Properties></Blob></Blobs></EnumerationResults>",
        b"<EnumerationResults><Blobs>" + b"<Blob><Name>run/x</Name></Blob>" * 600_000,
    ],
    ids=["declares-a-dtd", "outside-the-prefix", "above-the-limit"],
)
def test_a_hostile_listing_is_refused_and_nothing_deleted(body, monkeypatch):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_DELETE(self) -> None:  # noqa: N802
            seen.append("DELETE " + self.path)
            self.send_response(202)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/devstoreaccount1"
        monkeypatch.setenv(
            "AZURE_STORAGE_CONNECTION_STRING",
            f"AccountName=devstoreaccount1;AccountKey=a2V5;BlobEndpoint={endpoint}",
        )
        from ckptfmt.runs.objectrun import ObjectRun

        with pytest.raises((StorageError, LimitError)) as e:
            ObjectRun("az://container/run", {"max_attempts": 1}).remove_interrupted_copies()
        assert "az://container/run" in str(e.value)
        assert not [p for p in seen if p.startswith("DELETE")]
    finally:
        server.shutdown()
        server.server_close()

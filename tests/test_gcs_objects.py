"""Checkpoint files and runs on gs:// URLs: a real fake-gcs-server over HTTP (tests/gcs_server.py),
reached through STORAGE_EMULATOR_HOST as Google's own clients reach it, through the fault
proxy (tests/s3_faults.py) where a fault is needed.

What the emulator cannot check, and so is not tested here (tests/gcs_server.py measures it):
``ifGenerationMatch=0`` on a compose (the create-only commit of a large object; the commit
record, one multipart request, is checked), and ``ifGenerationMatch`` on a delete.
"""

from __future__ import annotations

import datetime
import json

import pytest
import torch
from helpers import assert_same

import ckptfmt
import ckptfmt.storage.wholeget
from ckptfmt.errors import ObjectExistsError, StorageError, UnsupportedError
from ckptfmt.storage import gcs, listing, upload
from ckptfmt.storage.upload import ObjectFile
from ckptfmt.storage.urls import parse_url

MiB = 1 << 20


def _state(n: int = 1000, seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=g),
        "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "step": 12,
        "opt": {"lr": 0.1, "betas": (0.9, 0.999)},
    }


def _names(gcs_server, bucket: str) -> list[str]:
    """Every object in the bucket, part objects included, as the emulator lists them."""
    status, body = gcs_server.call("GET", f"/storage/v1/b/{bucket}/o")
    assert status == 200
    return sorted(item["name"] for item in json.loads(body).get("items", []))


def test_save_load_open_load_into_and_verify_on_gs(gcs_bucket, gcs_server):
    url = f"gs://{gcs_bucket}/runs/x.ckpt"
    state = _state()
    ckptfmt.save(state, url)
    assert_same(state, ckptfmt.load(url))
    with ckptfmt.open(url) as f:
        assert f.keys() == list(state)
        assert torch.equal(f.get("w"), state["w"])
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    ckptfmt.load_into(url, into)
    assert_same(state, into)
    assert ckptfmt.verify(url).ok
    assert _names(gcs_server, gcs_bucket) == ["runs/x.ckpt"]


def test_a_large_object_is_composed_from_its_parts_in_rounds_and_none_are_left(
    gcs_bucket, gcs_server, monkeypatch
):
    # 3 parts of 8 MiB composed 2 at a time: two rounds, as 10,000 parts are 32 at a time
    monkeypatch.setattr(gcs, "MAX_COMPOSE", 2)
    url = f"gs://{gcs_bucket}/big.ckpt"
    state = {"w": torch.randn(5 * MiB)}  # 20 MiB
    ckptfmt.save(state, url, storage_options={"part_size": 8 * MiB})
    assert_same(state, ckptfmt.load(url, storage_options={"request_size": 4 * MiB}))
    assert _names(gcs_server, gcs_bucket) == ["big.ckpt"]


def test_a_commit_record_is_created_only_if_absent(gcs_bucket):
    url = f"gs://{gcs_bucket}/step/COMMIT"
    for data, expected in ((b"first", None), (b"second", ObjectExistsError)):
        with ObjectFile(url, {}, len(data), if_absent=True) as out:
            assert out.spool is not None
            out.spool.view(0, len(data))[:] = data
            if expected is None:
                out.commit()
            else:
                with pytest.raises(expected, match="exists already"):
                    out.commit()
    assert bytes(ckptfmt.storage.wholeget.fetch_whole(url, {}, 100).view(0, 5)) == b"first"


def test_an_object_replaced_while_it_is_read_fails_instead_of_mixing_versions(gcs_bucket):
    url = f"gs://{gcs_bucket}/x.ckpt"
    ckptfmt.save({"w": torch.zeros(300_000)}, url)
    with ckptfmt.open(url) as f:
        ckptfmt.save({"w": torch.ones(300_000)}, url)  # a new generation
        with pytest.raises(StorageError, match="changed while it was being read"):
            f.get("w")


def test_a_crashed_upload_is_hidden_from_listings_and_removed_once_stale(gcs_bucket, gcs_server):
    url = f"gs://{gcs_bucket}/run/step-000000001/state.ckpt"
    out = ObjectFile(url, {"part_size": 8 * MiB}, 32 * MiB)
    out.__enter__()
    assert out.spool is not None
    out.spool.view(0, 24 * MiB)[:] = b"x" * (24 * MiB)
    out.written(24 * MiB)  # parts 2 and 3 uploaded; the saver dies before its commit
    out._wait_all()
    out.close()
    left = _names(gcs_server, gcs_bucket)
    assert len(left) == 2 and all(gcs.PART_MARK in n for n in left)
    prefix = parse_url(f"gs://{gcs_bucket}/run", need_key=False)
    assert listing.objects(prefix, {}) == {}  # as S3 lists no multipart upload's parts
    # not stale yet: left; stale and ckptfmt's: removed; another program's name: never
    began: list[datetime.datetime] = []

    def at_start(oldest: datetime.datetime) -> datetime.datetime:  # none begun before it
        began.append(oldest)
        return oldest

    def after(oldest: datetime.datetime) -> datetime.datetime:
        return oldest + datetime.timedelta(seconds=1)

    assert listing.abort_uploads_begun_before(prefix, {}, lambda k: True, at_start) == 0
    assert listing.abort_uploads_begun_before(prefix, {}, lambda k: False, after) == 0
    assert len(_names(gcs_server, gcs_bucket)) == 2 and len(began) == 1
    assert listing.abort_uploads_begun_before(prefix, {}, lambda k: True, after) == 1
    assert _names(gcs_server, gcs_bucket) == []


def test_a_run_on_gs_saves_rotates_and_resumes_on_a_fresh_manager(gcs_bucket):
    url = f"gs://{gcs_bucket}/run"
    m = ckptfmt.CheckpointManager(url, keep_last=2)
    for step in (1, 2, 3):
        m.save(step, _state(seed=step), metrics={"loss": 1.0 / step})
    m.wait()
    fresh = ckptfmt.CheckpointManager(url)
    assert [c.step for c in fresh.checkpoints()] == [2, 3]
    info = fresh.latest()
    assert info is not None and info.step == 3 and info.metrics == {"loss": 1.0 / 3}
    assert_same(_state(seed=3), fresh.load())
    assert fresh.verify().ok
    fresh.remove(2)
    assert [c.step for c in fresh.checkpoints()] == [3]


def test_a_tiered_run_archives_to_gs_and_a_fresh_node_resumes_bit_exactly(gcs_bucket, tmp_path):
    archive = f"gs://{gcs_bucket}/archive"
    m = ckptfmt.CheckpointManager(tmp_path / "node1", archive=archive, keep_last=1)
    for step in (1, 2):
        m.save(step, _state(seed=step))
    m.wait()
    assert m.archive_failures() == {}
    # a fresh node: an empty local tier, the archive on the store
    fresh = ckptfmt.CheckpointManager(tmp_path / "node2", archive=archive)
    info = fresh.latest()
    assert info is not None and info.step == 2
    assert_same(_state(seed=2), fresh.load())
    assert [c.step for c in ckptfmt.CheckpointManager(archive).checkpoints()][-1] == 2


def test_options_of_another_store_and_bad_bucket_names_are_refused(gcs_bucket):
    with pytest.raises(UnsupportedError, match="aws_access_key_id.*does not apply to gs://"):
        ckptfmt.save(
            {"w": torch.zeros(2)}, f"gs://{gcs_bucket}/x", storage_options={"aws_access_key_id": "k"}
        )
    with pytest.raises(UnsupportedError, match="not a valid bucket name"):
        ckptfmt.load("gs://UPPER/x")
    with pytest.raises(FileNotFoundError):
        ckptfmt.load(f"gs://{gcs_bucket}/missing.ckpt")


def test_a_connection_reset_mid_download_is_resumed(gcs_faults):
    url = f"gs://{gcs_faults.bucket}/x.ckpt"
    state = {"w": torch.randn(3 * MiB)}
    ckptfmt.save(state, url)
    gcs_faults.reset_on("GET", "alt=media", nth=3, download_bytes=100_000)
    assert_same(state, ckptfmt.load(url, storage_options={"request_size": 4 * MiB}))
    assert gcs_faults.pending_rules() == 0


def test_5xx_answers_are_retried_within_the_budget_then_named(gcs_faults):
    url = f"gs://{gcs_faults.bucket}/x.ckpt"
    gcs_faults.fail_next("POST", "uploadType", status=503, count=2)
    ckptfmt.save({"w": torch.zeros(10)}, url)  # two refusals, then stored
    gcs_faults.fail_next("GET", "", status=503, count=10**6)
    with pytest.raises(StorageError, match=r"max_attempts 2.*HTTP 503") as e:
        ckptfmt.load(url, storage_options={"max_attempts": 2})
    assert url in str(e.value)


def test_a_trickling_answer_is_cut_off_at_its_deadline(gcs_faults):
    url = f"gs://{gcs_faults.bucket}/x.ckpt"
    ckptfmt.save({"w": torch.zeros(100_000)}, url)
    gcs_faults.trickle("GET", "alt=media", after_bytes=10, interval=0.5)
    options = {"request_timeout": 1, "deadline": 4, "max_attempts": 2}
    with pytest.raises(StorageError, match="did not arrive within"):
        ckptfmt.load(url, storage_options=options)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_cdcp_save_and_a_partial_load_on_gs(gcs_faults):
    from ckptfmt import dcp as cdcp

    url = f"gs://{gcs_faults.bucket}/dcp"
    options = {"request_size": MiB}
    state = {"big": torch.arange(6 * MiB // 4, dtype=torch.float32), "small": torch.arange(10.0)}
    cdcp.save(state, url, storage_options=options)
    gcs_faults.clear_counts()
    small = {"small": torch.zeros(10)}
    cdcp.load(small, url, storage_options=options)
    assert torch.equal(small["small"], state["small"])
    # the small tensor needs the rank file's head and tail only, not its 6 MiB
    assert 1 <= gcs_faults.count("GET", "rank-00000.ckpt?alt=media") <= 3
    big = {"big": torch.zeros(6 * MiB // 4)}
    cdcp.load(big, url, storage_options=options)
    assert torch.equal(big["big"], state["big"])


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_the_lightning_plugin_saves_loads_and_removes_gs_objects(gcs_bucket, gcs_server, blocking):
    # the plugin's own calls (Lightning's CheckpointIO); Lightning's questions about a
    # directory (ModelCheckpoint's) go through fsspec, which serves gs:// with gcsfs
    pytest.importorskip("lightning")
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    io = CkptfmtCheckpointIO(blocking=blocking)
    url = f"gs://{gcs_bucket}/run/a.ckpt"
    state = {"state_dict": {"w": torch.randn(1 << 18)}, "global_step": 7}
    io.save_checkpoint(state, url)
    io.save_checkpoint({"w": torch.zeros(3)}, f"gs://{gcs_bucket}/run/b.ckpt")
    io.teardown()
    got = io.load_checkpoint(url)
    assert got["global_step"] == 7 and torch.equal(got["state_dict"]["w"], state["state_dict"]["w"])
    io.remove_checkpoint(url)
    io.remove_checkpoint(url)  # an absent object: nothing to do
    assert _names(gcs_server, gcs_bucket) == ["run/b.ckpt"]
    with pytest.raises(FileNotFoundError, match="a.ckpt"):
        io.load_checkpoint(url)


def test_a_compose_refused_once_is_retried_with_its_parts_still_there(gcs_faults, gcs_server):
    url = f"gs://{gcs_faults.bucket}/big.ckpt"
    state = {"w": torch.randn(5 * MiB)}  # three parts of 8 MiB
    gcs_faults.fail_next("POST", "/compose", status=503, count=1)
    ckptfmt.save(state, url, storage_options={"part_size": 8 * MiB})
    assert gcs_faults.pending_rules() == 0
    assert_same(state, ckptfmt.load(url))
    assert _names(gcs_server, gcs_faults.bucket) == ["big.ckpt"]


def test_the_parts_of_a_composed_object_are_deleted_together(gcs_faults, gcs_server):
    """Once composed, an object's parts are deleted `concurrency` requests at a time: all of
    them are asked for while the first is still held (one after another, 17 parts' deletes
    took 0.1 s of a 256 MiB save on the emulator)."""
    import threading
    import time

    url = f"gs://{gcs_faults.bucket}/together.ckpt"
    state = {"w": torch.randn(40 * MiB // 4, generator=torch.Generator().manual_seed(4))}
    options = {"part_size": 8 * MiB}  # six parts: five of 8 MiB and the tail's
    held = gcs_faults.hold("DELETE", gcs.PART_MARK)
    failure: list[BaseException] = []

    def save() -> None:
        try:
            ckptfmt.save(state, url, storage_options=options)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failure.append(e)

    saving = threading.Thread(target=save)
    saving.start()
    deadline = time.monotonic() + 30
    while gcs_faults.count("DELETE", gcs.PART_MARK) < 6 and time.monotonic() < deadline and saving.is_alive():
        time.sleep(0.05)
    asked = gcs_faults.count("DELETE", gcs.PART_MARK)
    held.set()
    saving.join(60)
    assert not failure, failure
    assert asked == 6, f"{asked} of the 6 parts' deletes asked for while the first was held"
    assert [n for n in _names(gcs_server, gcs_faults.bucket) if gcs.PART_MARK in n] == []
    assert_same(state, ckptfmt.load(url))


def _refused_composes(gcs_faults) -> None:
    """Every compose refused for good (403: not retried)."""
    gcs_faults.fail_next("POST", "/compose", status=403, count=1000)


def test_a_refused_compose_stops_the_composes_not_yet_sent(gcs_faults, monkeypatch):
    """16 parts composed 2 at a time: 8 composes of the first level, 2 in flight at once.
    Once one is refused no other is sent: at most the 2 in flight, not all 8."""
    monkeypatch.setattr(gcs, "MAX_COMPOSE", 2)
    monkeypatch.setattr(upload, "MIN_PART", MiB)  # 16 parts of 1 MiB (GCS has no minimum)
    url = f"gs://{gcs_faults.bucket}/refused.ckpt"
    _refused_composes(gcs_faults)
    with pytest.raises(StorageError):
        ckptfmt.save({"w": torch.zeros(4 * MiB)}, url, storage_options={"part_size": MiB, "concurrency": 2})
    assert 1 <= gcs_faults.count("POST", "/compose") <= 2


_COMPOSE_IN_ATEXIT = """
import atexit, sys, torch, ckptfmt
from ckptfmt.storage import gcs, upload
gcs.MAX_COMPOSE = 2
upload.MIN_PART = 1 << 20

@atexit.register
def last():
    try:
        ckptfmt.save({"w": torch.zeros(4 << 20)}, sys.argv[1], storage_options={"part_size": 1 << 20, "concurrency": 2})
        print("saved", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, flush=True)
"""


def test_at_exit_a_refused_compose_is_the_last_sent(gcs_faults):
    """A save made by an atexit handler composes on its own thread, in turn: the first
    compose refused, no other is sent."""
    import os
    import subprocess
    import sys

    _refused_composes(gcs_faults)
    url = f"gs://{gcs_faults.bucket}/refused-at-exit.ckpt"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, "-c", _COMPOSE_IN_ATEXIT, url], capture_output=True, text=True, timeout=90, env=env
    )
    assert done.stdout.strip() == "failed: StorageError", done.stdout + done.stderr[-3000:]
    assert gcs_faults.count("POST", "/compose") == 1

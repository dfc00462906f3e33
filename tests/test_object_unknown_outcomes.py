"""Object-store runs when the store gives no definite answer: a commit record whose write got
no answer may land later, and an old step whose record the store will not serve is unknown,
not damaged, and blocks only what it may be newer than."""

import json
import threading
import time
import warnings

import pytest
import torch

from ckptfmt import CheckpointManager
from ckptfmt.errors import StorageError

W = torch.arange(1 << 17, dtype=torch.float32)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_unknown_record_keeps_its_base_through_own_rotation(store_faults):
    # step 2's record PUT outlives the save's deadline and lands later, naming step 1's
    # objects: the same process's next rotation must not have deleted step 1 meanwhile
    url = store_faults.new_root() + "/run"
    options = store_faults.options | {"deadline": 4}
    m = CheckpointManager(url, storage_options=options, keep_last=1, incremental=True)
    m.save(1, {"w": W})
    m.wait()
    method, target = store_faults.op("write", "step-000000002/COMMIT")
    store_faults.delay(method, target, seconds=9, count=1)
    with pytest.raises(StorageError):
        m.save(2, {"w": W, "step": 2})
        m.wait()
    m.save(3, {"v": torch.arange(1 << 17, dtype=torch.float64) * 3})
    m.wait()
    deadline = time.monotonic() + 30
    while "step-000000002/COMMIT" not in store_faults.keys(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "step-000000002/COMMIT" in store_faults.keys(url)
    got = CheckpointManager(url, storage_options=store_faults.options).load(2)
    assert torch.equal(got["w"], W)


def _state(step):
    return {"w": torch.full((10,), float(step)), "step": step}


def _run_with_unreadable_record(store_faults, unreadable: int):
    """A run of steps 1-3 whose step `unreadable` record the store answers 503 to."""
    url = store_faults.new_root() + "/run"
    options = store_faults.options | {"max_attempts": 2}
    m = CheckpointManager(url, storage_options=options)
    for step in (1, 2, 3):
        m.save(step, _state(step))
    m.wait()
    method, target = store_faults.op("read", f"step-{unreadable:09d}/COMMIT")
    store_faults.fail_next(method, target, status=503, count=1000)
    return url, options


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
@pytest.mark.parametrize("what", ["latest", "load", "save", "statuses", "remove"])
def test_old_step_the_store_fails_to_serve_blocks_nothing_newer(store_faults, what):
    url, options = _run_with_unreadable_record(store_faults, 1)
    n = CheckpointManager(url, storage_options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if what == "latest":
            assert n.latest().step == 3
        elif what == "load":
            assert n.load()["step"] == 3
        elif what == "save":
            n.save(4, _state(4))
            n.wait()
            assert n.latest().step == 4
        elif what == "remove":
            n.remove(3)
            assert n.latest().step == 2
        else:
            got = {s.step: s for s in n.statuses()}
            assert got[1].unknown and not got[1].damaged and got[1].info is None
            assert "the store failed" in got[1].problem
            assert got[2].info is not None and got[3].info is not None
    assert "step-000000001/COMMIT" in store_faults.keys(url)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_newest_step_the_store_fails_to_serve_blocks_resume_and_save(store_faults):
    # the unknown step may be the newest checkpoint: going back to step 2 would fork the run
    url, options = _run_with_unreadable_record(store_faults, 3)
    n = CheckpointManager(url, storage_options=options)
    with pytest.raises(StorageError):
        n.latest()
    with pytest.raises(StorageError):
        n.load()
    with pytest.raises(StorageError):
        n.save(3, _state(3))
    with pytest.raises(StorageError):
        n.remove(2)
    assert "step-000000003/COMMIT" in store_faults.keys(url)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_rotation_keeps_what_an_unknown_step_may_read(store_faults):
    url, options = _run_with_unreadable_record(store_faults, 2)
    n = CheckpointManager(url, storage_options=options, keep_last=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n.save(4, _state(4))
        n.wait()
    keys = store_faults.keys(url)
    assert "step-000000001/COMMIT" in keys and "step-000000002/COMMIT" in keys
    assert "step-000000003/COMMIT" not in keys  # newer than the unknown step: rotated as ever


SMALL = torch.arange(1000, dtype=torch.float32)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
@pytest.mark.parametrize("status", [503, 502])
def test_record_unanswered_once_then_refused_keeps_what_it_names(store_faults, status):
    # the record's first PUT goes unanswered (it lands 7 s later), the retries are refused:
    # the save fails, but what the late record names must stay for it
    url = store_faults.new_root() + "/run"
    options = store_faults.options | {"deadline": 20, "read_timeout": 2, "max_attempts": 4}
    m = CheckpointManager(url, storage_options=options)
    method, target = store_faults.op("write", "step-000000005/COMMIT")
    store_faults.delay(method, target, seconds=7, count=1)
    errors = []

    def save():
        try:
            m.save(5, {"w": SMALL})
            m.wait()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=save)
    t.start()
    end = time.monotonic() + 30
    while store_faults.pending_rules() and time.monotonic() < end:
        time.sleep(0.01)
    store_faults.fail_next(method, target, status=status, count=100)
    t.join(60)
    assert errors and isinstance(errors[0], StorageError)
    end = time.monotonic() + 20
    while "step-000000005/COMMIT" not in store_faults.keys(url) and time.monotonic() < end:
        time.sleep(0.2)
    store_faults.clear_rules()
    assert "step-000000005/COMMIT" in store_faults.keys(url)
    got = CheckpointManager(url, storage_options=store_faults.options).load(5)
    assert torch.equal(got["w"], SMALL)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
@pytest.mark.parametrize("command", ["ls", "verify"])
def test_cli_lists_the_other_steps_and_fails_for_the_store(store_faults, command, monkeypatch):
    from cli_runner import run_cli

    url, options = _run_with_unreadable_record(store_faults, 1)
    # the command line reaches the store (through the proxy) as the AWS CLI does
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["aws_secret_access_key"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    out = json.loads(run_cli(command, url, "--json", rc=2).stdout)
    rows = out["steps"] if command == "ls" else out["files"]
    got = {r["step"]: r["status"] for r in rows}
    assert got[1] == "unreadable"
    assert got[2] == got[3] == ("complete" if command == "ls" else "ok")


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_record_there_that_cannot_be_read_back_is_not_called_another_writers(store_faults):
    # the record's PUT is refused as though one were there; reading that one back fails: it
    # may be this save's own (an earlier attempt's), so what it names stays
    url = store_faults.new_root() + "/run"
    m = CheckpointManager(url, storage_options=store_faults.options | {"max_attempts": 2})
    method, target = store_faults.op("write", "step-000000001/COMMIT")
    store_faults.fail_next(method, target, status=412, code="PreconditionFailed", count=1)
    method, target = store_faults.op("read", "step-000000001/COMMIT")
    store_faults.fail_next(method, target, status=503, count=100)
    with pytest.raises(StorageError) as got:
        m.save(1, _state(1))
        m.wait()
    assert "another writer" not in str(got.value)
    assert "step-000000001/state.ckpt" in store_faults.keys(url)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_a_save_waits_out_a_sweep_of_its_base_no_longer_than_its_deadline(store_faults):
    # another host's deletion of step 1 is under way (its sweep marker, just put): an
    # incremental save referring to step 1 waits for it within the storage deadline only
    url = store_faults.new_root() + "/run"
    m = CheckpointManager(url, storage_options=store_faults.options | {"deadline": 3}, incremental=True)
    m.save(1, {"w": W})
    m.wait()
    store_faults.put_raw(f"{url}/step-000000001/SWEEPING.{'f' * 16}.4242.77.0badcafe", b"sweeping\n")
    errors = []

    def save():
        try:
            m.save(2, {"w": W, "step": 2})
            m.wait()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=save, daemon=True)
    began = time.monotonic()
    t.start()
    t.join(120)  # SWEEP_WAIT is 900 s
    assert not t.is_alive(), "the save waited out the sweep past its deadline"
    assert time.monotonic() - began < 60
    assert errors and isinstance(errors[0], StorageError)
    assert "step-000000002/COMMIT" not in store_faults.keys(url)
    got = CheckpointManager(url, storage_options=store_faults.options).load(1)
    assert torch.equal(got["w"], W)


@pytest.mark.parametrize("store_faults", ["s3"], indirect=True)
def test_an_untrusted_newer_step_does_not_let_an_unknown_trusted_one_be_passed_over(store_faults):
    """Step 3 signed by a key not trusted, step 2 trusted but its record refused by the store:
    step 2 may be the newest trusted checkpoint, so latest() and load() raise the store's
    failure; neither may say there is none (a script would start over) nor go back to step 1."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    url = store_faults.new_root() + "/run"
    options = store_faults.options | {"max_attempts": 2}
    good, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    a = CheckpointManager(url, storage_options=options, sign_with=good)
    for s in (1, 2):
        a.save(s, {"w": torch.full((10,), float(s))})
    a.wait()
    b = CheckpointManager(url, storage_options=options, sign_with=other)
    b.save(3, {"w": torch.full((10,), 3.0)})
    b.wait()
    method, target = store_faults.op("read", "step-000000002/COMMIT")
    store_faults.fail_next(method, target, status=503, count=1000)
    n = CheckpointManager(url, storage_options=options, trusted_keys=[good.public_key()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step 3 is skipped with a warning: no trusted key signed it
        with pytest.raises(StorageError, match="step 2"):
            n.latest()
        with pytest.raises(StorageError, match="step 2"):
            n.load()

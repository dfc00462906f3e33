"""Store saves at interpreter exit: a non-blocking save still in flight when the program
returns, and a blocking save made by an ``atexit`` handler.  Both run once concurrent.futures'
exit hook may have refused new work to every pool; the process must still end, promptly,
with the object whole (or the failure reported), never hang on a save's handle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptfmt

MiB = 1 << 20

# a 24 MiB state in 8 MiB parts: a multi-part upload whose parts go to the upload pool
_STATE = 'state = {"w": torch.arange(6 * (1 << 20), dtype=torch.float32)}'

_AT_RETURN = f"""
import json, sys, torch, ckptfmt
url, options, snapshot = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
{_STATE}
ckptfmt.save(state, url, storage_options=options, blocking=False, snapshot=snapshot)
print("returned", flush=True)
"""

_IN_ATEXIT = f"""
import atexit, json, sys, torch, ckptfmt
url, options = sys.argv[1], json.loads(sys.argv[2])
{_STATE}

@atexit.register
def final():
    try:
        ckptfmt.save(state, url, storage_options=options)
        print("saved", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, e, flush=True)
"""


def _run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=90, env=env
    )


def _expected() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6 * MiB, dtype=torch.float32)}


@pytest.mark.parametrize("snapshot", ["copy", "fork"])
def test_a_non_blocking_store_save_in_flight_at_exit_ends_and_is_whole(s3_faults, snapshot):
    """Its parts go one at a time, each held 0.5 s: the save is still handing parts to the
    upload pool when the program returns."""
    faults = s3_faults
    options = faults.storage_options()
    bucket = faults.new_bucket()
    faults.delay("PUT", "partNumber=", seconds=0.5)
    url = f"s3://{bucket}/exit-{snapshot}.ckpt"
    child_options = options | {"part_size": 8 * MiB, "concurrency": 1}
    done = _run_child(_AT_RETURN, url, json.dumps(child_options), snapshot)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "returned" in done.stdout
    assert "failed" not in done.stderr, done.stderr[-3000:]
    faults.clear_rules()
    got = ckptfmt.load(url, storage_options=options)
    assert torch.equal(got["w"], _expected()["w"])


def test_a_blocking_store_save_in_an_atexit_handler_is_whole(store):
    """Made after every pool refuses work: its requests (S3's parts, GCS's part composes and
    deletes in parallel) run on the saving thread."""
    root, options = store
    url = f"{root}/atexit.ckpt"
    done = _run_child(_IN_ATEXIT, url, json.dumps(options | {"part_size": 8 * MiB}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "saved", done.stdout + done.stderr[-3000:]
    got = ckptfmt.load(url, storage_options=options)
    assert torch.equal(got["w"], _expected()["w"])


_LOAD_IN_ATEXIT = """
import atexit, json, sys, torch, ckptfmt
url, options = sys.argv[1], json.loads(sys.argv[2])

@atexit.register
def last():
    try:
        got = ckptfmt.load(url, storage_options=options)
        ok = torch.equal(got["w"], torch.arange(6 * (1 << 20), dtype=torch.float32))
        print("loaded" if ok else "wrong bytes", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, e, flush=True)
"""


def test_a_store_load_in_an_atexit_handler_reads_every_request(store):
    """Made after every pool refuses work: a 24 MiB object read in 1 MiB requests (the
    prologue and tail first, then the chunk reader's windows), on the loading thread."""
    root, options = store
    url = f"{root}/load-atexit.ckpt"
    ckptfmt.save(_expected(), url, storage_options=options)
    done = _run_child(_LOAD_IN_ATEXIT, url, json.dumps(options | {"request_size": MiB}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "loaded", done.stdout + done.stderr[-3000:]


_SIGN_FILE_IN_ATEXIT = """
import atexit, sys, torch, ckptfmt
from cryptography.hazmat.primitives.asymmetric import ed25519
from ckptfmt.files.signfile import sign_file
path = sys.argv[1]
key = ed25519.Ed25519PrivateKey.generate()
w = torch.arange(6 * (1 << 20), dtype=torch.float32)
ckptfmt.save({"w": w}, path, chunk_size=1 << 20)

@atexit.register
def last():
    try:
        sign_file(path, key)
        got = ckptfmt.load(path, trusted_keys=[key.public_key()])
        print("signed and loaded" if torch.equal(got["w"], w) else "wrong bytes", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, e, flush=True)
"""

_SIGNED_RUN_IN_ATEXIT = """
import atexit, json, sys, torch, ckptfmt
from cryptography.hazmat.primitives.asymmetric import ed25519
url, options = sys.argv[1], json.loads(sys.argv[2])
key = ed25519.Ed25519PrivateKey.generate()
w = torch.arange(6 * (1 << 20), dtype=torch.float32)

@atexit.register
def last():
    try:
        ckptfmt.CheckpointManager(url, sign_with=key, storage_options=options).save(1, {"w": w})
        reader = ckptfmt.CheckpointManager(url, trusted_keys=[key.public_key()], storage_options=options)
        got = reader.load(1)
        print("signed and loaded" if torch.equal(got["w"], w) else "wrong bytes", flush=True)
    except BaseException as e:
        print("failed:", type(e).__name__, e, flush=True)
"""


def test_a_file_signed_and_loaded_in_an_atexit_handler(tmp_path):
    """sign_file hashes the file's chunks on a pool (six 4 MiB chunks, four threads): at exit
    on the signing thread."""
    path = str(tmp_path / "signed.ckpt")
    env = dict(os.environ, PYTHONPATH=os.getcwd(), CKPTFMT_THREADS="4")
    done = subprocess.run(
        [sys.executable, "-c", _SIGN_FILE_IN_ATEXIT, path],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "signed and loaded", done.stdout + done.stderr[-3000:]


def test_a_signed_step_saved_and_loaded_on_a_store_in_an_atexit_handler(store):
    """The step's objects are hashed for the signed record, and hashed again by the load
    that trusts it, each in 1 MiB requests: at exit on the loading thread."""
    root, options = store
    url = f"{root}/signed-run"
    done = _run_child(
        _SIGNED_RUN_IN_ATEXIT, url, json.dumps(options | {"request_size": MiB, "part_size": 8 * MiB})
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "signed and loaded", done.stdout + done.stderr[-3000:]


_LOADS_ACROSS_EXIT = """
import json, sys, threading, time, torch, ckptfmt
url, options = sys.argv[1], json.loads(sys.argv[2])
w = torch.arange(6 * (1 << 20), dtype=torch.float32)
began = threading.Event()

def loads():
    for i in range(8):
        try:
            began.set()
            ok = torch.equal(ckptfmt.load(url, storage_options=options)["w"], w)
            print("loaded" if ok else "wrong bytes", flush=True)
        except BaseException as e:
            print("failed:", type(e).__name__, e, flush=True)

threading.Thread(target=loads).start()
began.wait()
time.sleep(0.2)
"""


def test_loads_on_a_thread_that_goes_on_past_the_programs_return(s3_bucket):
    """The program returns while a thread of its own loads, again and again: the exit hook
    makes the pools refuse work partway through a load (its read-ahead wave sent, or being
    sent), and later loads run every request on that thread.  Each load is whole."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/across-exit.ckpt"
    ckptfmt.save(_expected(), url, storage_options=options)
    done = _run_child(_LOADS_ACROSS_EXIT, url, json.dumps(options | {"request_size": MiB}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:-1] == ["loaded"] * 8, done.stdout + done.stderr[-3000:]


_FAILING_AT_RETURN = """
import json, sys, torch, ckptfmt
url, options = sys.argv[1], json.loads(sys.argv[2])
ckptfmt.save({"w": torch.zeros(1000)}, url, storage_options=options, blocking=False)
"""


def test_a_failed_non_blocking_save_nobody_waited_for_is_reported_at_exit(s3_faults):
    """Its upload refused for good, its handle dropped: the exit waits for it and says why."""
    faults = s3_faults
    url = f"s3://{faults.new_bucket()}/refused.ckpt"
    faults.fail_next("PUT", "refused.ckpt", status=403, count=100)
    done = _run_child(_FAILING_AT_RETURN, url, json.dumps(faults.storage_options()))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ckptfmt: non-blocking save of {url} failed: StorageError" in done.stderr, done.stderr[-3000:]


_MANAGER_AT_RETURN = """
import json, sys, torch, ckptfmt
url, options = sys.argv[1], json.loads(sys.argv[2])
m = ckptfmt.CheckpointManager(url, storage_options=options, blocking=False)
m.save(1, {"w": torch.arange(6 * (1 << 20), dtype=torch.float32)})
print("returned", flush=True)
"""


def test_a_non_blocking_manager_save_on_a_store_is_committed_when_the_program_returns(store):
    """The usual end of a training script: the last step's save returns at once and so does
    the program.  Its commit (which reads the uploaded object back) runs after the pools may
    have stopped: the step must still be committed, whole."""
    root, options = store
    url = f"{root}/run-at-return"
    done = _run_child(
        _MANAGER_AT_RETURN, url, json.dumps(options | {"request_size": MiB, "part_size": 8 * MiB})
    )
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr[-3000:]
    loaded = ckptfmt.CheckpointManager(url, storage_options=options).load()
    assert torch.equal(loaded["w"], _expected()["w"]), done.stderr[-3000:]


def test_a_non_blocking_manager_commit_that_fails_at_exit_is_reported(s3_faults):
    """Its commit record refused for good after the program returned: nobody waits for the
    step's handle, so the exit says the step failed (the process exits as it would have)."""
    faults = s3_faults
    url = f"s3://{faults.new_bucket()}/run"
    faults.fail_next("PUT", "COMMIT", status=403, count=100)
    done = _run_child(_MANAGER_AT_RETURN, url, json.dumps(faults.storage_options()))
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr[-3000:]
    assert f"ckptfmt: non-blocking save of {url}/step-000000001 failed: StorageError" in done.stderr, (
        done.stderr
    )


_STARTED_IN_ATEXIT = """
import atexit, json, sys, torch, ckptfmt
from ckptfmt.background import inflight
url, options, how = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
inflight.DEADLINE = 0.5  # the exit waits for saves in flight twice this: 1 s

@atexit.register
def last():  # runs before ckptfmt's own exit handler, registered earlier
    state = {"w": torch.zeros(1000)}
    if how == "manager":
        ckptfmt.CheckpointManager(url, storage_options=options, blocking=False).save(1, state)
    else:
        ckptfmt.save(state, url, storage_options=options, blocking=False)
    print("returned", flush=True)
"""


@pytest.mark.parametrize("how", ["save", "manager"])
def test_a_save_still_running_at_the_exits_bound_is_reported_once(s3_faults, how):
    """A non-blocking save (a plain one, a manager's step) is both in flight on its path and
    watched for an unseen error: when its upload is still held at the exit's bound, the exit
    says so once, not once for each list that holds its handle."""
    faults = s3_faults
    url = f"s3://{faults.new_bucket()}/held"
    released = faults.hold("PUT", "held")
    try:
        done = _run_child(_STARTED_IN_ATEXIT, url, json.dumps(faults.storage_options()), how)
    finally:
        released.set()
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr[-3000:]
    path = url if how == "save" else f"{url}/step-000000001"
    line = f"ckptfmt: non-blocking save of {path} still running at exit: abandoned"
    assert done.stderr.count(line) == 1, done.stderr[-3000:]

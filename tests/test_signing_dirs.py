"""Signed multi-file checkpoints (spec/FORMAT.md section 16.7): CheckpointManager(sign_with=,
trusted_keys=), ckptfmt.dcp with the same arguments, and ckptfmt sign/verify DIR.

Each refusal is checked to happen before anything is returned, and with load_into targets
unchanged.  Tampering is done as an attacker would: a record's XXH3 checksums are
recomputed (test_signing.reseal), so only the signature can catch the change.
"""

from __future__ import annotations

import gc
import os
import shutil
import struct
import warnings

import pytest
import torch
from cli_runner import run_cli
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_signing import pytestmark, read, reseal, strip_signature, write  # noqa: F401 (its skip)

import ckptfmt
from ckptfmt import CheckpointManager, SignatureError
from ckptfmt import dcp as cdcp
from ckptfmt.engine.ckptdir import CheckpointDir
from ckptfmt.files import multifile, recordsign
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.format import layout as fmt

KEY = ed25519.Ed25519PrivateKey.generate()
OTHER = ed25519.Ed25519PrivateKey.generate()
PUB = KEY.public_key()


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "frozen": torch.arange(1 << 15, dtype=torch.float32)}


def zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64, 64), "frozen": torch.zeros(1 << 15)}


def step_dir(run: str, step: int) -> str:
    return os.path.join(run, f"step-{step:09d}")


def signed_run(tmp_path, steps=(1, 2), **kw: object) -> str:
    run = str(tmp_path / "run")
    m = CheckpointManager(run, sign_with=KEY, **kw)
    for s in steps:
        m.save(s, state(s))
    m.wait()
    return run


def trusting(run: str, key: object = PUB) -> CheckpointManager:
    return CheckpointManager(run, trusted_keys=[key])


def flip_data_byte(path: str, at: int = 100) -> None:
    """Change one byte of a chunk, keeping the file's prologue and footer (its identity in
    the record: length, file id, index checksum) as they were."""
    data = read(path)
    data[at] ^= 0x40
    write(path, data)


def assert_step_refused(
    run: str, step: int, error: type[Exception] = SignatureError, key: object = PUB
) -> None:
    """A manager trusting `key` refuses `step`: load and load_into raise (targets unchanged),
    verify fails (or raises, for a step that is not even complete)."""
    m = trusting(run, key)
    with pytest.raises(error):
        m.load(step)
    t = zeros()
    with pytest.raises(error):
        m.load_into(t, step, restore_rng=False)
    assert not any(v.any() for v in t.values())
    try:
        assert not m.verify(step).ok
    except ckptfmt.CheckpointError:
        pass


# -- the manager -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["blocking", "nonblocking", "incremental"])
def test_manager_round_trip(tmp_path, mode):
    kw = {"blocking": False} if mode == "nonblocking" else {}
    if mode == "incremental":
        kw = {"incremental": True}
    run = signed_run(tmp_path, steps=(1, 2, 3), **kw)
    m = trusting(run)
    assert m.latest().step == 3
    assert torch.equal(m.load()["w"], state(3)["w"])
    t = zeros()
    assert m.load_into(t, restore_rng=False).step == 3
    assert torch.equal(t["frozen"], state(3)["frozen"])
    assert m.verify().ok
    with CheckpointDir.open(step_dir(run, 3)) as d:
        record = recordsign.read_trusted(d, [PUB])
    assert all(p.sha256 is not None for p in record.files + record.references)
    if mode == "incremental":  # the base files are bound by the record itself
        assert record.references
    with open(os.path.join(step_dir(run, 3), "COMMIT"), "rb") as fh:
        prologue = fh.read(64)
    assert struct.unpack_from("<Q", prologue, 40)[0] & fmt.FEATURE_SIGNED


def test_a_local_run_builds_its_record_options_once(tmp_path, monkeypatch):
    """A local run's signed commit records are written with the options (the signer) built
    when the manager is made, not again at every commit, as a run on a store does."""
    from ckptfmt.files import save as writer

    made = []
    real = writer.signer
    # signers made with the run's key (the state files themselves are not signed: sign_with=None)
    monkeypatch.setattr(writer, "signer", lambda key: (key is not None and made.append(key)) or real(key))
    m = CheckpointManager(str(tmp_path / "run"), sign_with=KEY)
    built = len(made)
    for step in (1, 2, 3):
        m.save(step, state(step))
    assert len(made) == built, "a commit built its save options again"
    reader = trusting(str(tmp_path / "run"))
    assert reader.latest().step == 3 and reader.verify(3).ok


def test_unsigned_steps_are_skipped_by_latest_and_refused_by_name(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, state(1))
    m = trusting(run)
    with pytest.warns(ckptfmt.CheckpointWarning, match="not signed"):
        assert m.latest() is None
    assert_step_refused(run, 1)
    with pytest.raises(ckptfmt.CheckpointError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.load()
    assert CheckpointManager(run).load()["w"].shape == (64, 64)  # no key demanded: it loads


def test_newest_unsigned_step_falls_back_to_the_signed_one(tmp_path):
    run = signed_run(tmp_path, steps=(1,))
    CheckpointManager(run).save(2, state(2))  # unsigned, newer
    m = trusting(run)
    with pytest.warns(ckptfmt.CheckpointWarning, match="step-000000002"):
        assert m.latest().step == 1
    with pytest.warns(ckptfmt.CheckpointWarning):
        assert torch.equal(m.load()["w"], state(1)["w"])
    CheckpointManager(run, keep_last=1, sign_with=KEY, trusted_keys=[PUB]).save(3, state(3))
    assert os.path.isdir(step_dir(run, 3))  # saving with trusted keys never judged step 2 damaged


def test_other_key_refused(tmp_path):
    run = signed_run(tmp_path)
    assert_step_refused(run, 2, key=OTHER.public_key())
    with pytest.warns(ckptfmt.CheckpointWarning, match="not among the trusted keys"):
        assert trusting(run, OTHER.public_key()).latest() is None
    m = CheckpointManager(run, trusted_keys=[OTHER.public_key(), PUB])
    assert m.latest().step == 2


def test_changed_byte_of_a_part_is_refused(tmp_path):
    """The part keeps its identity (length, file id, index checksum): only its SHA-256 differs."""
    run = signed_run(tmp_path)
    flip_data_byte(os.path.join(step_dir(run, 2), "state.ckpt"))
    assert_step_refused(run, 2)
    with pytest.raises(SignatureError, match="SHA-256"):  # not a complete checkpoint to it
        trusting(run).verify(2)
    # the scan found it damaged (its digest is checked before its index is read): not a checkpoint
    with pytest.warns(ckptfmt.CheckpointWarning, match="step-000000002: .*SHA-256 differs"):
        assert trusting(run).latest().step == 1
    assert torch.equal(trusting(run).load(fallback=True)["w"], state(1)["w"])


def test_part_swapped_between_signed_steps(tmp_path):
    run = signed_run(tmp_path)
    a, b = (os.path.join(step_dir(run, s), "state.ckpt") for s in (1, 2))
    shutil.copyfile(a, b)
    with pytest.raises(ckptfmt.CheckpointError):
        trusting(run).load(2)
    t = zeros()
    with pytest.raises(ckptfmt.CheckpointError):
        trusting(run).load_into(t, 2, restore_rng=False)
    assert not any(v.any() for v in t.values())
    with CheckpointDir.open(step_dir(run, 2)) as d, pytest.raises(SignatureError):
        recordsign.check_directory(d, [PUB])


def test_part_removed_or_file_added(tmp_path):
    run = signed_run(tmp_path)
    with open(os.path.join(step_dir(run, 1), "extra.ckpt"), "wb") as fh:
        fh.write(b"never read: the record does not name it")
    assert trusting(run).verify(1).ok
    os.unlink(os.path.join(step_dir(run, 2), "state.ckpt"))
    assert_step_refused(run, 2, ckptfmt.CheckpointError)
    with CheckpointDir.open(step_dir(run, 2)) as d, pytest.raises(SignatureError, match="missing"):
        recordsign.check_directory(d, [PUB])


def test_incremental_base_file_is_bound(tmp_path):
    """A step's state file reads chunks of an earlier step's: changing a byte of that file
    (its identity kept) fails the later step too, through the record's own references."""
    run = signed_run(tmp_path, steps=(1, 2), incremental=True)
    with CheckpointDir.open(step_dir(run, 2)) as d:
        refs = recordsign.read_trusted(d, [PUB]).references
    assert [r.name for r in refs] == ["../step-000000001/state.ckpt"]
    with CheckpointFile(os.path.join(step_dir(run, 1), "state.ckpt")) as f:
        frozen_at = f.chunks[-1].offset  # "frozen": stored in step 1, referred to by step 2
    flip_data_byte(os.path.join(step_dir(run, 1), "state.ckpt"), frozen_at + 8)
    assert_step_refused(run, 2)


def commit_path(run: str, step: int) -> str:
    return os.path.join(step_dir(run, step), "COMMIT")


def test_record_signature_stripped(tmp_path):
    run = signed_run(tmp_path)
    p = commit_path(run, 2)
    write(p, strip_signature(read(p)))
    assert CheckpointManager(run).load(2)["w"].shape == (64, 64)  # a valid unsigned record now
    assert_step_refused(run, 2)


def test_record_flag_cleared_block_kept(tmp_path):
    run = signed_run(tmp_path)
    p = commit_path(run, 2)
    data = read(p)
    req = struct.unpack_from("<Q", data, 40)[0]
    struct.pack_into("<Q", data, 40, req & ~fmt.FEATURE_SIGNED)
    write(p, reseal(data))
    assert_step_refused(run, 2, ckptfmt.CheckpointError)


@pytest.mark.parametrize("field_at, value", [(16, 2), (18, 2), (16, 0)])
def test_record_algorithm_changed(tmp_path, field_at, value):
    run = signed_run(tmp_path)
    p = commit_path(run, 2)
    data = read(p)
    length = len(data)
    block = length - 64 - struct.unpack_from("<Q", data, length - 64 + 40)[0]
    struct.pack_into("<H", data, block + field_at, value)
    write(p, data)
    assert_step_refused(run, 2, ckptfmt.CheckpointError)


def test_record_without_digests_refused(tmp_path):
    """A record the trusted key signed but whose entries carry no SHA-256 binds no file."""
    run = signed_run(tmp_path)
    with CheckpointDir.open(step_dir(run, 2)) as d:
        record = multifile.read_commit(d)
    bare = record.as_value()
    for p in bare["files"] + bare["references"]:
        del p["sha256"]
    os.unlink(commit_path(run, 2))
    ckptfmt.save(bare, commit_path(run, 2), sign_with=KEY)
    assert_step_refused(run, 2)
    with CheckpointDir.open(step_dir(run, 2)) as d, pytest.raises(SignatureError, match="no file digests"):
        recordsign.read_trusted(d, [PUB])


def test_record_moved_to_another_step(tmp_path):
    """A signed record binds its step: put into another step's directory it is refused, even
    with that step's files (its step differs from the directory's name)."""
    run = signed_run(tmp_path)
    shutil.copyfile(commit_path(run, 1), commit_path(run, 2))
    shutil.copyfile(
        os.path.join(step_dir(run, 1), "state.ckpt"), os.path.join(step_dir(run, 2), "state.ckpt")
    )
    assert_step_refused(run, 2, ckptfmt.CheckpointError)


def test_older_step_put_back_is_not_prevented(tmp_path):
    """Replay is not promised against (spec 16.7): a whole older signed step put back verifies."""
    run = signed_run(tmp_path, steps=(1,))
    saved = str(tmp_path / "saved")
    shutil.copytree(step_dir(run, 1), saved)
    CheckpointManager(run, sign_with=KEY, keep_last=1).save(2, state(2))
    assert not os.path.exists(step_dir(run, 1))
    shutil.copytree(saved, step_dir(run, 1))
    assert torch.equal(trusting(run).load(1)["w"], state(1)["w"])


# -- ckptfmt sign DIR / verify DIR --------------------------------------------------


def keypair(tmp_path, name: str = "k") -> tuple[str, str]:
    k = str(tmp_path / name)
    run_cli("keygen", k, rc=0)
    return k, k + ".pub"


def test_verify_dir_exit_codes(tmp_path):
    run = signed_run(tmp_path)
    priv, pub = keypair(tmp_path)
    from cryptography.hazmat.primitives import serialization

    with open(str(tmp_path / "signer.pub"), "wb") as fh:
        fh.write(
            PUB.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
    signer = str(tmp_path / "signer.pub")
    run_cli("verify", run, "--trusted-key", signer, rc=0)  # every step of the run
    run_cli("verify", step_dir(run, 2), "--trusted-key", signer, rc=0)
    r = run_cli("verify", step_dir(run, 2), "--trusted-key", pub, rc=1)  # another key
    assert "not among the trusted keys" in r.stdout
    run_cli("verify", step_dir(run, 2), rc=0)  # no key demanded
    unsigned = str(tmp_path / "unsigned")
    CheckpointManager(unsigned).save(5, state(5))
    r = run_cli("verify", step_dir(unsigned, 5), "--trusted-key", signer, rc=1)
    assert "signature" in r.stdout and "not signed" in r.stdout
    run_cli("verify", unsigned, "--trusted-key", signer, rc=1)
    flip_data_byte(os.path.join(step_dir(run, 1), "state.ckpt"))
    r = run_cli("verify", run, "--trusted-key", signer, rc=1)
    assert "SHA-256" in r.stdout
    run_cli("verify", step_dir(run, 2), "--trusted-key", signer, rc=0)
    run_cli("verify", run, "--trusted-key", str(tmp_path / "missing.pub"), rc=2)
    for out in (r.stdout, r.stderr):
        assert "PRIVATE" not in out


@pytest.mark.parametrize("incremental", [False, True])
def test_sign_existing_step_then_load(tmp_path, incremental):
    run = str(tmp_path / "run")
    m = CheckpointManager(run, incremental=incremental)
    m.save(1, state(1))
    m.save(2, state(2))
    priv, pub = keypair(tmp_path)
    data_before = read(os.path.join(step_dir(run, 2), "state.ckpt"))
    run_cli("verify", step_dir(run, 2), "--trusted-key", pub, rc=1)
    run_cli("sign", step_dir(run, 2), "--key", priv, rc=0)
    assert read(os.path.join(step_dir(run, 2), "state.ckpt")) == data_before  # no data file rewritten
    run_cli("verify", step_dir(run, 2), "--trusted-key", pub, rc=0)
    t = zeros()
    assert trusting(run, pub).load_into(t, restore_rng=False).step == 2
    assert torch.equal(t["w"], state(2)["w"])
    assert trusting(run, pub).latest().step == 2
    with pytest.raises(SignatureError, match="not signed"):  # step 1 is still unsigned
        trusting(run, pub).load(1)
    run_cli("sign", run, "--key", priv, rc=2)  # a run directory: sign its steps one by one


def test_sign_refuses_a_damaged_directory(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, state(1))
    priv, _ = keypair(tmp_path)
    flip_data_byte(os.path.join(step_dir(run, 1), "state.ckpt"))
    r = run_cli("sign", step_dir(run, 1), "--key", priv, rc=1)
    assert "not signed" in r.stderr
    with open(commit_path(run, 1), "rb") as fh:
        assert not struct.unpack_from("<Q", fh.read(64), 40)[0] & fmt.FEATURE_SIGNED
    os.unlink(commit_path(run, 1))
    run_cli("sign", step_dir(run, 1), "--key", priv, rc=2)  # no commit record: nothing to sign


# -- ckptfmt.dcp ---------------------------------------------------------------------


def pem(key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    assert isinstance(key, ed25519.Ed25519PublicKey)
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


FULL = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)


def _rank_main(rank: int, world: int, store: str, out: str, priv: bytes, pub: bytes) -> None:
    """One rank of the world-size-2 test: signed cdcp.save, async_save and manager steps of a
    DTensor sharded over both ranks, loaded back with trusted_keys; an unsigned save refused."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    results: dict[str, object] = {}
    try:
        mesh = init_device_mesh("cpu", (world,))

        def sharded(t: torch.Tensor) -> dict[str, object]:
            return {"w": distribute_tensor(t.clone(), mesh, [Shard(0)]), "n": 3}

        def full(st: dict[str, object]) -> torch.Tensor:
            return st["w"].full_tensor()  # type: ignore[attr-defined]

        base = os.path.dirname(out)
        cdcp.save(sharded(FULL), os.path.join(base, "signed"), sign_with=priv)
        target = sharded(torch.zeros_like(FULL))
        cdcp.load(target, os.path.join(base, "signed"), trusted_keys=[pub])
        results["load"] = bool(torch.equal(full(target), FULL))
        cdcp.async_save(sharded(FULL * 2), os.path.join(base, "async"), sign_with=priv).result()
        target = sharded(torch.zeros_like(FULL))
        cdcp.load(target, os.path.join(base, "async"), trusted_keys=[pub])
        results["async"] = bool(torch.equal(full(target), FULL * 2))
        m = CheckpointManager(os.path.join(base, "run"), sign_with=priv, trusted_keys=[pub])
        m.save(1, sharded(FULL * 3))
        target = sharded(torch.zeros_like(FULL))
        m.load_into(target, restore_rng=False)
        results["manager"] = bool(torch.equal(full(target), FULL * 3))
        cdcp.save(sharded(FULL), os.path.join(base, "unsigned"))
        target = sharded(torch.zeros_like(FULL))
        try:
            cdcp.load(target, os.path.join(base, "unsigned"), trusted_keys=[pub])
            results["unsigned"] = "loaded"
        except SignatureError:
            results["unsigned"] = "refused" if not full(target).any() else "refused, target written"
    except Exception as e:  # reported to the test, which prints it
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        gc.collect()  # free what holds the groups (FSDP modules are cycles) before they go
        dist.destroy_process_group()
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump(results, fh)


def test_dcp_world_size_two(tmp_path):
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    args = (2, str(tmp_path / "store"), out, pem(KEY), pem(PUB))
    mp.start_processes(_rank_main, args=args, nprocs=2, join=True, start_method="spawn")
    for rank in (0, 1):
        with open(f"{out}.{rank}.json") as fh:
            got = json.load(fh)
        assert got == {"load": True, "async": True, "manager": True, "unsigned": "refused"}, got
    for name in ("signed", "async", os.path.join("run", "step-000000001")):
        d = str(tmp_path / name)
        assert sorted(n for n in os.listdir(d) if n.startswith("rank-")) == [
            "rank-00000.ckpt",
            "rank-00001.ckpt",
        ]
        with CheckpointDir.open(d) as cd:
            assert all(p.sha256 is not None for p in recordsign.check_directory(cd, [PUB]).files)
    # the world-size-2 saves, loaded (resharded) in this one process: tampering is refused
    target = {"w": torch.zeros_like(FULL), "n": 0}
    cdcp.load(target, str(tmp_path / "signed"), trusted_keys=[PUB])
    assert torch.equal(target["w"], FULL)
    flip_data_byte(str(tmp_path / "signed" / "rank-00001.ckpt"))
    target = {"w": torch.zeros_like(FULL), "n": 0}
    with pytest.raises(SignatureError, match="rank-00001.ckpt"):
        cdcp.load(target, str(tmp_path / "signed"), trusted_keys=[PUB])
    assert not target["w"].any() and target["n"] == 0


def dcp_save(path: str, seed: int = 1, **kw: object) -> dict[str, object]:
    st = {"w": state(seed)["w"], "n": seed, "blob": {"k": "v"}}
    cdcp.save(st, path, **kw)
    return st


def dcp_target() -> dict[str, object]:
    return {"w": torch.zeros(64, 64), "n": 0, "blob": {"k": ""}}


def assert_dcp_refused(path: str, error: type[Exception] = SignatureError, key: object = PUB) -> None:
    t = dcp_target()
    with pytest.raises(error):
        cdcp.load(t, path, trusted_keys=[key])
    assert not t["w"].any() and t["n"] == 0 and t["blob"] == {"k": ""}  # type: ignore[attr-defined]


def test_dcp_single_process_round_trip_and_refusals(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = dcp_save(a, 1, sign_with=KEY)
    dcp_save(b, 2, sign_with=KEY)
    t = dcp_target()
    cdcp.load(t, a, trusted_keys=[PUB])
    assert torch.equal(t["w"], saved["w"]) and t["n"] == 1 and t["blob"] == {"k": "v"}
    reader = cdcp.Reader(a, trusted_keys=[PUB])
    assert reader.read_metadata() is not None and reader.record.files[0].sha256 is not None
    reader.close()
    assert_dcp_refused(a, key=OTHER.public_key())
    shutil.copyfile(os.path.join(b, "rank-00000.ckpt"), os.path.join(a, "rank-00000.ckpt"))
    assert_dcp_refused(a)  # a rank file of another signed save
    c = str(tmp_path / "c")
    dcp_save(c, 3, sign_with=KEY)
    write(os.path.join(c, "COMMIT"), strip_signature(read(os.path.join(c, "COMMIT"))))
    cdcp.load(dcp_target(), c)  # a valid unsigned save now
    assert_dcp_refused(c)
    u = str(tmp_path / "u")
    dcp_save(u, 4)
    assert_dcp_refused(u)
    e = str(tmp_path / "e")
    dcp_save(e, 5, sign_with=KEY)
    flip_data_byte(os.path.join(e, "rank-00000.ckpt"))
    reader = cdcp.Reader(e, trusted_keys=[PUB])
    reader.read_metadata()  # the record itself is intact and signed
    problems, _ = reader.check_items()  # items are checked against files hashed first
    reader.close()
    assert problems and isinstance(problems[0], SignatureError), problems
    assert_dcp_refused(e)


def test_dcp_sign_and_verify_dir(tmp_path):
    u = str(tmp_path / "u")
    saved = dcp_save(u, 4)
    priv, pub = keypair(tmp_path)
    run_cli("verify", u, "--trusted-key", pub, rc=1)
    before = read(os.path.join(u, "rank-00000.ckpt"))
    run_cli("sign", u, "--key", priv, rc=0)
    assert read(os.path.join(u, "rank-00000.ckpt")) == before
    run_cli("verify", u, "--trusted-key", pub, rc=0)
    t = dcp_target()
    cdcp.load(t, u, trusted_keys=[pub])
    assert torch.equal(t["w"], saved["w"])
    flip_data_byte(os.path.join(u, "rank-00000.ckpt"))
    assert "SHA-256" in run_cli("verify", u, "--trusted-key", pub, rc=1).stdout


# -- trainer integrations ------------------------------------------------------------


def test_lightning_plugin_signs_and_demands(tmp_path):
    pytest.importorskip("lightning")
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    path = str(tmp_path / "last.ckpt")
    CkptfmtCheckpointIO(sign_with=KEY).save_checkpoint({"state_dict": state(1), "epoch": 3}, path)
    got = CkptfmtCheckpointIO(trusted_keys=[PUB]).load_checkpoint(path)
    assert got["epoch"] == 3 and torch.equal(got["state_dict"]["w"], state(1)["w"])
    with pytest.raises(SignatureError):
        CkptfmtCheckpointIO(trusted_keys=[OTHER.public_key()]).load_checkpoint(path)
    CkptfmtCheckpointIO().save_checkpoint({"epoch": 4}, path)  # unsigned now
    with pytest.raises(SignatureError, match="not signed"):
        CkptfmtCheckpointIO(trusted_keys=[PUB]).load_checkpoint(path)
    torch.save({"epoch": 5}, path)
    with pytest.raises(SignatureError, match="torch.save"):
        CkptfmtCheckpointIO(trusted_keys=[PUB], read_torch_checkpoints=True).load_checkpoint(path)


def test_transformers_trainer_signs_and_demands(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_transformers import _args, _model, _tokens

    from ckptfmt.integrations.transformers import CkptfmtTrainer, latest_checkpoint

    def trainer(**kw: object) -> CkptfmtTrainer:
        return CkptfmtTrainer(model=_model(), args=_args(str(tmp_path)), train_dataset=_tokens(), **kw)

    saver = trainer(ckptfmt_sign_with=KEY)
    saver.create_optimizer_and_scheduler(num_training_steps=10)
    saver.state.global_step = 3
    saver._save_checkpoint(saver.model, None)
    folder = str(tmp_path / "checkpoint-3")
    with CheckpointDir.open(folder) as d:
        assert recordsign.check_directory(d, [PUB]).layout == "hf-trainer"
    assert latest_checkpoint(str(tmp_path), trusted_keys=[PUB]) == folder
    loader = trainer(ckptfmt_trusted_keys=[PUB])
    with torch.no_grad():
        for p in loader.model.parameters():
            p.zero_()
    loader._load_from_checkpoint(folder)
    assert all(torch.equal(a, b) for a, b in zip(loader.model.parameters(), saver.model.parameters()))
    with pytest.warns(ckptfmt.CheckpointWarning, match="not among the trusted keys"):
        assert latest_checkpoint(str(tmp_path), trusted_keys=[OTHER.public_key()]) is None
    flip_data_byte(os.path.join(folder, "model.ckpt"))
    before = [p.clone() for p in loader.model.parameters()]
    with pytest.raises(SignatureError, match="model.ckpt"):
        loader._load_from_checkpoint(folder)
    assert all(torch.equal(a, b) for a, b in zip(loader.model.parameters(), before))


def test_signed_step_checked_from_the_spec(tmp_path):
    """Section 16.7 from the spec alone: the record's section 16 signature (test_signing's
    second reader), then the SHA-256 of every file its entries name, with hashlib."""
    import hashlib

    from cryptography.hazmat.primitives import serialization
    from test_signing import verify_from_spec

    run = signed_run(tmp_path, steps=(1, 2), incremental=True)
    raw = PUB.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    verify_from_spec(commit_path(run, 2), raw)  # raises unless the signature checks
    record = ckptfmt.load(commit_path(run, 2))  # the record's values, from the bytes just checked
    entries = record["files"] + record["references"]
    assert {e["name"] for e in entries} == {"state.ckpt", "../step-000000001/state.ckpt"}
    for e in entries:
        with open(os.path.join(step_dir(run, 2), e["name"]), "rb") as fh:
            data = fh.read()
        assert len(data) == e["length"] and hashlib.sha256(data).digest() == e["sha256"], e["name"]


_RECORD: dict[str, bytes] = {}


def _small_record(tmp_path_factory) -> bytes:
    if not _RECORD:
        run = signed_run(tmp_path_factory.mktemp("rec"), steps=(1,))
        _RECORD["run"] = run.encode()
        _RECORD["data"] = bytes(read(commit_path(run, 1)))
    return _RECORD["data"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_bit_of_a_signed_record_is_refused(tmp_path_factory, data):
    """Every bit of a signed commit record is covered: flipping any one makes reading it with
    the trusted key fail (SignatureError; LimitError where a length exceeds a reader limit)."""
    raw = bytearray(_small_record(tmp_path_factory))
    bit = data.draw(st.integers(0, 8 * len(raw) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    run = _RECORD["run"].decode()
    write(commit_path(run, 1), raw)
    with CheckpointDir.open(step_dir(run, 1)) as d:
        with pytest.raises((SignatureError, ckptfmt.LimitError)):
            recordsign.read_trusted(d, [PUB])

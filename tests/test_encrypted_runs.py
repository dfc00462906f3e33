"""Encrypted runs: CheckpointManager(encrypt_with=key) encrypts every step's state file
(spec section 17), latest(), load, load_into and verify read with the key, a tiered run's
archive and a run on a store hold the encrypted bytes, and a wrong or missing key is a
DecryptionError, never data."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import ckptfmt

KEY = bytes(range(32))


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((2000,), float(step)), "step": step}


def test_an_encrypted_run_saves_resumes_and_verifies(tmp_path):
    m = ckptfmt.CheckpointManager(tmp_path / "run", keep_last=2, encrypt_with=KEY)
    for step in (1, 2, 3):
        m.save(step, _state(step))
    assert [c.step for c in m.checkpoints()] == [2, 3]
    assert m.latest().step == 3 and m.load()["step"] == 3
    target = {"w": torch.zeros(2000), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptfmt.CheckpointWarning)  # no data position saved
        assert m.load_into(target).step == 3
    assert torch.equal(target["w"], torch.full((2000,), 3.0))
    assert m.verify().ok
    data = (tmp_path / "run" / "step-000000003" / "state.ckpt").read_bytes()
    assert torch.full((2000,), 3.0).numpy().tobytes()[:64] not in data  # no tensor bytes in clear
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.load(tmp_path / "run" / "step-000000003" / "state.ckpt")


def test_without_the_key_no_step_is_complete_and_a_wrong_key_is_refused(tmp_path):
    m = ckptfmt.CheckpointManager(tmp_path / "run", encrypt_with=KEY)
    m.save(1, _state(1))
    with pytest.warns(ckptfmt.CheckpointWarning):
        assert ckptfmt.CheckpointManager(tmp_path / "run").latest() is None
    wrong = ckptfmt.CheckpointManager(tmp_path / "run", decrypt_with=bytes(32))
    with pytest.warns(ckptfmt.CheckpointWarning, match="key"):
        assert wrong.latest() is None


def test_refused_combinations(tmp_path):
    pytest.importorskip("cryptography")
    with pytest.raises(ValueError, match="callable that unwraps"):
        ckptfmt.CheckpointManager(tmp_path / "c", encrypt_with=lambda data_key: data_key)


def test_encrypted_tiers_and_store_runs(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    m = ckptfmt.CheckpointManager(
        tmp_path / "run", archive=f"s3://{bucket}/t", storage_options=options, encrypt_with=KEY
    )
    m.save(5, _state(5))
    m.wait()
    assert m.archive_failures() == {}
    fresh = ckptfmt.CheckpointManager(
        tmp_path / "node-2", archive=f"s3://{bucket}/t", storage_options=options, encrypt_with=KEY
    )
    assert fresh.load()["step"] == 5
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.load(f"s3://{bucket}/t/step-000000005/state.ckpt", storage_options=options)
    remote = ckptfmt.CheckpointManager(f"s3://{bucket}/r", storage_options=options, encrypt_with=KEY)
    remote.save(1, _state(1))
    assert remote.load()["step"] == 1 and remote.verify().ok


# -- ckptfmt.dcp ---------------------------------------------------------------------------

FULL = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)


def test_an_encrypted_dcp_save_loads_only_with_its_key(tmp_path):
    from ckptfmt import dcp as cdcp

    path = str(tmp_path / "dcp")
    cdcp.save({"w": FULL.clone(), "n": 3}, path, encrypt_with=KEY)
    target = {"w": torch.zeros_like(FULL), "n": 0}
    cdcp.load(target, path, decrypt_with=KEY)
    assert torch.equal(target["w"], FULL) and target["n"] == 3
    for key in (None, bytes(32)):
        target = {"w": torch.zeros_like(FULL), "n": 0}
        with pytest.raises(ckptfmt.DecryptionError):
            cdcp.load(target, path, decrypt_with=key)
        assert not target["w"].any()


def _rank_main(rank: int, world: int, store: str, base: str) -> None:
    """One rank of the world-size-2 test: an encrypted save and async save of a DTensor sharded
    over both ranks, loaded back with the key."""
    import json
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptfmt import dcp as cdcp

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    results: dict[str, object] = {}
    try:
        mesh = init_device_mesh("cpu", (world,))

        def sharded(t: torch.Tensor) -> dict[str, object]:
            return {"w": distribute_tensor(t.clone(), mesh, [Shard(0)]), "n": 3}

        cdcp.save(sharded(FULL), os.path.join(base, "enc"), encrypt_with=KEY)
        cdcp.async_save(sharded(FULL * 2), os.path.join(base, "async"), encrypt_with=KEY).result()
        for name, want in (("enc", FULL), ("async", FULL * 2)):
            target = sharded(torch.zeros_like(FULL))
            cdcp.load(target, os.path.join(base, name), decrypt_with=KEY)
            results[name] = bool(torch.equal(target["w"].full_tensor(), want))  # type: ignore[attr-defined]
    except Exception as e:  # reported to the test, which prints it
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        gc.collect()  # free what holds the groups (FSDP modules are cycles) before they go
        dist.destroy_process_group()
    with open(os.path.join(base, f"result.{rank}.json"), "w") as fh:
        json.dump(results, fh)


def test_an_encrypted_dcp_save_of_two_ranks(tmp_path):
    import json

    import torch.multiprocessing as mp

    from ckptfmt import dcp as cdcp

    mp.start_processes(
        _rank_main,
        args=(2, str(tmp_path / "store"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    for rank in (0, 1):
        got = json.loads((tmp_path / f"result.{rank}.json").read_text())
        assert got == {"enc": True, "async": True}, got
    target = {"w": torch.zeros_like(FULL), "n": 0}  # resharded into one process
    cdcp.load(target, str(tmp_path / "enc"), decrypt_with=KEY)
    assert torch.equal(target["w"], FULL)
    for rank_file in ("rank-00000.ckpt", "rank-00001.ckpt"):
        with pytest.raises(ckptfmt.DecryptionError):
            ckptfmt.load(tmp_path / "enc" / rank_file)


# -- encrypted incremental runs (spec 17.9) ----------------------------------------------


def _big(step: int) -> dict[str, object]:
    """A frozen table (1 MiB, referred to by later steps) and a changing tensor."""
    return {"frozen": torch.arange(1 << 18, dtype=torch.float32), "w": torch.full((2000,), float(step))}


def test_an_encrypted_incremental_run_refers_to_earlier_encrypted_steps(tmp_path):
    """A step reuses the frozen table's chunks from the first step's encrypted file (no tensor
    bytes in clear anywhere), and a load decrypts them with that file's own data key, unwrapped
    by the run's key; consolidate with the key makes a self-contained encrypted copy."""
    from ckptfmt.files.consolidate import consolidate
    from ckptfmt.files.incremental import referenced_files

    run = tmp_path / "run"
    m = ckptfmt.CheckpointManager(run, encrypt_with=KEY, incremental=True)
    for step in (1, 2):
        m.save(step, _big(step))
    first = run / "step-000000001" / "state.ckpt"
    second = run / "step-000000002" / "state.ckpt"
    assert second.stat().st_size < first.stat().st_size // 4  # the table is referred to
    assert referenced_files(second, decrypt_with=KEY) == [str(first)]
    for data in (first.read_bytes(), second.read_bytes()):
        assert data[40] == 5  # required features: external chunks and encryption
        assert torch.arange(1 << 18, dtype=torch.float32).numpy().tobytes()[4096:4160] not in data
    got = m.load()
    assert torch.equal(got["frozen"], _big(2)["frozen"]) and torch.equal(got["w"], _big(2)["w"])
    assert m.verify().ok
    flat = tmp_path / "flat.ckpt"
    report = consolidate(second, flat, decrypt_with=KEY)
    assert report.external_chunks >= 1
    assert flat.read_bytes()[40] == 4  # encrypted, self-contained
    assert torch.equal(ckptfmt.load(flat, decrypt_with=KEY)["state"]["frozen"], _big(2)["frozen"])
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.load(second, decrypt_with=bytes(32))


def test_a_swapped_base_file_is_refused(tmp_path, monkeypatch):
    """The base file of an encrypted incremental step replaced by another encrypted file under
    the same key, even one whose file id and length were forged to match the reference (and its
    checksums recomputed): its wrapped key is bound to its real file id, so it is refused, and
    no load_into target is written."""
    import struct

    import xxhash

    from ckptfmt.format import layout as fmt

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764460800")  # equal index lengths below
    run = tmp_path / "run"
    m = ckptfmt.CheckpointManager(run, encrypt_with=KEY, incremental=True)
    for step in (1, 2):
        m.save(step, _big(step))
    other = ckptfmt.CheckpointManager(tmp_path / "other", encrypt_with=KEY, incremental=True)
    forged_state = _big(1)
    forged_state["frozen"] = -forged_state["frozen"]  # type: ignore[operator]
    other.save(1, forged_state)
    base = run / "step-000000001" / "state.ckpt"
    genuine = base.read_bytes()
    forged = bytearray((tmp_path / "other" / "step-000000001" / "state.ckpt").read_bytes())
    assert len(forged) == len(genuine)
    fid = genuine[16:32]
    forged[16:32] = fid
    footer = len(forged) - 64
    forged[footer + 24 : footer + 40] = fid
    ioff, ilen = struct.unpack_from("<QQ", forged, footer)
    struct.pack_into(
        "<Q", forged, footer + 16, fmt.index_checksum(fid, ioff, bytes(forged[ioff : ioff + ilen]))
    )
    forged[56:64] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(forged[:56])))
    forged[footer + 48 : footer + 56] = struct.pack(
        "<Q", xxhash.xxh3_64_intdigest(bytes(forged[footer : footer + 48]))
    )
    second = run / "step-000000002" / "state.ckpt"
    for replacement, cls in (
        (bytes(forged), ckptfmt.DecryptionError),
        (genuine[:-64], ckptfmt.CheckpointError),
    ):
        base.write_bytes(replacement)
        with pytest.raises(cls):
            ckptfmt.load(second, decrypt_with=KEY)
        target = {"frozen": torch.zeros(1 << 18), "w": torch.zeros(2000)}
        with pytest.raises(cls):
            ckptfmt.load_into(second, {"state": target}, decrypt_with=KEY, strict=False)
        assert not target["frozen"].any() and not target["w"].any()


# -- encrypted runs of several ranks (the manager's DCP backend) -------------------------------


def _manager_rank_main(rank: int, world: int, base: str, options: dict[str, str]) -> dict[str, object]:
    """One rank of an encrypted (and a signed encrypted) manager run on 2 ranks, locally and on
    the store: two steps saved, the newest resumed into a fresh sharded state with the key."""
    import os

    from cryptography.hazmat.primitives.asymmetric import ed25519
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    priv = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
    runs = {
        "local": (os.path.join(base, "run"), {}),
        "signed": (os.path.join(base, "signed"), {"sign_with": priv, "trusted_keys": [priv.public_key()]}),
        "store": (options.pop("url"), {"storage_options": options}),
    }
    results: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (world,))

    def sharded(t: torch.Tensor, n: int) -> dict[str, object]:
        return {"w": distribute_tensor(t.clone(), mesh, [Shard(0)]), "n": n}

    for name, (where, extra) in runs.items():
        m = ckptfmt.CheckpointManager(where, keep_last=1, encrypt_with=KEY, **extra)
        m.save(1, sharded(FULL, 1))
        m.save(2, sharded(FULL * 2, 2))
        target = sharded(torch.zeros_like(FULL), 0)
        report = m.load_into(target)
        got = target["w"].full_tensor()  # type: ignore[attr-defined]
        results[name] = [report.step, bool(torch.equal(got, FULL * 2)), target["n"]]
    return results


def test_an_encrypted_manager_run_of_two_ranks(tmp_path, s3_bucket):
    """CheckpointManager(encrypt_with=) on 2 ranks saves every rank file encrypted (locally, on
    a store, and signed too), resumes with the key on 2 ranks and in one process, verifies; a
    rank file alone and a manager without the key read nothing."""
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from helpers import run_ranks

    bucket, options = s3_bucket
    for got in run_ranks(
        _manager_rank_main, 2, tmp_path, str(tmp_path), {**options, "url": f"s3://{bucket}/enc"}
    ):
        assert got == {name: [2, True, 2] for name in ("local", "signed", "store")}, got
    pub = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33))).public_key()
    readers = [
        ckptfmt.CheckpointManager(tmp_path / "run", decrypt_with=KEY),
        ckptfmt.CheckpointManager(tmp_path / "signed", decrypt_with=KEY, trusted_keys=[pub]),
        ckptfmt.CheckpointManager(f"s3://{bucket}/enc", storage_options=options, decrypt_with=KEY),
    ]
    for m in readers:
        assert [c.step for c in m.checkpoints()] == [2]  # keep_last=1 rotated step 1 away
        assert m.latest().layout == "dcp"
        assert torch.equal(m.load()["w"], FULL * 2)  # resharded into one process
        assert m.verify().ok
    for rank_file in ("rank-00000.ckpt", "rank-00001.ckpt"):
        data = (tmp_path / "run" / "step-000000002" / rank_file).read_bytes()
        assert (FULL * 2)[:8].numpy().tobytes() not in data  # no tensor bytes in clear
        with pytest.raises(ckptfmt.DecryptionError):
            ckptfmt.load(tmp_path / "run" / "step-000000002" / rank_file)
    # a step of several ranks is complete by its commit record alone (its rank files are not
    # opened to list it): without the key it is found, and reading it is a DecryptionError
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.CheckpointManager(tmp_path / "run").load()


def test_a_run_given_two_different_keys_is_refused_when_made(tmp_path: object) -> None:
    """A run reads back what it writes (commits, its newest step, an incremental base) with
    decrypt_with: a key other than encrypt_with's failed every commit after writing the step.
    Refused when the manager is made; the same key given twice, or as a file, is one key."""
    run = str(tmp_path)
    other = bytes(range(1, 33))
    with pytest.raises(ValueError, match="decrypt_with must be the key of encrypt_with"):
        ckptfmt.CheckpointManager(run, encrypt_with=other, decrypt_with=KEY)
    key_file = tmp_path / "key.bin"  # type: ignore[operator]
    key_file.write_bytes(KEY)
    m = ckptfmt.CheckpointManager(run, incremental=True, encrypt_with=KEY, decrypt_with=str(key_file))
    m.save(1, {"w": torch.arange(1 << 16, dtype=torch.float32)})
    m.save(2, {"w": torch.arange(1 << 16, dtype=torch.float32)})
    assert torch.equal(m.load()["w"], torch.arange(1 << 16, dtype=torch.float32))

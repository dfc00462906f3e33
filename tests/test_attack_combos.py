"""Features in combination, attacked: background DCP saves and what follows them (another
background save, a blocking save, a load, a save against it as a base), incremental saves whose
base reads chunks from the file saved, an encrypted DCP save consolidated."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfmt
from ckptfmt import dcp as cdcp
from ckptfmt.errors import UnsupportedError
from ckptfmt.files import incremental


def test_a_background_save_waits_for_the_last_one_whatever_staged_it(tmp_path: Path) -> None:
    """Two background saves in flight run their collectives on the same group in threads of their
    own (a deadlock across ranks): each waits for the one before, also when another Stager (or
    the default one) staged that."""
    state = {"w": torch.randn(16 << 20)}  # 64 MiB: written well after the next one is staged
    first = cdcp.async_save(state, str(tmp_path / "a"))  # the default Stager
    second = cdcp.async_save(state, str(tmp_path / "b"), stager=cdcp.Stager())
    assert first.done()
    third = cdcp.async_save(state, str(tmp_path / "c"), stager=cdcp.Stager())
    assert second.done()
    fourth = cdcp.async_save(state, str(tmp_path / "d"))  # the default Stager after another
    assert third.done()
    fourth.result(timeout=120)
    back = {"w": torch.zeros(16 << 20)}
    cdcp.load(back, str(tmp_path / "d"))
    assert torch.equal(back["w"], state["w"])


def test_a_blocking_save_after_a_background_save_of_the_same_place_is_the_one_kept(tmp_path: Path) -> None:
    """A blocking save into the place a background save is still writing waits for it: else the
    older state commits last, over the newer one the blocking save reported saved."""
    older = cdcp.async_save({"w": torch.ones(16 << 20)}, str(tmp_path))  # 64 MiB: slow to write
    os.symlink(tmp_path, tmp_path.parent / "link")
    cdcp.save({"w": torch.full((4,), 2.0)}, str(tmp_path.parent / "link"))  # the same place, named otherwise
    older.result(timeout=120)
    back = {"w": torch.zeros(4)}
    cdcp.load(back, str(tmp_path))
    assert torch.equal(back["w"], torch.full((4,), 2.0))


def test_a_load_of_a_place_a_background_save_is_writing_reads_what_it_saved(tmp_path: Path) -> None:
    """A load waits for the background save into its place, as ckptfmt.load does for a file:
    else it finds the old record withdrawn and the new one not yet written."""
    n = 16 << 20
    cdcp.save({"w": torch.zeros(n)}, str(tmp_path))
    saving = cdcp.async_save({"w": torch.ones(n)}, str(tmp_path))
    back = {"w": torch.full((n,), -1.0)}
    cdcp.load(back, str(tmp_path))
    assert saving.done()
    assert torch.equal(back["w"], torch.ones(n))


def _big(value: float) -> dict[str, torch.Tensor]:
    return {"frozen": torch.arange(1 << 18, dtype=torch.float32), "adapter": torch.full((64,), value)}


def test_a_file_is_never_saved_again_against_a_base_that_reads_chunks_from_it(tmp_path: Path) -> None:
    """b refers to a's chunks: a saved again against b would replace a, and b, kept, would read
    another file's chunks no more; refused before a byte is written, both left as they were."""
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_big(1.0), a)
    incremental.save(_big(2.0), b, base=a)
    assert incremental.referenced_files(b) == [a]
    with pytest.raises(UnsupportedError, match="reads chunks from"):
        incremental.save(_big(3.0), a, base=b)
    assert torch.equal(ckptfmt.load(a)["adapter"], torch.full((64,), 1.0))
    assert torch.equal(ckptfmt.load(b)["adapter"], torch.full((64,), 2.0))


@pytest.mark.parametrize("where", ["local", "store"])
def test_a_dcp_save_is_never_made_against_a_base_that_reads_chunks_from_it(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """The same with DCP checkpoints: refused on every rank before the coordinator withdraws the
    directory's record, so both checkpoints stay whole."""
    options: dict[str, Any] = {}
    if where == "store":
        bucket, options = request.getfixturevalue("s3_bucket")
        a, b = f"s3://{bucket}/run/A", f"s3://{bucket}/run/B"
    else:
        a, b = str(tmp_path / "A"), str(tmp_path / "B")
    cdcp.save(_big(1.0), a, incremental=True, storage_options=options)
    cdcp.save(_big(2.0), b, base=a, storage_options=options)
    with pytest.raises(ValueError, match="reads chunks from"):
        cdcp.save(_big(3.0), a, base=b, storage_options=options)
    for at, value in ((a, 1.0), (b, 2.0)):
        back = {k: torch.zeros_like(v) for k, v in _big(0.0).items()}
        cdcp.load(back, at, storage_options=options)
        assert torch.equal(back["adapter"], torch.full((64,), value)), at


def test_an_encrypted_dcp_save_consolidates_into_an_encrypted_file(tmp_path: Path) -> None:
    """consolidate reads an encrypted save with its key (its error said to pass decrypt_with,
    which it did not take) and writes the file encrypted, under the same key by default, as
    files' consolidate does; a key service's unwrapping callable cannot encrypt: refused."""
    key = bytes(range(32))
    state = _big(4.0)
    cdcp.save(state, str(tmp_path / "ck"), encrypt_with=key)
    out = str(tmp_path / "full.ckpt")
    with pytest.raises(ValueError, match="encrypt_with"):
        cdcp.consolidate(str(tmp_path / "ck"), out, decrypt_with=lambda wrapped: key)
    assert not os.path.exists(out)
    cdcp.consolidate(str(tmp_path / "ck"), out, decrypt_with=key)
    with pytest.raises(ckptfmt.DecryptionError):
        ckptfmt.load(out)
    back = ckptfmt.load(out, decrypt_with=key)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    cdcp.load(into, out, decrypt_with=key)  # the file read as a DCP checkpoint, each rank its slice
    assert all(torch.equal(into[k], v) for k, v in state.items())


@pytest.mark.parametrize("snapshot", ["copy", "fork"])
def test_a_save_against_a_base_a_background_save_is_writing_waits_for_it(
    tmp_path: Path, snapshot: str
) -> None:
    """cdcp.save(base=A) right after async_save(A) waits for A's commit, as an incremental file
    save waits for its base's save in flight: else it finds A's record not yet written and fails."""
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    frozen = torch.arange(1 << 22, dtype=torch.float32)  # 16 MiB: still being written
    saving = cdcp.async_save({"frozen": frozen, "a": torch.ones(64)}, a, incremental=True, snapshot=snapshot)
    cdcp.save({"frozen": frozen, "a": torch.full((64,), 2.0)}, b, base=a)
    assert saving.done()
    assert sum(f.stat().st_size for f in Path(b).iterdir()) < 64 << 10  # the frozen tensor referred to
    back = {"frozen": torch.zeros_like(frozen), "a": torch.zeros(64)}
    cdcp.load(back, b)
    assert torch.equal(back["frozen"], frozen) and torch.equal(back["a"], torch.full((64,), 2.0))


@pytest.mark.parametrize("key", [None, bytes(range(32))])
def test_a_save_removes_only_the_stale_rank_files_a_save_wrote(tmp_path: Path, key: Any) -> None:
    """A directory that held files of its own under rank file names (a person's, another tool's,
    a file ckptfmt.save wrote there) keeps them when a DCP save is made into it; a rank file an
    earlier save left (here one copied to a rank the new save lacks) is removed."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "rank-00005.ckpt").write_bytes(b"a file of the user's own")
    ckptfmt.save({"mine": torch.ones(3)}, str(ck / "rank-00006.ckpt"))
    cdcp.save({"w": torch.ones(4)}, str(ck), encrypt_with=key)
    (ck / "rank-00007.ckpt").write_bytes((ck / "rank-00000.ckpt").read_bytes())  # an earlier save's
    cdcp.save({"w": torch.full((4,), 2.0)}, str(ck), encrypt_with=key)
    assert sorted(os.listdir(ck)) == ["COMMIT", "rank-00000.ckpt", "rank-00005.ckpt", "rank-00006.ckpt"]
    assert (ck / "rank-00005.ckpt").read_bytes() == b"a file of the user's own"
    assert torch.equal(ckptfmt.load(str(ck / "rank-00006.ckpt"))["mine"], torch.ones(3))


def test_a_save_under_a_prefix_keeps_the_objects_it_did_not_write(s3_server: Any) -> None:
    """The same under an object-store prefix: an object of someone else's under a rank file's
    name stays; one an earlier save wrote is removed."""
    bucket, options = s3_server.new_bucket(), s3_server.storage_options()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="ck/rank-00005.ckpt", Body=b"a file of the user's own")
    url = f"s3://{bucket}/ck"
    cdcp.save({"w": torch.ones(4)}, url, storage_options=options)
    body = client.get_object(Bucket=bucket, Key="ck/rank-00000.ckpt")["Body"].read()
    client.put_object(Bucket=bucket, Key="ck/rank-00007.ckpt", Body=body)  # an earlier save's
    cdcp.save({"w": torch.full((4,), 2.0)}, url, storage_options=options)
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="ck/")["Contents"])
    assert keys == ["ck/COMMIT", "ck/rank-00000.ckpt", "ck/rank-00005.ckpt"]


def test_an_encrypted_single_object_consolidates_with_its_key(s3_server: Any, tmp_path: Path) -> None:
    """A single encrypted file as consolidate's source (an object URL): its items are checked
    with the key too, not only read with it."""
    key = bytes(range(32))
    options = s3_server.storage_options()
    url = f"s3://{s3_server.new_bucket()}/one.ckpt"
    state = _big(5.0)
    ckptfmt.save(state, url, encrypt_with=key, storage_options=options)
    out = str(tmp_path / "full.ckpt")
    cdcp.consolidate(url, out, decrypt_with=key, encrypt_with=key, storage_options=options)
    back = ckptfmt.load(out, decrypt_with=key)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_the_command_line_consolidates_and_converts_an_encrypted_dcp_save(tmp_path: Path) -> None:
    """ckptfmt consolidate and convert take --decrypt-key for an encrypted DCP save and write the
    file encrypted under it; convert refuses it for a file, which it would write in clear."""
    from cli_runner import run_cli

    key = bytes(range(32))
    keyfile = tmp_path / "kek"
    keyfile.write_text(key.hex())
    state = _big(6.0)
    cdcp.save(state, str(tmp_path / "ck"), encrypt_with=key)
    assert run_cli("consolidate", tmp_path / "ck", tmp_path / "a.ckpt").returncode == 1  # no key
    for command in ("consolidate", "convert"):
        out = tmp_path / f"{command}.ckpt"
        run_cli(command, tmp_path / "ck", out, "--decrypt-key", keyfile, rc=0)
        with pytest.raises(ckptfmt.DecryptionError):
            ckptfmt.load(str(out))
        back = ckptfmt.load(str(out), decrypt_with=key)
        assert all(torch.equal(back[k], v) for k, v in state.items()), command
    refused = run_cli(
        "convert", tmp_path / "convert.ckpt", tmp_path / "x.safetensors", "--decrypt-key", keyfile
    )
    assert refused.returncode == 2 and "--decrypt-key" in refused.stderr
    assert not (tmp_path / "x.safetensors").exists()


def _service() -> tuple[Any, Any]:
    """A key service's two callables: wrapping a data key, and unwrapping it."""
    pad = bytes(range(32))

    def wrap(key: bytes) -> bytes:
        return b"W" + bytes(x ^ y for x, y in zip(key, pad))

    def unwrap(wrapped: bytes) -> bytes:
        return bytes(x ^ y for x, y in zip(wrapped[1:], pad))

    return wrap, unwrap


def test_incremental_dcp_saves_encrypted_by_a_key_service(tmp_path: Path) -> None:
    """A key service's wrapping callable cannot read the base: cdcp.save takes decrypt_with for
    that, and without it is refused before the directory's checkpoint is withdrawn."""
    wrap, unwrap = _service()
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    cdcp.save(_big(1.0), a, incremental=True, encrypt_with=wrap, decrypt_with=unwrap)
    cdcp.save(_big(1.5), b, encrypt_with=wrap)  # a checkpoint there already
    with pytest.raises(ValueError, match="decrypt_with"):
        cdcp.save(_big(2.0), b, base=a, encrypt_with=wrap)
    back = {k: torch.zeros_like(v) for k, v in _big(0.0).items()}
    cdcp.load(back, b, decrypt_with=unwrap)  # left as it was
    assert torch.equal(back["adapter"], torch.full((64,), 1.5))
    cdcp.save(_big(2.0), b, base=a, encrypt_with=wrap, decrypt_with=unwrap)
    assert sum(f.stat().st_size for f in Path(b).iterdir()) < 64 << 10  # the frozen tensor referred to
    cdcp.load(back, b, decrypt_with=unwrap)
    assert torch.equal(back["frozen"], _big(0.0)["frozen"]) and torch.equal(
        back["adapter"], torch.full((64,), 2.0)
    )


def test_consolidate_of_a_place_a_background_save_is_writing_reads_what_it_saved(tmp_path: Path) -> None:
    """consolidate waits for the background save into its source, as a load does."""
    n = 16 << 20
    saving = cdcp.async_save({"w": torch.ones(n)}, str(tmp_path / "ck"))
    cdcp.consolidate(str(tmp_path / "ck"), str(tmp_path / "full.ckpt"))
    assert saving.done()
    assert torch.equal(ckptfmt.load(str(tmp_path / "full.ckpt"))["w"], torch.ones(n))


def test_a_save_under_a_new_key_never_refers_to_a_base_under_the_old_one(tmp_path: Path) -> None:
    """Key rotation: a file encrypted under a new key, saved against a base read with the old one,
    referred to the base's chunks, and no key read it whole (the new one cannot unwrap the base,
    spec 17.9): every chunk is written, with a warning."""
    old, new = bytes(range(32)), bytes(range(1, 33))
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_big(1.0), a, encrypt_with=old)
    with pytest.warns(ckptfmt.CheckpointWarning, match="another key"):
        incremental.save(_big(2.0), b, base=a, encrypt_with=new, decrypt_with=old)
    assert incremental.referenced_files(b, decrypt_with=new) == []
    assert torch.equal(ckptfmt.load(b, decrypt_with=new)["frozen"], _big(0.0)["frozen"])


def test_a_referenced_chunk_numbered_past_its_files_tags_is_refused(tmp_path: Path) -> None:
    """b refers to a's chunks; a's encryption block rewritten to say it has no chunks (a key
    service's wrap binds nothing of a referenced file's block): a chunk numbered past the
    block's tags would be read as if in clear.  Refused, naming the referenced file's chunk."""
    import struct

    from ckptfmt.format import encryption as enc

    wrap, unwrap = _service()
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    incremental.save(_big(1.0), a, encrypt_with=wrap, decrypt_with=unwrap)
    incremental.save(_big(2.0), b, base=a, encrypt_with=wrap, decrypt_with=unwrap)
    raw = bytearray(Path(a).read_bytes())
    at = raw.index(enc.BLOCK_MAGIC)
    struct.pack_into("<Q", raw, at + 24, 0)  # nchunks (header: magic, cipher, wrap, flags, nchunks)
    Path(a).write_bytes(bytes(raw))
    with pytest.raises(ckptfmt.CheckpointError, match="tags for 0 chunks"):
        ckptfmt.load(b, decrypt_with=unwrap)

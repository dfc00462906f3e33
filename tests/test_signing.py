"""Signed files (spec/FORMAT.md section 16): save(sign_with=), load/open/load_into/verify
(trusted_keys=), ckptfmt keygen/sign/verify --trusted-key.

Every refusal is checked to happen before anything is returned and, for load_into, with
every target unchanged.  Tampering is done the way an attacker would: where a structure
has a non-cryptographic checksum (XXH3 of the index in the footer, of the footer, of the
prologue), the checksum is recomputed so that only the signature can catch the change.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch
import xxhash
from cli_runner import run_cli
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from helpers import read_bytes as read
from helpers import small_file_bytes
from helpers import write_bytes as write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import SignatureError
from ckptfmt.engine import native
from ckptfmt.engine.writeoptions import WriteOptions
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.files.signfile import sign_file
from ckptfmt.format import layout as fmt
from ckptfmt.format import signing as sigfmt

pytestmark = pytest.mark.skipif(
    native.built() and not native.crypto_available() and not os.environ.get("CKPTFMT_REQUIRE_CRYPTO"),
    reason="engine built without libcrypto (CI sets CKPTFMT_REQUIRE_CRYPTO=1: there these tests run and fail)",
)

KEY = ed25519.Ed25519PrivateKey.generate()
OTHER = ed25519.Ed25519PrivateKey.generate()
PUB = KEY.public_key()
CHUNK = 4096


def state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3000, generator=g),  # 48000 bytes: 12 chunks of 4 KiB
        "b": torch.arange(100, dtype=torch.int64),
        "meta": {"step": 7, "name": "run"},
    }


def save(path: str, *, key: object = KEY, **kw: object) -> str:
    ckptfmt.save(state(), path, sign_with=key, chunk_size=CHUNK, **kw)
    return path


def targets() -> dict[str, object]:
    return {
        "w": torch.zeros(4, 3000),
        "b": torch.zeros(100, dtype=torch.int64),
        "meta": {"step": 0, "name": ""},
    }


def assert_all_refused(path: str, keys: list[object] | None = None, match: str | None = None) -> None:
    """load, open, load_into (targets unchanged) and verify all refuse `path` with SignatureError."""
    keys = keys or [PUB]
    with pytest.raises(SignatureError, match=match):
        ckptfmt.load(path, trusted_keys=keys)
    with pytest.raises(SignatureError, match=match):
        with ckptfmt.open(path, trusted_keys=keys) as r:
            r.load()
    t = targets()
    with pytest.raises(SignatureError, match=match):
        ckptfmt.load_into(path, t, trusted_keys=keys)
    assert not t["w"].any() and not t["b"].any() and t["meta"] == {"step": 0, "name": ""}
    report = ckptfmt.verify(path, trusted_keys=keys)
    assert not report.ok and report.problems[0].kind == "signature", report


# -- layout helpers ------------------------------------------------------------


def parts(data: bytearray) -> dict[str, int]:
    length = len(data)
    ioff, ilen, _, _, block_len = struct.unpack_from("<QQQ16sQ", data, length - 64)
    return {
        "ioff": ioff,
        "ilen": ilen,
        "block": length - 64 - block_len,
        "block_len": block_len,
        "footer": length - 64,
    }


def reseal(data: bytearray) -> bytearray:
    """Recompute every XXH3 of the structure (index, footer, prologue): what anyone can do."""
    p = parts(data)
    fid = bytes(data[16:32])
    index = bytes(data[p["ioff"] : p["ioff"] + p["ilen"]])
    struct.pack_into("<Q", data, p["footer"] + 16, fmt.index_checksum(fid, p["ioff"], index))
    struct.pack_into(
        "<Q", data, p["footer"] + 48, xxhash.xxh3_64_intdigest(bytes(data[p["footer"] : p["footer"] + 48]))
    )
    struct.pack_into("<Q", data, 56, xxhash.xxh3_64_intdigest(bytes(data[:56])))
    return data


def strip_signature(data: bytearray) -> bytearray:
    """The file without its signature block, bit 1 cleared, everything resealed: a valid
    unsigned file."""
    p = parts(data)
    footer = bytearray(data[p["footer"] :])
    struct.pack_into("<Q", footer, 40, 0)
    out = data[: p["block"]] + footer
    struct.pack_into("<Q", out, 32, len(out))
    req = struct.unpack_from("<Q", out, 40)[0]
    struct.pack_into("<Q", out, 40, req & ~fmt.FEATURE_SIGNED)
    return reseal(out)


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_round_trip(tmp_path, compression):
    p = save(str(tmp_path / "a.ckpt"), compression=compression)
    want = state()
    for got in (ckptfmt.load(p, trusted_keys=[PUB]), ckptfmt.load(p)):  # unsigned readers too
        assert (
            torch.equal(got["w"], want["w"])
            and torch.equal(got["b"], want["b"])
            and got["meta"] == want["meta"]
        )
    with ckptfmt.open(p, trusted_keys=[PUB]) as r:
        assert torch.equal(r.get("w"), want["w"])
    t = targets()
    ckptfmt.load_into(p, t, trusted_keys=[PUB])
    assert torch.equal(t["w"], want["w"]) and t["meta"] == want["meta"]
    report = ckptfmt.verify(p, trusted_keys=[PUB])
    assert report.ok and report.chunks == 13
    with open(p, "rb") as fh:
        head = fh.read(64)
    assert struct.unpack_from("<Q", head, 40)[0] == fmt.FEATURE_SIGNED


def test_nonblocking_save_is_signed(tmp_path):
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(state(), p, sign_with=KEY, chunk_size=CHUNK, blocking=False).wait()
    assert ckptfmt.verify(p, trusted_keys=[PUB]).ok


def test_python_engine_writes_the_same_file(tmp_path, monkeypatch):
    """Ed25519 is deterministic: with a pinned file id and time, both engines write identical
    signed files, so the C engine's SHA-256 digests equal the Python reference's."""
    monkeypatch.setenv("CKPTFMT_FILE_ID", "00112233445566778899aabbccddeeff")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    for compression in (None, "zstd"):
        a = save(str(tmp_path / "c.ckpt"), compression=compression)
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
        b = save(str(tmp_path / "py.ckpt"), compression=compression)
        assert read(a) == read(b)
        assert ckptfmt.verify(b, trusted_keys=[PUB]).ok  # the Python reader checks the digests
        monkeypatch.delenv("CKPTFMT_BACKEND")


@pytest.mark.parametrize("backend", ["c", "python"])
def test_chunk_digest_is_checked(tmp_path, monkeypatch, backend):
    """A chunk whose XXH3 checksum matches but whose SHA-256 does not (what a forged XXH3
    would give) is refused: the digest is checked as each chunk is read."""
    if backend == "python":
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    p = save(str(tmp_path / "a.ckpt"), compression="zstd")
    with CheckpointFile(p, trusted_keys=[PUB]) as f:
        reader = f.chunk_reader
        reader.chunks = list(reader.chunks)
        ch = reader.chunks[3]
        reader.chunks[3] = ch._replace(sha=bytes(32))
        with pytest.raises(SignatureError, match="SHA-256"):
            f.load_subtree(f.tree.root, None, verify=False)  # verify=False is overridden


def test_engine_digest_matches_reference():
    fid = bytes(range(16))
    data = os.urandom(100000)
    import tempfile

    with tempfile.TemporaryFile() as fh:
        if not native.available():
            pytest.skip("C engine not built")
        sha: list[bytes] = []
        recs, _ = native.write_chunks(
            fh.fileno(), fid, 5, 64, [(memoryview(data), 4)], WriteOptions(), 2, "x", sha_out=sha
        )
        off, stored, raw, codec, filt, width, _ = recs[0]
        assert sha == [sigfmt.chunk_digest(fid, 5, off, stored, raw, codec, filt, width, data)]


# -- refusals ------------------------------------------------------------------


def test_unsigned_file_refused(tmp_path):
    p = str(tmp_path / "u.ckpt")
    ckptfmt.save(state(), p, chunk_size=CHUNK)
    assert_all_refused(p, match="not signed")


def test_other_key_refused(tmp_path):
    p = save(str(tmp_path / "a.ckpt"), key=OTHER)
    assert_all_refused(p, match="not among the trusted keys")
    assert ckptfmt.load(p, trusted_keys=[PUB, OTHER.public_key()])["meta"]["step"] == 7


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_flipped_chunk_byte(tmp_path, compression):
    p = save(str(tmp_path / "a.ckpt"), compression=compression)
    data = read(p)
    data[64 + 10] ^= 0x01
    write(p, data)
    assert_all_refused(p)


def test_quick_verify_with_trusted_keys_checks_the_chunks(tmp_path):
    """The signature covers the digest table, not the data: a quick verify that was given
    trusted keys still checks every chunk against its signed digest, as a load would."""
    p = save(str(tmp_path / "a.ckpt"))
    assert ckptfmt.verify(p, quick=True, trusted_keys=[PUB]).ok
    data = read(p)
    data[64 + 10] ^= 0x01
    write(p, data)
    assert ckptfmt.verify(p, quick=True).ok  # no keys: structure and index only, as documented
    report = ckptfmt.verify(p, quick=True, trusted_keys=[PUB])
    assert not report.ok and [(q.kind, q.chunk) for q in report.problems] == [("signature", 0)], report
    pub = str(tmp_path / "k.pub")
    write(pub, PUB.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    r = run_cli("verify", "--quick", "--trusted-key", pub, p, rc=1)
    assert "FAILED signature" in r.stdout


def test_flipped_index_byte_resealed(tmp_path):
    """An index edited and its XXH3 recomputed reads fine without keys; with keys the signature fails."""
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    at = data.index(b'"run"', parts(data)["ioff"])
    data[at + 1 : at + 4] = b"RUN"
    write(p, reseal(data))
    assert ckptfmt.load(p)["meta"]["name"] == "RUN"
    assert_all_refused(p, match="signature does not match")


def test_flipped_index_byte_plain(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    data[parts(data)["ioff"] + 5] ^= 0x20
    write(p, data)
    assert_all_refused(p)


@pytest.mark.parametrize("where", ["signature", "digest table", "public key", "prologue file id"])
def test_flipped_signed_bytes(tmp_path, where):
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    block = parts(data)["block"]
    at = {
        "signature": block + 64 + 32 * 13 + 5,
        "digest table": block + 64 + 32 * 2,
        "public key": block + 40,
        "prologue file id": 20,
    }[where]
    data[at] ^= 0x04
    write(p, reseal(data))
    assert_all_refused(p)


def test_signature_stripped(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    write(p, strip_signature(read(p)))
    assert ckptfmt.verify(p).ok  # a valid unsigned file now
    assert_all_refused(p, match="not signed")


def test_flag_cleared_block_kept(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    struct.pack_into("<Q", data, 40, 0)
    write(p, reseal(data))
    assert_all_refused(p)


@pytest.mark.parametrize("field, value", [("digest", 2), ("digest", 0), ("signature", 2)])
def test_algorithm_swapped(tmp_path, field, value):
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    block = parts(data)["block"]
    struct.pack_into("<H", data, block + (16 if field == "digest" else 18), value)
    write(p, data)
    assert_all_refused(p)
    with pytest.raises(ckptfmt.UnsupportedError):  # without keys: a feature this reader lacks
        ckptfmt.load(p)


@pytest.mark.parametrize("same_id", [False, True])
def test_chunks_swapped_between_files_of_one_key(tmp_path, monkeypatch, same_id):
    if same_id:  # even files with one pinned file id
        monkeypatch.setenv("CKPTFMT_FILE_ID", "00112233445566778899aabbccddeeff")
    a = save(str(tmp_path / "a.ckpt"))
    b = str(tmp_path / "b.ckpt")
    other = state()
    other["w"] = other["w"] + 1
    ckptfmt.save(other, b, sign_with=KEY, chunk_size=CHUNK)
    da, db = read(a), read(b)
    ioff = parts(da)["ioff"]
    assert ioff == parts(db)["ioff"]
    mixed = da[:64] + db[64 : 64 + CHUNK] + da[64 + CHUNK :]  # chunk 0 of b into a, same place and size
    write(a, mixed)
    assert_all_refused(a)
    # every chunk of b under a's prologue, index and signature
    write(a, da[:64] + db[64:ioff] + da[ioff:])
    assert_all_refused(a)


def test_truncated_and_extended(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    write(p, data[:-64])
    assert_all_refused(p)
    write(p, data + bytes(64))
    assert_all_refused(p)


def test_replay_under_another_name_is_not_prevented(tmp_path):
    """Spec 16.6: a validly signed file copied under another name still verifies."""
    p = save(str(tmp_path / "step-1.ckpt"))
    q = str(tmp_path / "step-2.ckpt")
    shutil.copyfile(p, q)
    assert ckptfmt.verify(q, trusted_keys=[PUB]).ok


@pytest.mark.parametrize("backend", ["c", "python"])
def test_mmap_checks_every_mapped_chunk_before_returning(tmp_path, monkeypatch, backend):
    """mmap=True with trusted keys: the mapped chunks are checked against their signed digests
    through the mapping (verify=False is ignored) before any tensor is returned."""
    if backend == "python":
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    elif not native.built():
        pytest.skip("needs the C engine")
    p = save(str(tmp_path / "a.ckpt"))
    out = ckptfmt.load(p, mmap=True, trusted_keys=[PUB])
    assert torch.equal(out["w"], state()["w"]) and torch.equal(out["b"], state()["b"])  # type: ignore[arg-type]
    del out
    with CheckpointFile(p) as f:
        off = f.chunks[5].offset  # a chunk of "w", mapped
    data = read(p)
    data[off + 7] ^= 0x10
    write(p, data)
    with pytest.raises(SignatureError) as e:
        ckptfmt.load(p, mmap=True, verify=False, trusted_keys=[PUB])
    assert e.value.chunk == 5
    # the same load without trusted keys does not read the chunk at all
    assert not torch.equal(ckptfmt.load(p, mmap=True, verify=False)["w"], state()["w"])  # type: ignore[arg-type]


def test_nonatomic_refused(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    with pytest.raises(ValueError, match="atomic"):
        ckptfmt.load_into(p, targets(), atomic=False, trusted_keys=[PUB])
    with pytest.raises(ValueError, match="empty"):
        ckptfmt.load(p, trusted_keys=[])


# -- keys ----------------------------------------------------------------------


def test_key_encodings(tmp_path):
    pem_priv = KEY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    ssh_priv = KEY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    pem_pub = PUB.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    ssh_pub = PUB.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (tmp_path / "k.pem").write_bytes(pem_priv)
    (tmp_path / "k.pub").write_bytes(ssh_pub)
    for i, priv in enumerate([pem_priv, ssh_priv, str(tmp_path / "k.pem"), KEY]):
        p = save(str(tmp_path / f"{i}.ckpt"), key=priv)
        for pub in [pem_pub, ssh_pub, str(tmp_path / "k.pub"), PUB, KEY]:
            assert ckptfmt.verify(p, trusted_keys=[pub]).ok
        assert ckptfmt.verify(p, trusted_keys=PUB).ok  # one key, not in a list
    with pytest.raises(ValueError) as e:
        ckptfmt.save(state(), str(tmp_path / "x.ckpt"), sign_with=pem_pub)
    assert "BEGIN" not in str(e.value)
    assert not os.path.exists(tmp_path / "x.ckpt")


def test_unsigned_load_does_not_import_cryptography(tmp_path):
    p = str(tmp_path / "u.ckpt")
    ckptfmt.save(state(), p)
    code = f"import sys, ckptfmt; ckptfmt.load({p!r}); ckptfmt.verify({p!r}); print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- sign an existing file -----------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_sign_existing_file(tmp_path, compression):
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(state(), p, chunk_size=CHUNK, compression=compression)
    before = read(p)
    sign_file(p, KEY)
    after = read(p)
    ioff = parts(before)["ioff"]
    assert after[64:ioff] == before[64:ioff]  # the data section, byte for byte
    assert after[16:32] == before[16:32]  # the same file id: every XXH3 still holds
    assert ckptfmt.verify(p, trusted_keys=[PUB]).ok
    sign_file(p, OTHER)  # re-signing replaces the signature
    assert ckptfmt.verify(p, trusted_keys=[OTHER.public_key()]).ok
    assert not ckptfmt.verify(p, trusted_keys=[PUB]).ok


def test_sign_keeps_mode_and_owner(tmp_path):
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(state(), p, chunk_size=CHUNK)
    os.chmod(p, 0o600)
    if os.geteuid() == 0:  # only root can give the file away; then the owner must stay too
        os.chown(p, 12345, 23456)
    before = os.stat(p)
    run_cli("sign", p, "--key", _key_file(tmp_path), rc=0)
    after = os.stat(p)
    assert after.st_ino != before.st_ino  # a new file, committed over the old one
    assert after.st_mode == before.st_mode  # 0600 stays 0600
    assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
    assert ckptfmt.verify(p, trusted_keys=[PUB]).ok


def test_sign_through_a_link_signs_the_file_and_keeps_the_link(tmp_path):
    store, runs = tmp_path / "store", tmp_path / "runs"
    store.mkdir()
    runs.mkdir()
    real = str(store / "step-7.ckpt")
    ckptfmt.save(state(), real, chunk_size=CHUNK)
    link = runs / "latest.ckpt"
    link.symlink_to(os.path.relpath(real, runs))
    run_cli("sign", link, "--key", _key_file(tmp_path), rc=0)
    assert link.is_symlink() and os.readlink(link) == os.path.relpath(real, runs)
    assert ckptfmt.verify(real, trusted_keys=[PUB]).ok
    assert sorted(os.listdir(store)) == ["step-7.ckpt"] and os.listdir(runs) == ["latest.ckpt"]


def _key_file(tmp_path) -> str:
    k = str(tmp_path / "sign.key")
    write(
        k,
        KEY.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )
    return k


def test_sign_refuses_damaged_file(tmp_path):
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(state(), p, chunk_size=CHUNK)
    data = read(p)
    data[100] ^= 1
    write(p, data)
    with pytest.raises(ckptfmt.CheckpointError):
        sign_file(p, KEY)
    assert read(p) == data  # unchanged: nothing committed
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n]


# -- hypothesis ----------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


@st.composite
def states(draw):
    n = draw(st.integers(0, 4))
    out: dict[str, object] = {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 70), min_size=0, max_size=3))
        seed = draw(st.integers(0, 2**31))
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10
        out[f"t{i}"] = t.to(dtype)
    out["x"] = draw(st.one_of(st.none(), st.integers(), st.text(max_size=8)))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=states(), compression=st.sampled_from([None, "zstd"]))
def test_round_trip_hypothesis(tmp_path, s, compression):
    p = str(tmp_path / "h.ckpt")
    ckptfmt.save(s, p, sign_with=KEY, chunk_size=CHUNK, compression=compression)
    got = ckptfmt.load(p, trusted_keys=[PUB])
    assert got.keys() == s.keys()
    for k, v in s.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v)
        else:
            assert got[k] == v
    assert ckptfmt.verify(p, trusted_keys=[PUB]).ok


# -- command line --------------------------------------------------------------


def test_cli(tmp_path):
    f = str(tmp_path / "f.ckpt")
    ckptfmt.save(state(), f, chunk_size=CHUNK)
    k, k2 = str(tmp_path / "k"), str(tmp_path / "k2")
    run_cli("keygen", k, rc=0)
    run_cli("keygen", k2, "--openssh", rc=0)
    assert os.stat(k).st_mode & 0o777 == 0o600
    assert run_cli("keygen", k).returncode == 2  # never replaces a key
    r = run_cli("verify", f, "--trusted-key", k + ".pub", rc=1)
    assert "not signed" in r.stdout
    run_cli("sign", f, "--key", k, rc=0)
    run_cli("verify", f, "--trusted-key", k + ".pub", rc=0)
    run_cli("verify", f, "--trusted-key", k2 + ".pub", rc=1)
    run_cli("verify", f, "--trusted-key", k2 + ".pub", "--trusted-key", k + ".pub", rc=0)
    run_cli("verify", f, rc=0)
    run_cli("verify", f, "--trusted-key", str(tmp_path / "missing.pub"), rc=2)
    run_cli("sign", f, "--key", k + ".pub", rc=2)  # a public key is not a signing key
    data = read(f)
    data[70] ^= 1
    write(f, data)
    r = run_cli("verify", f, "--trusted-key", k + ".pub", rc=1)
    assert "signature" in r.stdout
    assert run_cli("sign", f, "--key", k).returncode == 1  # a damaged file is not signed
    for out in (r.stdout, r.stderr):
        assert "PRIVATE" not in out


def test_sign_with_an_unusable_key_is_a_usage_error(tmp_path):
    """A --key that is a FIFO, missing or not a private key is a bad argument (2), not a bad
    checkpoint (1); the file is left as it was and the FIFO is never opened for reading."""
    f = str(tmp_path / "f.ckpt")
    ckptfmt.save(state(), f, chunk_size=CHUNK)
    before = read(f)
    fifo = str(tmp_path / "key.fifo")
    os.mkfifo(fifo)
    r = run_cli("sign", f, "--key", fifo, rc=2)
    assert r.stderr == f"error: {fifo}: not a regular file\n"
    run_cli("verify", f, "--trusted-key", fifo, rc=2)
    run_cli("sign", f, "--key", str(tmp_path / "missing"), rc=2)
    bad = (
        KEY.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        .decode()
        .replace("MC4C", "MC4D", 1)
    )
    r = run_cli("sign", f, "--key", bad, rc=2)
    assert "PRIVATE" not in r.stderr and "MC4" not in r.stderr
    assert read(f) == before


def test_keygen_is_all_or_nothing(tmp_path):
    """keygen writes both key files or neither, and never replaces one."""
    out = tmp_path / ("k" * 252)  # OUT fits a name (255 bytes at most), OUT.pub does not
    r = run_cli("keygen", out, rc=2)
    assert "File name too long" in r.stderr
    assert os.listdir(tmp_path) == []  # the private key written first is gone again
    k = tmp_path / "k"
    write(str(k) + ".pub", b"mine")
    run_cli("keygen", k, rc=2)
    assert os.listdir(tmp_path) == ["k.pub"] and read(str(k) + ".pub") == b"mine"


# -- the golden signed file, checked from the spec alone ---------------------------

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def verify_from_spec(path: str, public_key: bytes) -> int:
    """Section 16 implemented from the spec's tables, with hashlib, struct, json and
    cryptography only: a second reader.  Returns the number of chunks checked."""
    import hashlib
    import json

    data = open(path, "rb").read()
    assert data[:8] == b"\x89CKF\r\n\x1a\n" and struct.unpack_from("<Q", data, 40)[0] == 2
    assert struct.unpack_from("<Q", data, 32)[0] == len(data)
    footer = len(data) - 64
    ioff, ilen, _, fid, blen = struct.unpack_from("<QQQ16sQ", data, footer)
    assert fid == data[16:32]
    index = data[ioff : ioff + ilen]
    records = json.loads(index)["chunks"]
    n = len(records)
    block = footer - blen
    assert blen == (128 + 32 * n + 63) // 64 * 64 and block == (ioff + ilen + 63) // 64 * 64
    magic, dalg, salg, reserved, count, key = struct.unpack_from("<16sHHIQ32s", data, block)
    assert (magic, dalg, salg, reserved, count, key) == (b"ckptfmt-sig" + bytes(5), 1, 1, 0, n, public_key)
    table = data[block + 64 : block + 64 + 32 * n]
    signature = data[block + 64 + 32 * n : block + 128 + 32 * n]
    assert not any(data[block + 128 + 32 * n : footer])
    message = (
        b"ckptfmt-signed-file-v1"
        + bytes(10)
        + data[:56]
        + data[footer : footer + 48]
        + hashlib.sha256(index).digest()
        + hashlib.sha256(data[block : block + 64 + 32 * n]).digest()
    )
    assert len(message) == 200
    ed25519.Ed25519PublicKey.from_public_bytes(key).verify(signature, message)  # raises if wrong
    for k, (offset, stored, raw, codec, filt, width, *_rest) in enumerate(records):
        context = struct.pack(
            "<16s16sQQQQBBB5x", b"ckptfmt-sha256\0\0", fid, k, offset, stored, raw, codec, filt, width
        )
        assert (
            hashlib.sha256(context + data[offset : offset + stored]).digest() == table[32 * k : 32 * k + 32]
        ), k
    return n


def test_golden_signed_file_verifies_from_the_spec():
    from golden.make_golden import TEST_KEY_SEED

    path = os.path.join(GOLDEN, "v1_0_signed.ckpt")
    pub = ed25519.Ed25519PrivateKey.from_private_bytes(TEST_KEY_SEED).public_key()
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert verify_from_spec(path, raw) > 10
    assert ckptfmt.verify(path, trusted_keys=[os.path.join(GOLDEN, "signing_test_key.pem.pub")]).ok
    # and a file ckptfmt writes now, compressed and not
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for compression in (None, "zstd"):
            p = save(os.path.join(d, "a.ckpt"), compression=compression)
            verify_from_spec(p, PUB.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


# -- any flipped bit -----------------------------------------------------------------


def _small_signed() -> bytes:
    return small_file_bytes("signed", sign_with=KEY, chunk_size=CHUNK)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_bit_is_refused(tmp_path, data):
    """Every bit of a signed file is covered: flipping any one makes a load that requires the
    signature refuse it (SignatureError; a LimitError where the flip makes a length exceed a
    reader limit), before anything is returned."""
    raw = bytearray(_small_signed())
    bit = data.draw(st.integers(0, 8 * len(raw) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    p = str(tmp_path / "f.ckpt")
    write(p, raw)
    with pytest.raises((SignatureError, ckptfmt.LimitError)):
        ckptfmt.load(p, trusted_keys=[PUB])


def test_engine_without_libcrypto_says_so(tmp_path, monkeypatch):
    """An engine built without libcrypto (CKPTFMT_NO_CRYPTO=1, or no headers) refuses to sign
    or to check signatures with a clear error, before anything is written or read."""
    p = save(str(tmp_path / "a.ckpt"))
    if not native.available():
        pytest.skip("C engine not built")
    monkeypatch.setattr(native, "crypto_available", lambda: False)
    with pytest.raises(ckptfmt.CheckpointError, match="libcrypto"):
        ckptfmt.save(state(), str(tmp_path / "b.ckpt"), sign_with=KEY)
    assert not os.path.exists(tmp_path / "b.ckpt")
    with pytest.raises(ckptfmt.CheckpointError, match="libcrypto"):
        ckptfmt.load(p, trusted_keys=[PUB])
    monkeypatch.setenv("CKPTFMT_BACKEND", "python")  # the Python path checks them with hashlib
    assert ckptfmt.verify(p, trusted_keys=[PUB]).ok


def change_between_passes(monkeypatch: pytest.MonkeyPatch, path: str, offset: int) -> None:
    """Flip a bit of `path` at `offset` between load_into's two passes, unseen by its stamp
    (as a change within one clock tick would be)."""
    from ckptfmt.files import load_into as inplace

    def tamper(f: object) -> None:
        data = read(path)
        data[offset] ^= 0x10
        write(path, data)

    monkeypatch.setattr(inplace, "_stamp", lambda f: ())
    monkeypatch.setattr(inplace, "_before_write", tamper)


@pytest.mark.parametrize("which", ["first", "last"])
def test_file_changed_between_load_into_passes(tmp_path, monkeypatch, which):
    """A chunk changed after load_into's first pass verified it (the race its atomic mode
    cannot close for unsigned files) never reaches a target: with trusted keys the second
    pass checks each window against the signed digests before copying it."""
    from ckptfmt.files import load_into as inplace

    p = save(str(tmp_path / "a.ckpt"))
    with CheckpointFile(p) as f:
        ch = f.chunks[0 if which == "first" else 11]  # chunks of "w", raw
    change_between_passes(monkeypatch, p, ch.offset + 5)
    t = targets()
    with pytest.raises((SignatureError, inplace.PartialLoadError)) as e:
        ckptfmt.load_into(p, t, trusted_keys=[PUB])
    if which == "first":  # nothing was copied yet: the plain error, every target unchanged
        assert isinstance(e.value, SignatureError) and not t["w"].any()
    want = state()["w"].reshape(-1).view(torch.uint8)
    got = t["w"].reshape(-1).view(torch.uint8)
    # whatever was written is the signed bytes; the tampered chunk's bytes are not there
    written = got != 0
    assert torch.equal(got[written], want[written])
    lo = ch.offset - 64  # "w" is storage 0: its bytes start at offset 64
    assert not got[lo : lo + ch.raw_len].any()


@pytest.mark.parametrize("case", ["signed", "unsigned-c", "unsigned-python"])
def test_partial_load_names_exactly_the_targets_it_wrote(tmp_path, monkeypatch, case):
    """A chunk changed after load_into's first pass: PartialLoadError.modified_keys lists every
    target whose bytes changed and no other (the targets of the reads that had not begun are
    unchanged and not listed)."""
    from ckptfmt.files import fillreads
    from ckptfmt.files import load_into as inplace

    if case == "unsigned-python":
        monkeypatch.setenv("CKPTFMT_BACKEND", "python")
    if case == "unsigned-c" and not native.available():
        pytest.skip("needs the C engine")
    monkeypatch.setattr(fillreads, "_BATCH_BYTES", 1, raising=False)  # batches of whole targets
    g = torch.Generator().manual_seed(1)
    names = ["a", "b", "c", "d", "e"]
    src = {n: torch.randn(12 * CHUNK // 4, generator=g) for n in names}  # 12 chunks each
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(src, p, chunk_size=CHUNK, sign_with=KEY if case == "signed" else None)
    with CheckpointFile(p) as f:
        ch = f.chunks[f.storages[2].first_chunk]  # the first chunk of "c"
    change_between_passes(monkeypatch, p, ch.offset + 5)
    t = {n: torch.zeros_like(v) for n, v in src.items()}
    keys = [PUB] if case == "signed" else None
    with pytest.raises(inplace.PartialLoadError) as e:
        ckptfmt.load_into(p, t, trusted_keys=keys)
    changed = [n for n in names if t[n].any()]
    assert changed[:2] == ["a", "b"] and "e" not in changed
    assert e.value.modified_keys == changed


def test_load_into_fills_separate_targets_of_tied_tensors(tmp_path):
    """One tensor saved under two keys, loaded into two separate targets with trusted keys:
    each chunk is copied to every target that reads it, not only to the last one."""
    w = torch.randn(12 * CHUNK // 4)
    p = str(tmp_path / "t.ckpt")
    ckptfmt.save({"tok": w, "head": w}, p, sign_with=KEY, chunk_size=CHUNK)
    t = {"tok": torch.zeros_like(w), "head": torch.zeros_like(w)}
    ckptfmt.load_into(p, t, trusted_keys=[PUB])
    assert torch.equal(t["tok"], w) and torch.equal(t["head"], w)


def test_a_key_given_as_text_is_used_and_never_printed(tmp_path):
    """A PEM or OpenSSH key passed as a str is the key, not a path: no error message can
    carry it (a path that does not exist is named in the OSError's text)."""
    from cryptography.hazmat.primitives import serialization

    pem = KEY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    pub = PUB.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    p = tmp_path / "t.ckpt"
    ckptfmt.save({"w": torch.arange(4.0)}, p, sign_with=pem)
    assert torch.equal(ckptfmt.load(p, trusted_keys=[pub])["w"], torch.arange(4.0))
    with pytest.raises(ValueError) as e:
        ckptfmt.save({"w": 1}, p, sign_with=pem.replace("MC4C", "MC4D", 1))
    assert "PRIVATE KEY" not in str(e.value) and "MC4" not in str(e.value)

"""Signed encrypted files (spec/FORMAT.md section 17.8): encrypted, then signed.

The signature binds the prologue, the footer, the encrypted index as stored, the whole
encryption block (wrapped key and tags) and each chunk's SHA-256 over its ciphertext, so it is
checked without the data key; a reader with trusted keys and a key refuses before any tensor
is returned or any load_into target written.  Tampering recomputes the XXH3 checksums where an
attacker would, so that only the signature can catch the change.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from cli_runner import run_cli
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from helpers import read_bytes as read
from helpers import small_file_bytes, use_backend
from helpers import write_bytes as write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import DecryptionError, SignatureError
from ckptfmt.engine import native
from ckptfmt.files.signfile import sign_file
from ckptfmt.format import layout as fmt

pytestmark = pytest.mark.skipif(
    native.built() and not native.crypto_available() and not os.environ.get("CKPTFMT_REQUIRE_CRYPTO"),
    reason="engine built without libcrypto (CI sets CKPTFMT_REQUIRE_CRYPTO=1: there these tests run and fail)",
)

KEY = bytes.fromhex("5f" * 32)
PRIV = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
PUB = PRIV.public_key()
STRANGER = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(2, 34)))
CHUNK = 4096
BACKENDS = ["c", "python"] if native.built() else ["python"]
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3000, generator=g), "b": torch.arange(100), "meta": {"step": 7}}


def targets() -> dict[str, object]:
    return {"w": torch.zeros(4, 3000), "b": torch.zeros(100, dtype=torch.int64), "meta": {"step": 0}}


def save(path: str, **kw: object) -> str:
    kw.setdefault("sign_with", PRIV)
    kw.setdefault("encrypt_with", KEY)
    ckptfmt.save(state(), path, chunk_size=CHUNK, **kw)
    return path


class Tail:
    """Where the blocks of a signed encrypted file lie (spec 17.8); `sig` is the footer's offset
    in an encrypted file without a signature."""

    def __init__(self, data: bytes) -> None:
        self.footer = len(data) - 64
        self.ioff, self.ilen, _, _, self.both = struct.unpack_from("<QQQ16sQ", data, self.footer)
        self.enc = (self.ioff + self.ilen + 63) // 64 * 64
        self.n = struct.unpack_from("<Q", data, self.enc + 24)[0]
        self.wlen = struct.unpack_from("<I", data, self.enc + 40)[0]
        self.tags = self.enc + 64 + (self.wlen + 63) // 64 * 64
        self.sig = (self.tags + 16 * self.n + 63) // 64 * 64
        assert self.footer in (self.sig, self.sig + (128 + 32 * self.n + 63) // 64 * 64)


def reseal(data: bytearray) -> None:
    """Recompute the prologue's and footer's XXH3 checksums, as anyone can."""
    data[56:64] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:56])))
    f = len(data) - 64
    data[f + 48 : f + 56] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[f : f + 48])))


def assert_refused(path: str, cls: type[Exception] = SignatureError, key: object = KEY) -> None:
    """load, open().get, load_into (targets unchanged) and verify all refuse `path`."""
    with pytest.raises(cls):
        ckptfmt.load(path, trusted_keys=[PUB], decrypt_with=key)
    with pytest.raises(cls):
        with ckptfmt.open(path, trusted_keys=[PUB], decrypt_with=key) as r:
            r.get("w")
    t = targets()
    with pytest.raises(cls):
        ckptfmt.load_into(path, t, trusted_keys=[PUB], decrypt_with=key)
    assert not t["w"].any() and not t["b"].any() and t["meta"] == {"step": 0}  # type: ignore[union-attr]
    assert not ckptfmt.verify(path, trusted_keys=[PUB], decrypt_with=key).ok


# -- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("encrypt_index", [True, False])
def test_round_trip(tmp_path, monkeypatch, backend, compression, encrypt_index):
    use_backend(monkeypatch, backend)
    p = save(str(tmp_path / "a.ckpt"), compression=compression, encrypt_index=encrypt_index)
    assert struct.unpack_from("<Q", read(p), 40)[0] == fmt.FEATURE_SIGNED | fmt.FEATURE_ENCRYPTED
    out = ckptfmt.load(p, trusted_keys=[PUB], decrypt_with=KEY)
    assert torch.equal(out["w"], state()["w"]) and torch.equal(out["b"], state()["b"])  # type: ignore[arg-type]
    t = targets()
    ckptfmt.load_into(p, t, trusted_keys=[PUB], decrypt_with=KEY)
    assert torch.equal(t["w"], state()["w"])  # type: ignore[arg-type]
    assert ckptfmt.verify(p, trusted_keys=[PUB], decrypt_with=KEY).ok
    # a reader that asks for no signature reads it as an encrypted file
    assert torch.equal(ckptfmt.load(p, decrypt_with=KEY)["b"], state()["b"])  # type: ignore[arg-type]


def test_nonblocking_save(tmp_path):
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(state(), p, sign_with=PRIV, encrypt_with=KEY, chunk_size=CHUNK, blocking=False).wait()
    assert ckptfmt.verify(p, trusted_keys=[PUB], decrypt_with=KEY).ok


@pytest.mark.parametrize("encrypt_index", [True, False])
def test_signature_checked_without_the_data_key(tmp_path, encrypt_index):
    p = save(str(tmp_path / "a.ckpt"), encrypt_index=encrypt_index)
    report = ckptfmt.verify(p, trusted_keys=[PUB])
    assert report.ok and "signature" in report.not_checked and "GCM" in report.not_checked
    # another key's signature, or none, is a problem even without the data key
    bad = ckptfmt.verify(p, trusted_keys=[STRANGER.public_key()])
    assert [x.kind for x in bad.problems] == ["signature"]
    q = str(tmp_path / "plain.ckpt")
    ckptfmt.save(state(), q, encrypt_with=KEY, chunk_size=CHUNK, encrypt_index=encrypt_index)
    assert [x.kind for x in ckptfmt.verify(q, trusted_keys=[PUB]).problems] == ["signature"]
    # a load needs the data key, once the signature held
    with pytest.raises(DecryptionError, match="decrypt_with"):
        ckptfmt.load(p, trusted_keys=[PUB])


def test_keyless_verify_catches_a_changed_chunk_with_a_clear_index(tmp_path):
    """With the index in clear, a verifier without the data key checks each chunk's signed
    SHA-256 over the ciphertext: a chunk rewritten with its XXH3 recomputed is caught."""
    p = save(str(tmp_path / "a.ckpt"), encrypt_index=False)
    data = read(p)
    t = Tail(data)
    index = json.loads(bytes(data[t.ioff : t.ioff + t.ilen]))
    off, stored, raw, codec, filt, width, _ = index["chunks"][2]
    data[off] ^= 1
    fid = bytes(data[16:32])
    seed = fmt.chunk_seed(fid, 2, off, stored, raw, codec, filt, width)
    index["chunks"][2][6] = f"{xxhash.xxh3_64_intdigest(bytes(data[off : off + stored]), seed=seed):016x}"
    blob = json.dumps(index, separators=(",", ":")).encode()
    assert len(blob) == t.ilen
    data[t.ioff : t.ioff + t.ilen] = blob
    f = t.footer
    data[f + 16 : f + 24] = struct.pack("<Q", fmt.index_checksum(fid, t.ioff, blob))
    reseal(data)
    write(p, data)
    report = ckptfmt.verify(p, trusted_keys=[PUB])
    assert [x.kind for x in report.problems] == ["signature"]
    assert_refused(p)


# -- refusals ----------------------------------------------------------------------------


def test_wrong_data_key_with_a_good_signature(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    assert_refused(p, DecryptionError, key=bytes.fromhex("a0" * 32))


def test_stripped_signature_is_refused(tmp_path):
    """Bit 1 cleared, the signature block cut, the footer's length and checksums recomputed:
    a valid encrypted file, which a reader demanding a signature refuses."""
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    t = Tail(data)
    stripped = bytearray(data[: t.sig] + data[t.footer :])
    struct.pack_into("<Q", stripped, 40, fmt.FEATURE_ENCRYPTED)
    struct.pack_into("<Q", stripped, 32, len(stripped))
    struct.pack_into("<Q", stripped, len(stripped) - 64 + 40, t.sig - t.enc)
    reseal(stripped)
    write(p, stripped)
    assert torch.equal(ckptfmt.load(p, decrypt_with=KEY)["b"], state()["b"])  # type: ignore[arg-type]
    assert_refused(p)


def test_cleared_encryption_bit_is_refused(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    data = read(p)
    struct.pack_into("<Q", data, 40, fmt.FEATURE_SIGNED)
    reseal(data)
    write(p, data)
    # a key given for a file that says it is not encrypted is refused first (17.6) ...
    assert_refused(p, DecryptionError)
    # ... and without the key, the signature (which binds the feature bits) fails
    with pytest.raises(SignatureError):
        ckptfmt.load(p, trusted_keys=[PUB])


@pytest.mark.parametrize("what", ["wrapped key", "encryption block", "tag"])
def test_parts_swapped_between_files_of_one_signer(tmp_path, what):
    """Two files signed by the same key and encrypted under the same KEK: the wrapped key, the
    whole encryption block or a tag of one put into the other is refused (the signature binds
    the encryption block), though a reader without trusted keys would notice only later."""
    a = save(str(tmp_path / "a.ckpt"))
    b = save(str(tmp_path / "b.ckpt"))
    da, db = read(a), read(b)
    ta = Tail(da)
    span = {
        "wrapped key": (ta.enc + 64, ta.enc + 64 + ta.wlen),
        "encryption block": (ta.enc, ta.sig),
        "tag": (ta.tags, ta.tags + 16),
    }[what]
    assert da[span[0] : span[1]] != db[span[0] : span[1]]
    db[span[0] : span[1]] = da[span[0] : span[1]]
    write(b, db)
    assert_refused(b)


def test_signed_by_another_key_is_refused(tmp_path):
    p = save(str(tmp_path / "a.ckpt"), sign_with=STRANGER)
    assert_refused(p)


def _small() -> bytes:
    return small_file_bytes("signed-encrypted", sign_with=PRIV, encrypt_with=KEY, chunk_size=CHUNK)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_bit_is_refused(tmp_path, data):
    """Any one flipped bit of a signed encrypted file makes a load with trusted keys and the key
    refuse it with SignatureError (LimitError where the flip makes a length exceed a reader
    limit), before anything is returned or written."""
    raw = bytearray(_small())
    bit = data.draw(st.integers(0, 8 * len(raw) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    p = str(tmp_path / "f.ckpt")
    write(p, raw)
    with pytest.raises((SignatureError, ckptfmt.LimitError)):
        ckptfmt.load(p, trusted_keys=[PUB], decrypt_with=KEY)
    t = {"w": torch.zeros(3000), "z": torch.ones(2000), "n": ""}
    with pytest.raises((SignatureError, ckptfmt.LimitError)):
        ckptfmt.load_into(p, t, trusted_keys=[PUB], decrypt_with=KEY)
    assert not t["w"].any() and t["z"].all()  # type: ignore[union-attr]


def test_mmap_is_refused_with_the_reason(tmp_path):
    p = save(str(tmp_path / "a.ckpt"))
    with pytest.raises(ValueError, match="ciphertext"):
        ckptfmt.load(p, trusted_keys=[PUB], decrypt_with=KEY, mmap=True)


# -- signing an existing encrypted file ------------------------------------------------


def test_sign_an_encrypted_file_without_its_key(tmp_path):
    """An encrypted file with a clear index is signed without the data key: its ciphertext,
    index and encryption block are kept byte for byte and the signature binds them."""
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(state(), p, encrypt_with=KEY, chunk_size=CHUNK, encrypt_index=False)
    before = read(p)
    sign_file(p, PRIV)
    after = read(p)
    t = Tail(after)
    assert after[64 : t.sig] == before[64 : t.sig]  # chunks, index, encryption block unchanged
    assert ckptfmt.verify(p, trusted_keys=[PUB], decrypt_with=KEY).ok
    assert torch.equal(ckptfmt.load(p, trusted_keys=[PUB], decrypt_with=KEY)["b"], state()["b"])  # type: ignore[arg-type]
    # signing again replaces the signature
    sign_file(p, STRANGER)
    assert ckptfmt.verify(p, trusted_keys=[STRANGER.public_key()]).ok
    assert not ckptfmt.verify(p, trusted_keys=[PUB]).ok


def test_sign_an_encrypted_index_needs_the_key(tmp_path):
    p = save(str(tmp_path / "a.ckpt"), sign_with=None)
    before = read(p)
    with pytest.raises(DecryptionError, match="index is encrypted"):
        sign_file(p, PRIV)
    assert read(p) == before
    sign_file(p, PRIV, decrypt_with=KEY)
    after = read(p)
    assert after[64 : Tail(after).sig] == before[64 : len(before) - 64]
    assert ckptfmt.verify(p, trusted_keys=[PUB], decrypt_with=KEY).ok


def test_cli_sign_and_verify_without_the_data_key(tmp_path):
    keyfile = tmp_path / "kek"
    keyfile.write_text(KEY.hex() + "\n")
    priv = tmp_path / "id"
    assert run_cli("keygen", str(priv)).returncode == 0
    p = str(tmp_path / "a.ckpt")
    ckptfmt.save(state(), p, encrypt_with=KEY, chunk_size=CHUNK)
    r = run_cli("sign", p, "--key", str(priv))
    assert r.returncode == 1 and "--decrypt-key" in r.stderr
    assert run_cli("sign", p, "--key", str(priv), "--decrypt-key", str(keyfile)).returncode == 0
    r = run_cli("verify", p, "--trusted-key", f"{priv}.pub")
    assert r.returncode == 0 and "signature" in r.stdout and "not" in r.stdout
    r = run_cli("verify", p, "--trusted-key", f"{priv}.pub", "--decrypt-key", str(keyfile))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("verify", p, "--trusted-key", os.path.join(GOLDEN, "signing_test_key.pem.pub"))
    assert r.returncode == 1


# -- the golden file, checked from the spec alone ----------------------------------------


def verify_from_spec(path: str, public_key: bytes, kek: bytes | None) -> list[bytes]:
    """Section 17.8 implemented from the spec's tables with struct, hashlib, json, zstandard,
    numpy and cryptography only: the signature checked without the key, then (with `kek`) the
    data key unwrapped, the index decrypted and each chunk's digest, tag and bytes checked.
    Returns the chunks' raw bytes (none without `kek`)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89CKF\r\n\x1a\n" and struct.unpack_from("<Q", data, 40)[0] == 6
    fid = data[16:32]
    footer = len(data) - 64
    ioff, ilen, _, ffid, both = struct.unpack_from("<QQQ16sQ", data, footer)
    assert ffid == fid
    enc = (ioff + ilen + 63) // 64 * 64
    head = data[enc : enc + 64]
    magic, cipher, wrap, flags, n, _hint, wlen, _, index_tag = struct.unpack("<16sHHIQ8sII16s", head)
    assert (magic, cipher, wrap, flags, wlen) == (b"ckptfmt-enc" + bytes(5), 1, 1, 1, 60)
    tags_at = enc + 64 + (wlen + 63) // 64 * 64
    sig = (tags_at + 16 * n + 63) // 64 * 64
    assert sig + (128 + 32 * n + 63) // 64 * 64 == footer and sig - enc + footer - sig == both
    smagic, dalg, salg, _, count, key = struct.unpack_from("<16sHHIQ32s", data, sig)
    assert (smagic, dalg, salg, count, key) == (b"ckptfmt-sig" + bytes(5), 1, 1, n, public_key)
    table = data[sig + 64 : sig + 64 + 32 * n]
    message = (
        b"ckptfmt-signed-encrypted-file-v1"
        + data[:56]
        + data[footer : footer + 48]
        + hashlib.sha256(data[ioff : ioff + ilen]).digest()
        + hashlib.sha256(data[enc:sig]).digest()
        + hashlib.sha256(data[sig : sig + 64 + 32 * n]).digest()
    )
    ed25519.Ed25519PublicKey.from_public_bytes(key).verify(
        data[sig + 64 + 32 * n : sig + 128 + 32 * n], message
    )
    if kek is None:
        return []
    fields = head[16:48]
    wrapped = data[enc + 64 : enc + 64 + wlen]
    data_key = AESGCM(kek).decrypt(wrapped[:12], wrapped[12:], b"ckptfmt-key-wrap" + fid + fields)
    ctx = struct.pack("<16s16sQQ32s", b"ckptfmt-idx-gcm\0", fid, ioff, ilen, fields)
    nonce = bytes(8) + b"\x01\0\0\0"
    index = json.loads(AESGCM(data_key).decrypt(nonce, data[ioff : ioff + ilen] + index_tag, ctx))
    out = []
    for k, (offset, stored, raw, codec, filt, width, _check) in enumerate(index["chunks"]):
        fields_k = (k, offset, stored, raw, codec, filt, width)
        sha_ctx = struct.pack("<16s16sQQQQBBB5x", b"ckptfmt-sha256\0\0", fid, *fields_k)
        ciphertext = data[offset : offset + stored]
        assert hashlib.sha256(sha_ctx + ciphertext).digest() == table[32 * k : 32 * k + 32], k
        aad = struct.pack("<16s16sQQQQBBB5x", b"ckptfmt-aes-gcm\0", fid, *fields_k)
        tag = data[tags_at + 16 * k : tags_at + 16 * k + 16]
        plain = AESGCM(data_key).decrypt(struct.pack("<Q", k) + bytes(4), ciphertext + tag, aad)
        if codec == 1:
            plain = zstandard.ZstdDecompressor().decompress(plain, max_output_size=raw)
        if filt == 1:
            plain = np.frombuffer(plain, np.uint8).reshape(width, raw // width).T.tobytes()
        out.append(plain)
    return out


def test_golden_signed_encrypted_file_verifies_from_the_spec(tmp_path):
    from golden.make_golden import ENCRYPTION_TEST_KEY, TEST_KEY_SEED

    raw_pub = (
        ed25519.Ed25519PrivateKey.from_private_bytes(TEST_KEY_SEED)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    path = os.path.join(GOLDEN, "v1_0_signed_encrypted.ckpt")
    assert verify_from_spec(path, raw_pub, None) == []
    chunks = verify_from_spec(path, raw_pub, ENCRYPTION_TEST_KEY)
    data = open(os.path.join(GOLDEN, "v1_0_zstd.ckpt"), "rb").read()
    ioff, ilen = struct.unpack_from("<QQ", data, len(data) - 64)
    assert len(chunks) == len(json.loads(data[ioff : ioff + ilen])["chunks"]) > 10
    pub = os.path.join(GOLDEN, "signing_test_key.pem.pub")
    kek = os.path.join(GOLDEN, "encryption_test_key.hex")
    assert ckptfmt.verify(path, trusted_keys=[pub], decrypt_with=kek).ok
    # and files ckptfmt writes now, compressed and not
    mine = PUB.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    for compression in (None, "zstd"):
        assert len(verify_from_spec(save(str(tmp_path / "a.ckpt"), compression=compression), mine, KEY)) == 13


# -- runs and DCP saves: encrypted files under a signed commit record (16.7) --------------


def _run_state(step: int) -> dict[str, object]:
    return {"w": torch.full((2000,), float(step)), "step": step}


def test_a_signed_encrypted_run(tmp_path):
    """CheckpointManager(sign_with=, encrypt_with=): every state file encrypted, every record
    signed with the state file's SHA-256.  A state file whose wrapped key changed (its file id,
    length and index checksum, which the record's identity check compares, unchanged) is
    refused by its signature before the key is used, as is one swapped in from another step,
    with no target written; without the data key a trusted load is refused once the record's
    signature held."""
    run = tmp_path / "run"
    m = ckptfmt.CheckpointManager(run, sign_with=PRIV, encrypt_with=KEY, trusted_keys=[PUB])
    for step in (1, 2):
        m.save(step, _run_state(step))
    assert m.latest().step == 2 and m.load()["step"] == 2
    assert m.verify().ok
    keyfile = tmp_path / "kek"
    keyfile.write_text(KEY.hex())
    pub = tmp_path / "id.pub"
    pub.write_bytes(
        PUB.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    r = run_cli("verify", str(run), "--trusted-key", str(pub), "--decrypt-key", str(keyfile))
    assert r.returncode == 0 and r.stdout.count(": OK") == 2, r.stdout + r.stderr
    assert struct.unpack_from("<Q", (run / "step-000000002" / "state.ckpt").read_bytes(), 40)[0] == 4
    with pytest.raises(DecryptionError):
        ckptfmt.CheckpointManager(run, trusted_keys=[PUB]).load(step=2)
    state2 = run / "step-000000002" / "state.ckpt"
    data = bytearray(state2.read_bytes())
    data[Tail(data).enc + 64] ^= 1  # the wrapped key's nonce: no checksum covers it
    state2.write_bytes(bytes(data))
    target = {"w": torch.zeros(2000), "step": 0}
    with pytest.raises(SignatureError):
        m.load_into(target, step=2)
    assert not target["w"].any()
    with pytest.raises(SignatureError):
        m.load(step=2)
    with pytest.raises(SignatureError):  # not a complete checkpoint to a trusting reader
        m.verify(step=2)
    state2.write_bytes((run / "step-000000001" / "state.ckpt").read_bytes())
    with pytest.raises(SignatureError):
        m.load(step=2)


def test_a_signed_encrypted_dcp_save(tmp_path):
    from ckptfmt import dcp as cdcp

    full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    path = str(tmp_path / "dcp")
    cdcp.save({"w": full.clone(), "n": 3}, path, sign_with=PRIV, encrypt_with=KEY)
    target = {"w": torch.zeros_like(full), "n": 0}
    cdcp.load(target, path, trusted_keys=[PUB], decrypt_with=KEY)
    assert torch.equal(target["w"], full) and target["n"] == 3
    for keys, key, cls in (([PUB], None, DecryptionError), ([STRANGER.public_key()], KEY, SignatureError)):
        target = {"w": torch.zeros_like(full), "n": 0}
        with pytest.raises(cls):
            cdcp.load(target, path, trusted_keys=keys, decrypt_with=key)
        assert not target["w"].any()
    keyfile = tmp_path / "kek"
    keyfile.write_text(KEY.hex())
    pub = tmp_path / "id.pub"
    pub.write_bytes(
        PUB.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    r = run_cli("verify", path, "--trusted-key", str(pub), "--decrypt-key", str(keyfile))
    assert r.returncode == 0, r.stdout + r.stderr


def test_cli_signs_an_encrypted_step_with_its_key(tmp_path):
    run = tmp_path / "run"
    ckptfmt.CheckpointManager(run, encrypt_with=KEY).save(1, _run_state(1))
    step = str(run / "step-000000001")
    keyfile = tmp_path / "kek"
    keyfile.write_text(KEY.hex())
    priv = tmp_path / "id"
    assert run_cli("keygen", str(priv)).returncode == 0
    assert run_cli("sign", step, "--key", str(priv)).returncode == 1  # its files cannot be verified
    r = run_cli("sign", step, "--key", str(priv), "--decrypt-key", str(keyfile))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("verify", str(run), "--trusted-key", f"{priv}.pub", "--decrypt-key", str(keyfile))
    assert r.returncode == 0, r.stdout + r.stderr

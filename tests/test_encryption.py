"""Encrypted files (spec/FORMAT.md section 17): save(encrypt_with=), load/open/load_into/verify
(decrypt_with=), ckptfmt verify/inspect --decrypt-key.

Tampering is done the way an attacker would: where bytes are covered by a non-cryptographic
checksum (the prologue's, the footer's, a clear index's XXH3 in the footer), the checksum is
recomputed, or the chunk checksums are skipped (verify=False), so that only the GCM tags can
catch the change.  Every refusal is checked to raise before anything is returned and, for
load_into, with every target unchanged.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from cli_runner import run_cli
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from helpers import assert_same, small_file_bytes, states, use_backend
from helpers import read_bytes as read
from helpers import write_bytes as write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import CheckpointError, CorruptError, DecryptionError, IncompleteError
from ckptfmt.engine import chunkwrite, native
from ckptfmt.engine.writeoptions import WriteOptions
from ckptfmt.files import encryption
from ckptfmt.files.reader import CheckpointFile
from ckptfmt.files.signfile import sign_file
from ckptfmt.format import layout as fmt
from ckptfmt.format.encode import encode

pytestmark = pytest.mark.skipif(
    native.built() and not native.crypto_available() and not os.environ.get("CKPTFMT_REQUIRE_CRYPTO"),
    reason="engine built without libcrypto (CI sets CKPTFMT_REQUIRE_CRYPTO=1: there these tests run and fail)",
)

KEY = bytes.fromhex("5f" * 32)
OTHER = bytes.fromhex("a0" * 32)
CHUNK = 4096
BACKENDS = ["c", "python"] if native.built() else ["python"]
HERE = os.path.dirname(__file__)
GOLDEN = os.path.join(HERE, "golden")


def state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3000, generator=g),  # 48000 bytes: 12 chunks of 4 KiB
        "b": torch.arange(100, dtype=torch.int64),
        "meta": {"step": 7, "name": "run"},
    }


def targets() -> dict[str, object]:
    return {
        "w": torch.zeros(4, 3000),
        "b": torch.zeros(100, dtype=torch.int64),
        "meta": {"step": 0, "name": ""},
    }


def save(path: str, key: object = KEY, **kw: object) -> str:
    ckptfmt.save(state(), path, encrypt_with=key, chunk_size=CHUNK, **kw)
    return path


class Layout:
    """Where the parts of an encrypted file lie (from the spec's tables)."""

    def __init__(self, data: bytes) -> None:
        self.length = len(data)
        self.footer = len(data) - 64
        self.ioff, self.ilen, _, _, self.blen = struct.unpack_from("<QQQ16sQ", data, self.footer)
        self.block = self.footer - self.blen
        self.n = struct.unpack_from("<Q", data, self.block + 24)[0]
        self.wlen = struct.unpack_from("<I", data, self.block + 40)[0]
        self.wrapped = self.block + 64
        self.tags = self.block + 64 + (self.wlen + 63) // 64 * 64


def reseal_prologue(data: bytearray) -> None:
    data[56:64] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:56])))


def reseal_footer(data: bytearray) -> None:
    f = len(data) - 64
    data[f + 48 : f + 56] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[f : f + 48])))


def assert_all_refused(
    path: str, cls: type[Exception] = DecryptionError, key: object = KEY, **kw: object
) -> None:
    """load, open().load(), load_into (targets unchanged) and verify all refuse `path`."""
    with pytest.raises(cls):
        ckptfmt.load(path, decrypt_with=key, **kw)
    with pytest.raises(cls):
        with ckptfmt.open(path, decrypt_with=key) as r:
            r.load(**kw)
    t = targets()
    with pytest.raises(cls):
        ckptfmt.load_into(path, t, decrypt_with=key, **kw)
    assert not t["w"].any() and not t["b"].any() and t["meta"] == {"step": 0, "name": ""}
    report = ckptfmt.verify(path, decrypt_with=key)
    # without a key verify checks only what is in clear, and says so
    assert report.not_checked if key is None else not report.ok


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("encrypt_index", [True, False])
def test_round_trip(tmp_path, monkeypatch, backend, compression, encrypt_index):
    use_backend(monkeypatch, backend)
    p = save(str(tmp_path / "e.ckpt"), compression=compression, encrypt_index=encrypt_index)
    data = read(p)
    assert struct.unpack_from("<Q", data, 40)[0] == fmt.FEATURE_ENCRYPTED
    plain = str(tmp_path / "p.ckpt")
    ckptfmt.save(state(), plain, chunk_size=CHUNK, compression=compression)
    raw_w = state()["w"].numpy().tobytes()  # type: ignore[union-attr]
    assert raw_w[:64] not in data  # the tensor bytes are not in the file
    if encrypt_index:
        # names long enough that random ciphertext cannot hold them by chance ('"w"' did, 1 run in ~300)
        assert b"chunk_size" not in data and b'"meta"' not in data and b'"step"' not in data
    assert_same(ckptfmt.load(p, decrypt_with=KEY), state())
    t = targets()
    ckptfmt.load_into(p, t, decrypt_with=KEY)
    assert_same(t, state())
    with ckptfmt.open(p, decrypt_with=KEY) as r:
        assert torch.equal(r.get("b"), state()["b"])  # type: ignore[arg-type]
    assert ckptfmt.verify(p, decrypt_with=KEY).ok
    # the other engine reads what this one wrote
    use_backend(monkeypatch, "python" if backend == "c" else BACKENDS[0])
    assert_same(ckptfmt.load(p, decrypt_with=KEY), state())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=states(), compression=st.sampled_from([None, "zstd"]), encrypt_index=st.booleans())
def test_round_trip_hypothesis(tmp_path, s, compression, encrypt_index):
    p = str(tmp_path / "h.ckpt")
    ckptfmt.save(
        s, p, encrypt_with=KEY, compression=compression, chunk_size=CHUNK, encrypt_index=encrypt_index
    )
    assert_same(ckptfmt.load(p, decrypt_with=KEY), s)
    assert ckptfmt.verify(p, decrypt_with=KEY).ok
    assert ckptfmt.verify(p).ok  # without the key: what is in clear is sound


def test_key_service_round_trip(tmp_path):
    """A callable key (a key service): it wraps the data key on save, unwraps it on load."""
    vault: dict[bytes, bytes] = {}

    def service(blob: bytes) -> bytes:
        if len(blob) == 32 and blob not in vault.values():  # save: wrap a fresh data key
            handle = os.urandom(24)
            vault[handle] = blob
            return handle
        return vault[blob]

    p = save(str(tmp_path / "k.ckpt"), key=service, compression="zstd")
    assert_same(ckptfmt.load(p, decrypt_with=service), state())
    assert struct.unpack_from("<H", read(p), Layout(read(p)).block + 18)[0] == 2  # key wrap 2
    with pytest.raises(DecryptionError, match="key service failed"):
        ckptfmt.load(p, decrypt_with=lambda blob: {}[blob])
    with pytest.raises(DecryptionError, match="32-byte"):
        ckptfmt.load(p, decrypt_with=lambda blob: b"short")
    assert_all_refused(p, key=lambda blob: os.urandom(32))  # another data key: the index tag fails
    assert_all_refused(p, key=KEY)  # a KEK for a file wrapped by a service


@pytest.mark.parametrize("snapshot", ["copy", "fork"])
def test_nonblocking_saves_copy_and_fork(tmp_path, snapshot):
    """A non-blocking encrypted save, by a copy or by a fork snapshot (the forked child encrypts
    each chunk in C with the data key; this process seals the index with its tags): it loads
    and verifies only with the key, holds no tensor bytes in clear, and a tag it wrote is
    checked like any other."""
    p = str(tmp_path / f"nb-{snapshot}.ckpt")
    h = ckptfmt.save(
        state(), p, encrypt_with=KEY, blocking=False, chunk_size=CHUNK, compression="zstd", snapshot=snapshot
    )
    h.wait()
    assert h.snapshot == snapshot
    assert_same(ckptfmt.load(p, decrypt_with=KEY), state())
    assert ckptfmt.verify(p, decrypt_with=KEY).ok
    assert_all_refused(p, key=bytes(32))
    assert state()["w"].numpy().tobytes()[:64] not in read(p)  # type: ignore[union-attr]


def test_refused_combinations(tmp_path):
    p = save(str(tmp_path / "e.ckpt"))
    before = read(p)
    # an encrypted index holds the chunks' places: signing it needs the key (spec 17.8)
    with pytest.raises(DecryptionError, match="index is encrypted"):
        sign_file(p, ed25519.Ed25519PrivateKey.generate())
    assert read(p) == before
    with pytest.raises(ValueError, match="ciphertext"):
        ckptfmt.load(p, decrypt_with=KEY, mmap=True)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_engines_write_identical_bytes(tmp_path, monkeypatch, compression):
    """Given the same data key, file id and wrapped blob, the C engine and the Python path
    write the same file byte for byte."""
    if not native.built():
        pytest.skip("needs the C engine")
    monkeypatch.setenv("CKPTFMT_FILE_ID", "11" * 16)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764460800")
    key = encryption.Key(service=lambda dk: b"wrapped-by-a-service")
    out = {}
    for engine in ("c", "python"):
        p = str(tmp_path / f"{engine}.ckpt")
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            sealer = encryption.FileSealer(key, True, data_key=bytes(range(32)))
            options = WriteOptions(compression, chunk_size=CHUNK, seal=sealer)
            chunkwrite.build_file(fd, encode(state()), options, engine=engine)
        finally:
            os.close(fd)
        out[engine] = read(p)
    assert out["c"] == out["python"]
    assert_same(ckptfmt.load(str(tmp_path / "c.ckpt"), decrypt_with=lambda blob: bytes(range(32))), state())


# -- keys --------------------------------------------------------------------------------


def test_missing_and_wrong_key(tmp_path):
    p = save(str(tmp_path / "e.ckpt"))
    assert_all_refused(p, key=None)
    assert_all_refused(p, key=OTHER)
    with pytest.raises(DecryptionError, match="another key"):
        ckptfmt.load(p, decrypt_with=OTHER)
    plain = str(tmp_path / "p.ckpt")
    ckptfmt.save(state(), plain)
    with pytest.raises(DecryptionError, match="not encrypted"):
        ckptfmt.load(plain, decrypt_with=KEY)


def test_key_files(tmp_path):
    p = save(str(tmp_path / "e.ckpt"))
    hexfile, rawfile = tmp_path / "k.hex", tmp_path / "k.bin"
    hexfile.write_text(KEY.hex() + "\n")
    rawfile.write_bytes(KEY)
    for k in (str(hexfile), rawfile, KEY, bytearray(KEY)):
        assert_same(ckptfmt.load(p, decrypt_with=k), state())
    mixed = "".join(c.upper() if i % 2 else c for i, c in enumerate(KEY.hex()))
    for text in (KEY.hex().upper(), mixed + "\n"):  # hex digits in either case (spec 17.5)
        hexfile.write_text(text)
        assert_same(ckptfmt.load(p, decrypt_with=str(hexfile)), state())
    for bad in (KEY.hex()[:-2] + "\n", KEY.hex() + "\n\n", KEY.hex().upper() + "zz", ""):
        hexfile.write_text(bad)
        with pytest.raises(ValueError, match="key file"):
            ckptfmt.load(p, decrypt_with=str(hexfile))
    with pytest.raises(ValueError, match="32 bytes"):
        ckptfmt.load(p, decrypt_with=KEY[:16])
    with pytest.raises(ValueError, match="bytes.fromhex") as e:
        ckptfmt.load(p, decrypt_with=KEY.hex())  # a key as text is never opened as a path
    assert KEY.hex() not in str(e.value)
    with pytest.raises(TypeError):
        ckptfmt.load(p, decrypt_with=12345)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CheckpointError):  # refused unopened: never blocks
        ckptfmt.load(p, decrypt_with=str(tmp_path / "fifo"))


def test_keys_never_appear(tmp_path):
    """No key (nor the data key) in any error, repr, metadata, verify report or CLI output."""
    p = save(str(tmp_path / "e.ckpt"), metadata={"m": "v"})
    secrets = [KEY.hex(), OTHER.hex(), repr(KEY)[2:-1], repr(OTHER)[2:-1]]
    texts = []
    for key in (None, OTHER, KEY.hex(), lambda b: OTHER):
        try:
            ckptfmt.load(p, decrypt_with=key)
        except (CheckpointError, ValueError) as e:
            texts += [str(e), repr(e)]
    with CheckpointFile(p, decrypt_with=KEY) as f:
        data_key = f.index.data_key
        assert len(data_key) == 32
        secrets += [data_key.hex(), repr(data_key)[2:-1]]
        texts += [repr(f.index), repr(f.index.encryption), str(f.metadata), repr(f.chunks[:3])]
    sealer = encryption.sealer(KEY)
    texts += [repr(sealer), repr(encryption.load_key(KEY, "k"))]
    secrets += [sealer.data_key.hex()]  # type: ignore[union-attr]
    keyfile = tmp_path / "k.hex"
    keyfile.write_text(KEY.hex())
    for args in (
        ("inspect", p),
        ("inspect", p, "--decrypt-key", keyfile),
        ("verify", p, "--decrypt-key", keyfile),
    ):
        r = run_cli(*args, rc=0)
        texts += [r.stdout, r.stderr]
    bad = tmp_path / "bad.hex"
    bad.write_text(OTHER.hex()[:-1])
    r = run_cli("verify", p, "--decrypt-key", bad, rc=2)
    texts += [r.stdout, r.stderr]
    other = tmp_path / "other.hex"
    other.write_text(OTHER.hex())
    r = run_cli("verify", p, "--decrypt-key", other, rc=1)
    texts += [r.stdout, r.stderr]
    joined = "\n".join(texts)
    assert "another key" in joined
    for s in secrets:
        assert s not in joined


def test_engine_without_libcrypto_says_so(tmp_path, monkeypatch):
    """An engine built without libcrypto (CKPTFMT_NO_CRYPTO=1, or no headers) refuses both ways,
    naming libssl-dev, before anything is written."""
    if not native.built():
        pytest.skip("needs the C engine")
    p = save(str(tmp_path / "e.ckpt"))
    monkeypatch.delenv("CKPTFMT_BACKEND", raising=False)
    monkeypatch.setattr(native, "crypto_available", lambda: False)
    q = str(tmp_path / "new.ckpt")
    with pytest.raises(CheckpointError, match="libssl-dev"):
        ckptfmt.save(state(), q, encrypt_with=KEY)
    assert not os.path.exists(q)
    with pytest.raises(CheckpointError, match="libssl-dev"):
        ckptfmt.load(p, decrypt_with=KEY)


# -- tampering ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_flipped_ciphertext_fails_its_tag(tmp_path, monkeypatch, backend, compression):
    """A changed ciphertext byte: the XXH3 checksum catches it (CorruptError); with the
    checksums skipped (verify=False) the GCM tag does, before anything is decoded."""
    use_backend(monkeypatch, backend)
    p = save(str(tmp_path / "e.ckpt"), compression=compression)
    data = read(p)
    data[64 + 100] ^= 0x10  # chunk 0
    write(p, data)
    with pytest.raises(CorruptError, match="checksum"):
        ckptfmt.load(p, decrypt_with=KEY)
    with pytest.raises(DecryptionError, match="GCM tag") as e:
        ckptfmt.load(p, decrypt_with=KEY, verify=False)
    assert e.value.chunk == 0
    assert_all_refused(p, cls=(CorruptError, DecryptionError), verify=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("encrypt_index", [True, False])
@pytest.mark.parametrize("where", ["tag", "wrapped", "index_tag", "flags", "hint", "count_field"])
def test_flipped_block_bytes(tmp_path, where, encrypt_index):
    p = save(str(tmp_path / "e.ckpt"), encrypt_index=encrypt_index)
    data = read(p)
    at = Layout(data)
    offset = {
        "tag": at.tags + 16 * 3 + 5,
        "wrapped": at.wrapped + 20,
        "index_tag": at.block + 48,
        "flags": at.block + 20,
        "hint": at.block + 32,
        "count_field": at.block + 24,
    }[where]
    data[offset] ^= 1
    write(p, data)
    cls = CorruptError if where == "count_field" else DecryptionError  # the block's length no longer fits
    assert_all_refused(p, cls=cls)


def test_flipped_clear_index_resealed(tmp_path):
    """With a clear index an attacker can rewrite it and its XXH3: the index tag (GMAC) catches it."""
    p = save(str(tmp_path / "e.ckpt"), encrypt_index=False)
    data = read(p)
    at = Layout(data)
    index = bytes(data[at.ioff : at.ioff + at.ilen]).replace(b'"step"', b'"stap"')
    assert len(index) == at.ilen
    data[at.ioff : at.ioff + at.ilen] = index
    data[at.footer + 16 : at.footer + 24] = struct.pack(
        "<Q", fmt.index_checksum(bytes(data[16:32]), at.ioff, index)
    )
    reseal_footer(data)
    write(p, data)
    assert ckptfmt.verify(p).ok  # without the key nothing can tell
    assert_all_refused(p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_swapped_within_a_file(tmp_path, monkeypatch, backend):
    """Chunks 0 and 1 (same length) and their tags exchanged: the associated data binds each to
    its number and offset."""
    use_backend(monkeypatch, backend)
    p = save(str(tmp_path / "e.ckpt"))
    data = read(p)
    at = Layout(data)
    c0, c1 = bytes(data[64 : 64 + CHUNK]), bytes(data[64 + CHUNK : 64 + 2 * CHUNK])
    data[64 : 64 + CHUNK], data[64 + CHUNK : 64 + 2 * CHUNK] = c1, c0
    t0, t1 = bytes(data[at.tags : at.tags + 16]), bytes(data[at.tags + 16 : at.tags + 32])
    data[at.tags : at.tags + 16], data[at.tags + 16 : at.tags + 32] = t1, t0
    write(p, data)
    with pytest.raises(DecryptionError):
        ckptfmt.load(p, decrypt_with=KEY, verify=False)
    assert_all_refused(p, cls=(CorruptError, DecryptionError))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_swapped_between_files_of_one_key(tmp_path, monkeypatch, backend):
    """Two files under the same KEK, the same file id even: chunk 0 and its tag moved from one
    to the other fails (each file has its own data key)."""
    use_backend(monkeypatch, backend)
    monkeypatch.setenv("CKPTFMT_FILE_ID", "22" * 16)
    a = save(str(tmp_path / "a.ckpt"))
    b = str(tmp_path / "b.ckpt")
    other = state()
    other["w"] = other["w"] * 2  # type: ignore[operator]
    ckptfmt.save(other, b, encrypt_with=KEY, chunk_size=CHUNK)
    da, db = read(a), read(b)
    la, lb = Layout(da), Layout(db)
    da[64 : 64 + CHUNK] = db[64 : 64 + CHUNK]
    da[la.tags : la.tags + 16] = db[lb.tags : lb.tags + 16]
    write(a, da)
    with pytest.raises(DecryptionError):
        ckptfmt.load(a, decrypt_with=KEY, verify=False)
    assert_all_refused(a, cls=(CorruptError, DecryptionError))  # type: ignore[arg-type]


def test_truncated_and_extended(tmp_path):
    p = save(str(tmp_path / "e.ckpt"))
    data = read(p)
    write(p, data[:-64])
    assert_all_refused(p, cls=IncompleteError)
    write(p, data + bytes(64))
    assert_all_refused(p, cls=CorruptError)


@pytest.mark.parametrize("encrypt_index", [True, False])
def test_feature_bit_stripped(tmp_path, encrypt_index):
    """Bit 2 cleared and the block removed, every checksum recomputed: a reader with the key
    refuses a file that is not encrypted; one without gets ciphertext it cannot parse, or (clear
    index) chunks of ciphertext, never the values."""
    p = save(str(tmp_path / "e.ckpt"), encrypt_index=encrypt_index)
    data = read(p)
    at = Layout(data)
    stripped = bytearray(data[: at.block]) + data[at.footer :]
    struct.pack_into("<Q", stripped, 40, 0)
    struct.pack_into("<Q", stripped, 32, len(stripped))
    reseal_prologue(stripped)
    struct.pack_into("<Q", stripped, len(stripped) - 64 + 40, 0)
    reseal_footer(stripped)
    write(p, stripped)
    assert_all_refused(p, cls=(DecryptionError, CorruptError))  # type: ignore[arg-type]
    with pytest.raises(DecryptionError, match="not encrypted"):
        ckptfmt.load(p, decrypt_with=KEY)
    if encrypt_index:
        with pytest.raises(CorruptError):
            ckptfmt.load(p)
    else:
        assert not torch.equal(ckptfmt.load(p)["w"], state()["w"])  # type: ignore[arg-type]


def test_feature_bit_forged(tmp_path):
    """Bit 2 set on a plain file (prologue checksum recomputed): no encryption block."""
    p = str(tmp_path / "p.ckpt")
    ckptfmt.save(state(), p, chunk_size=CHUNK)
    data = read(p)
    struct.pack_into("<Q", data, 40, fmt.FEATURE_ENCRYPTED)
    reseal_prologue(data)
    write(p, data)
    assert_all_refused(p, cls=CorruptError)
    with pytest.raises(CorruptError, match="encryption block"):
        ckptfmt.load(p)


@pytest.mark.parametrize(
    ("bits", "cls"),
    [
        # bits 0 and 2 are defined together (17.9): a set bit 0 without externals is corrupt
        (fmt.FEATURE_ENCRYPTED | 1, CorruptError),
        # bits 1 and 2 are defined together (17.8): a set bit 1 without a signature block is corrupt
        (fmt.FEATURE_ENCRYPTED | fmt.FEATURE_SIGNED, CorruptError),
        (fmt.FEATURE_ENCRYPTED | fmt.FEATURE_SIGNED | 1, ckptfmt.UnsupportedError),
    ],
)
def test_feature_bit_combinations_refused(tmp_path, bits, cls):
    p = save(str(tmp_path / "e.ckpt"))
    data = read(p)
    struct.pack_into("<Q", data, 40, bits)
    reseal_prologue(data)
    write(p, data)
    assert_all_refused(p, cls=cls)


def test_partial_load_decrypts_only_what_it_reads(tmp_path):
    """open().get() reads and decrypts only the chunks of the tensor asked for: a chunk of `w`
    whose tag is damaged does not stop `b`."""
    p = save(str(tmp_path / "e.ckpt"))
    data = read(p)
    at = Layout(data)
    data[at.tags] ^= 0xFF  # chunk 0 belongs to "w"
    write(p, data)
    with ckptfmt.open(p, decrypt_with=KEY) as r:
        assert torch.equal(r.get("b"), state()["b"])  # type: ignore[arg-type]
        with pytest.raises(DecryptionError) as e:
            r.get("w")
        assert e.value.chunk == 0 and e.value.key == "state['w']"


def test_load_into_checks_every_tag_before_writing(tmp_path):
    """The last chunk's tag is damaged: load_into fails in its first pass, no target written."""
    p = save(str(tmp_path / "e.ckpt"))
    data = read(p)
    at = Layout(data)
    data[at.tags + 16 * (at.n - 1)] ^= 1
    write(p, data)
    t = targets()
    with pytest.raises(DecryptionError):
        ckptfmt.load_into(p, t, decrypt_with=KEY)
    assert not t["w"].any() and not t["b"].any()


def _small_encrypted() -> bytes:
    return small_file_bytes("encrypted", encrypt_with=KEY, chunk_size=CHUNK)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_bit_is_refused(tmp_path, data):
    """Every bit of an encrypted file is covered: flipping any one makes a load with the key
    refuse it with the class its place calls for, before anything is returned: damage the
    checksums or structure catch first is corrupt (or incomplete, unsupported, a limit), and a
    bit of the encryption block that only cryptography covers (the wrapped key, the hint, the
    flags, the index tag, a chunk's tag) is a DecryptionError."""
    raw = bytearray(_small_encrypted())
    at = Layout(raw)
    bit = data.draw(st.integers(0, 8 * len(raw) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    p = str(tmp_path / "f.ckpt")
    write(p, raw)
    byte = bit // 8
    crypto_only = (
        at.block + 20 <= byte < at.block + 21
        and bit % 8 == 0  # the index-encrypted flag
        or at.block + 32 <= byte < at.block + 40  # the hint
        or at.block + 48 <= byte < at.block + 64  # the index tag
        or at.wrapped <= byte < at.wrapped + at.wlen
        or at.tags <= byte < at.tags + 16 * at.n
    )
    expected = (
        DecryptionError
        if crypto_only
        else (CorruptError, IncompleteError, ckptfmt.UnsupportedError, ckptfmt.LimitError)
    )
    with pytest.raises(expected):
        ckptfmt.load(p, decrypt_with=KEY)


# -- verify and inspect without the key ------------------------------------------------


def test_verify_without_key(tmp_path):
    enc_index = save(str(tmp_path / "a.ckpt"))
    clear_index = save(str(tmp_path / "b.ckpt"), encrypt_index=False)
    r = ckptfmt.verify(enc_index)
    assert r.ok and "were not" in r.not_checked and r.chunks == 0
    r = ckptfmt.verify(clear_index)
    assert r.ok and "GCM tags" in r.not_checked and r.chunks == 13
    assert ckptfmt.verify(clear_index, decrypt_with=KEY).not_checked == ""
    # the ciphertext's integrity is still checked without the key
    data = read(clear_index)
    data[64 + CHUNK + 7] ^= 4
    write(clear_index, data)
    r = ckptfmt.verify(clear_index)
    assert not r.ok and [(p.kind, p.chunk) for p in r.problems] == [("corrupt", 1)]
    data = read(enc_index)
    at = Layout(data)
    data[at.ioff + 3] ^= 4
    write(enc_index, data)
    r = ckptfmt.verify(enc_index)
    assert not r.ok and r.problems[0].kind == "corrupt" and "index checksum" in r.problems[0].message
    data[at.ioff + 3] ^= 4
    data[at.block + 2] ^= 1  # the block's magic
    write(enc_index, data)
    assert not ckptfmt.verify(enc_index).ok


def test_keygen_encryption(tmp_path):
    out = tmp_path / "new.key"
    run_cli("keygen", out, "--encryption", rc=0)
    assert os.stat(out).st_mode & 0o777 == 0o600
    assert run_cli("keygen", out, "--encryption").returncode == 2  # never replaces a key
    kek = encryption.read_key_file(str(out), "k")
    assert len(kek) == 32 and out.read_text() == kek.hex() + "\n"
    p = save(str(tmp_path / "e.ckpt"), key=str(out))
    assert_same(ckptfmt.load(p, decrypt_with=kek), state())


def test_cli(tmp_path):
    keyfile = tmp_path / "k.hex"
    keyfile.write_text(KEY.hex() + "\n")
    p = str(tmp_path / "e.ckpt")
    ckptfmt.save(state(), p, encrypt_with=str(keyfile), chunk_size=CHUNK, metadata={"secret": "name"})
    r = run_cli("inspect", p, rc=0)
    assert "index encrypted" in r.stdout and "secret" not in r.stdout and "'w'" not in r.stdout
    assert encryption.Key(kek=KEY).hint.hex() in r.stdout
    r = run_cli("inspect", p, "--json", rc=0)
    info = json.loads(r.stdout)
    assert info["encryption"]["index_encrypted"] and info["encryption"]["chunks"] == 13
    r = run_cli("inspect", p, "--decrypt-key", keyfile, rc=0)
    assert "secret" in r.stdout and "['w']" in r.stdout
    r = run_cli("verify", p, rc=0)
    assert "not" in r.stdout and "decrypt" in r.stdout
    run_cli("verify", p, "--decrypt-key", keyfile, rc=0)
    other = tmp_path / "o.hex"
    other.write_text(OTHER.hex())
    r = run_cli("verify", p, "--decrypt-key", other, rc=1)
    assert "decryption" in r.stdout
    run_cli("verify", p, "--decrypt-key", tmp_path / "missing", rc=2)


# -- the golden encrypted file, decrypted from the spec alone -------------------------


def decrypt_from_spec(path: str, kek: bytes) -> tuple[dict[str, object], list[bytes]]:
    """Section 17 implemented from the spec's tables with struct, json, zstandard, numpy and
    cryptography's AESGCM only: a second reader.  Returns the index and each chunk's raw bytes."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89CKF\r\n\x1a\n" and struct.unpack_from("<Q", data, 40)[0] == 4
    fid = data[16:32]
    footer = len(data) - 64
    ioff, ilen, _, ffid, blen = struct.unpack_from("<QQQ16sQ", data, footer)
    assert ffid == fid
    block = footer - blen
    assert block == (ioff + ilen + 63) // 64 * 64
    head = data[block : block + 64]
    magic, cipher, wrap, flags, n, hint, wlen, reserved, index_tag = struct.unpack("<16sHHIQ8sII16s", head)
    assert (magic, cipher, wrap, flags, reserved, wlen) == (b"ckptfmt-enc" + bytes(5), 1, 1, 1, 0, 60)
    import hashlib

    assert hint == hashlib.sha256(b"ckptfmt-kek-hint" + kek).digest()[:8]
    fields = head[16:48]
    wrapped = data[block + 64 : block + 64 + wlen]
    data_key = AESGCM(kek).decrypt(wrapped[:12], wrapped[12:], b"ckptfmt-key-wrap" + fid + fields)
    tags_at = block + 64 + (wlen + 63) // 64 * 64
    assert blen == (tags_at - block + 16 * n + 63) // 64 * 64
    context = struct.pack("<16s16sQQ32s", b"ckptfmt-idx-gcm\0", fid, ioff, ilen, fields)
    index_nonce = bytes(8) + b"\x01\0\0\0"
    index = json.loads(AESGCM(data_key).decrypt(index_nonce, data[ioff : ioff + ilen] + index_tag, context))
    assert len(index["chunks"]) == n
    chunks = []
    for k, (offset, stored, raw, codec, filt, width, _check) in enumerate(index["chunks"]):
        aad = struct.pack(
            "<16s16sQQQQBBB5x", b"ckptfmt-aes-gcm\0", fid, k, offset, stored, raw, codec, filt, width
        )
        tag = data[tags_at + 16 * k : tags_at + 16 * k + 16]
        plain = AESGCM(data_key).decrypt(
            struct.pack("<Q", k) + bytes(4), data[offset : offset + stored] + tag, aad
        )
        if codec == 1:
            plain = zstandard.ZstdDecompressor().decompress(plain, max_output_size=raw)
        if filt == 1:
            plain = np.frombuffer(plain, np.uint8).reshape(width, raw // width).T.tobytes()
        assert len(plain) == raw
        chunks.append(plain)
    return index, chunks


def plain_chunks_from_spec(path: str) -> tuple[dict[str, object], list[bytes]]:
    """The same for an unencrypted file (sections 3 and 5)."""
    data = open(path, "rb").read()
    ioff, ilen = struct.unpack_from("<QQ", data, len(data) - 64)
    index = json.loads(data[ioff : ioff + ilen])
    chunks = []
    for offset, stored, raw, codec, filt, width, _check in index["chunks"]:
        plain = data[offset : offset + stored]
        if codec == 1:
            plain = zstandard.ZstdDecompressor().decompress(plain, max_output_size=raw)
        if filt == 1:
            plain = np.frombuffer(plain, np.uint8).reshape(width, raw // width).T.tobytes()
        chunks.append(plain)
    return index, chunks


def test_golden_encrypted_file_decrypts_from_the_spec(tmp_path):
    from golden.make_golden import ENCRYPTION_TEST_KEY

    index, chunks = decrypt_from_spec(os.path.join(GOLDEN, "v1_0_encrypted.ckpt"), ENCRYPTION_TEST_KEY)
    plain_index, plain = plain_chunks_from_spec(os.path.join(GOLDEN, "v1_0_zstd.ckpt"))
    assert chunks == plain and len(chunks) > 10
    assert index["nodes"] == plain_index["nodes"] and index["storages"] == plain_index["storages"]
    # and files ckptfmt writes now, compressed and not
    for compression in (None, "zstd"):
        p = save(str(tmp_path / "a.ckpt"), compression=compression)
        q = str(tmp_path / "b.ckpt")
        ckptfmt.save(state(), q, chunk_size=CHUNK, compression=compression)
        assert decrypt_from_spec(p, KEY)[1] == plain_chunks_from_spec(q)[1]


# -- the save's small seals by the engine (no cryptography import on the save path) ------------

ENGINE_CRYPTO = pytest.mark.skipif(not native.crypto_available(), reason="engine built without libcrypto")


@ENGINE_CRYPTO
@settings(max_examples=60, deadline=None)
@given(
    key=st.binary(min_size=32, max_size=32),
    nonce=st.binary(min_size=12, max_size=12),
    data=st.binary(max_size=3000),
    aad=st.binary(max_size=200),
)
def test_engine_gcm_is_aes_gcm(key, nonce, data, aad):
    """The engine's one-shot seal and opening (key wrap, index) are cryptography's AES-GCM
    exactly: the same bytes, and a changed bit refused with its InvalidTag."""
    from cryptography.exceptions import InvalidTag

    sealed = native.EngineGCM(key).encrypt(nonce, data, aad)
    assert sealed == AESGCM(key).encrypt(nonce, data, aad)
    assert native.EngineGCM(key).decrypt(nonce, sealed, aad) == data
    for bad in (bytes([sealed[0] ^ 1]) + sealed[1:], sealed[:-1] + bytes([sealed[-1] ^ 0x80]), sealed[:15]):
        with pytest.raises(InvalidTag):
            native.EngineGCM(key).decrypt(nonce, bad, aad)
    assert key.hex() not in repr(native.EngineGCM(key))


@ENGINE_CRYPTO
def test_an_encrypted_save_and_load_do_not_import_cryptography(tmp_path):
    """Its first import costs a save or a load a tenth of a second or more: the engine seals
    and opens the key wrap and the index itself."""
    import subprocess
    import sys

    path = str(tmp_path / "x.ckpt")
    code = (
        "import sys, torch, ckptfmt\n"
        f"ckptfmt.save({{'w': torch.arange(10.)}}, {path!r}, encrypt_with=bytes(range(32)))\n"
        f"assert ckptfmt.load({path!r}, decrypt_with=bytes(range(32)))['w'][9] == 9\n"
        "print(sorted(m for m in sys.modules if m.startswith('cryptography')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CKPTFMT_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout
    assert torch.equal(ckptfmt.load(path, decrypt_with=bytes(range(32)))["w"], torch.arange(10.0))


@ENGINE_CRYPTO
def test_a_damaged_encrypted_file_is_a_decryption_error_without_cryptography(tmp_path):
    """With the engine, encrypted files need no ``cryptography``: every flipped bit of one is
    still a CheckpointError (a changed index or wrapped key a DecryptionError), never an
    ImportError from reaching for cryptography's InvalidTag."""
    import subprocess
    import sys

    path = str(tmp_path / "x.ckpt")
    ckptfmt.save({"w": torch.arange(10.0)}, path, encrypt_with=bytes(range(32)))
    code = (
        "import sys\n"
        "for m in ('cryptography', 'cryptography.exceptions', 'cryptography.hazmat'):\n"
        "    sys.modules[m] = None  # as if not installed\n"
        "import ckptfmt\n"
        f"good = open({path!r}, 'rb').read()\n"
        "seen = set()\n"
        "for off in range(len(good)):\n"
        "    bad = bytearray(good); bad[off] ^= 1\n"
        f"    open({path!r}, 'wb').write(bad)\n"
        "    try:\n"
        f"        ckptfmt.load({path!r}, decrypt_with=bytes(range(32)))\n"
        "    except ckptfmt.CheckpointError as e:\n"
        "        seen.add(type(e).__name__)\n"
        "print(sorted(seen))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CKPTFMT_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DecryptionError" in out.stdout, out.stdout


def test_the_index_is_sealed_and_opened_with_the_gcm_handed_down(tmp_path):
    """The engine's choice of GCM travels down to the format's index sealing and opening (the
    reader's opener carries it): no module of a higher layer sets it in format.encryption, and
    the GCM the opener carries is the one the index is opened with."""
    import dataclasses

    from ckptfmt.format import encryption as layout_encryption
    from ckptfmt.format.index import parse_index

    key = tmp_path / "k"
    key.write_bytes(os.urandom(32))
    path = tmp_path / "e.ckpt"
    ckptfmt.save({"w": torch.arange(8.0)}, path, encrypt_with=str(key))
    assert not hasattr(layout_encryption, "small_gcm")  # nothing injected
    given = encryption.opener(str(key))
    assert given is not None and given.gcm is encryption.small_gcm
    made: list[int] = []

    def recording_gcm(data_key: bytes) -> object:
        made.append(len(data_key))
        return given.gcm(data_key)

    fd = os.open(path, os.O_RDONLY)
    try:
        index = parse_index(fd, str(path), None, dataclasses.replace(given, gcm=recording_gcm))
    finally:
        os.close(fd)
    assert made == [32] and index.encryption is not None and index.encryption.index_encrypted

"""The index rules: the spec in code.

A file's prologue, footer and index are read and validated here, once, before any chunk
is read (spec section 9, steps 1 to 7).  This module implements:

* sections 2 and 7 (through format.py): the prologue and the footer;
* sections 4 and 5: the index bytes, their zero padding and the index checksum;
* section 5: the JSON rules (through indexjson.py: UTF-8, integer literals only, no
  duplicate members, exactly the top-level members; in a text without escapes the members
  are counted against those the checks accept instead of json checking each object,
  validate.TextCount), `chunk_size`, `producer`, `metadata`, `source_devices` and the
  storage records;
* section 3: the chunk records and their placement (offsets, lengths, codec, filter,
  checksum format, the data section ending at the index), and each chunk's padding;
* sections 12.1 to 12.4 (required feature bit 0): content digests, the `externals` member,
  its reference paths and external chunk records;
* section 8: every limit checked before anything is allocated for it, among them the
  memory the index may take (`max_bytes`);
* section 17 (required feature bit 2): the encryption block's structure, and, given an
  opener for the data key, the index's GCM tag and its decryption before it is parsed;
  with bit 1 too (17.8), the signature block after it, handed to an authenticator before
  any key is used.

The object tree (section 6) is validated by validate.validate_tree, called from here.  The
result is an `Index` of plain records (`Chunk`, `External`, tree.StorageRecord, the
tree) that the chunk reader (chunkread.py) and CheckpointFile (reader.py) use as they are.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import os
import posixpath
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import (
    CorruptError,
    DecryptionError,
    IncompleteError,
    LimitError,
    SignatureError,
    UnsupportedError,
)
from ..fileio import is_url, pread_exact
from ..gcpause import pausing
from . import encryption, locations, tree, validate
from . import layout as fmt
from .chunks import HEX16, Chunk, plain_raw_chunk, plain_raw_chunks
from .encryption import Opener
from .frozen import Frozen
from .indexjson import INDEX_FIELDS, INDEX_FIELDS_EXTERNAL, parse_index_json
from .layout import Limits

if TYPE_CHECKING:
    from . import signing  # imported where a file is signed: a load of any other never needs it


class External(Frozen):
    """An entry of the index's `externals` (section 12): a file external chunks lie in."""

    __slots__ = ("rel", "file_id", "length", "path")
    rel: str  # the reference path, as recorded
    file_id: bytes
    length: int
    path: str  # rel joined to the referencing file's directory: what is opened

    def __init__(self, rel: str, file_id: bytes, length: int, path: str) -> None:
        self._set(rel, file_id, length, path)

    @property
    def name(self) -> str:
        """The path as messages show it, ".." resolved by name: in a URL, in its key alone
        (normpath would fold its "//"); a URL whose ".." would leave its bucket, as it is."""
        if is_url(self.path):
            return folded_url(self.path) or self.path
        return os.path.normpath(self.path)


def folded_url(url: str) -> str | None:
    """`url` (scheme://bucket/key) with "." and ".." segments folded in its key, as a store's
    reader resolves a reference (storage/references.py); None where ".." would leave the
    bucket (a reference that is refused)."""
    head, sep, rest = url.partition("://")
    bucket, slash, key = rest.partition("/")
    folded = posixpath.normpath(key) if key else ""
    if folded in (".", "..") or folded.startswith(("../", "/")):
        return None
    return f"{head}{sep}{bucket}{slash}{folded}"


def _placed(ch: Chunk, pad: int, source: int = -1, number: int = -1) -> Chunk:
    """`ch` with its padding, and for an external chunk its file and chunk number there."""
    return Chunk(
        ch.offset,
        ch.stored_len,
        ch.raw_len,
        ch.codec,
        ch.filter,
        ch.width,
        ch.checksum,
        pad,
        ch.digest,
        source,
        number,
    )


def _is_hex(v: object, digits: int) -> bool:
    return type(v) is str and len(v) == digits and HEX16.issuperset(v)


def _str_map(c: validate.Check, v: object, what: str, cap: int) -> dict[str, str]:
    if type(v) is not dict:
        raise c.fail(f"{what} is not an object")
    if len(v) > cap:
        raise c.fail(f"{what} has {len(v)} entries, above the limit {cap}", limit=True)
    for k, s in v.items():
        c.str_(s, f"{what}[{k[:40]!r}]")
    return dict(v)


@dataclass(frozen=True)
class Index:
    """A file's validated index, with the prologue and footer it was found through."""

    prologue: fmt.Prologue
    footer: fmt.Footer
    chunk_size: int
    producer: dict[str, str]
    metadata: dict[str, str]
    source_devices: list[str]
    storages: list[tree.StorageRecord]
    has_digests: bool  # required feature bit 0: chunk records carry content digests
    externals: list[External]
    chunks: list[Chunk]
    tree: tree.Tree
    #: what the index may take while it is parsed and held (an upper bound)
    memory: int
    #: signed files (required feature bit 1, section 16): the signature block, its structure
    #: checked (not its signature: files/signing.py), and the SHA-256 of the index bytes
    signature: signing.SignatureBlock | None = None
    index_sha256: bytes = b""
    #: encrypted files (required feature bit 2, section 17): the encryption block, and the
    #: data key when the file was opened with its key (b"" without; never in a repr)
    encryption: encryption.EncryptionBlock | None = None
    data_key: bytes = field(default=b"", repr=False, compare=False)
    #: signed encrypted files (bits 1 and 2, section 17.8): SHA-256 of the whole encryption
    #: block, which their signed message binds
    encryption_sha256: bytes = b""
    #: encrypted files opened with their key: what unwraps a data key, for the files external
    #: chunks lie in (section 17.9: they are unwrapped by the same key)
    opener: Opener | None = field(default=None, repr=False, compare=False)

    def key_of(self, k: int) -> str:
        """The key path of the first tensor using chunk k, rendered now (at most render.PATH_CHARS)."""
        firsts = self._first_chunks
        return self.storages[bisect.bisect_right(firsts, k) - 1].key

    @functools.cached_property
    def _first_chunks(self) -> list[int]:
        return [rec.first_chunk for rec in self.storages]


#: checks a signed encrypted file's signature before its key is used: (prologue, footer,
#: SHA-256 of the stored index, signature block, SHA-256 of the encryption block) -> None
Authenticator = Callable[[fmt.Prologue, fmt.Footer, bytes, "signing.SignatureBlock", bytes], None]


@pausing
def parse_index(
    fd: int,
    path: str,
    max_bytes: int | None,
    decrypt: encryption.Opener | None = None,
    ciphertext_only: bool = False,
    authenticate: Authenticator | None = None,
) -> Index:
    """Read and validate the prologue, footer and index of the file open at `fd`.

    `max_bytes` bounds the memory the index may take (estimated before it is parsed,
    fmt.index_memory_bound): LimitError before anything above it is allocated.
    `decrypt` (an encryption.Opener): the file must be encrypted (section 17); its data
    key is unwrapped and the index's tag checked before the index is parsed, and each
    chunk record gets its tag.  Without it an encrypted file raises encryption.KeyRequired
    once what is in clear is checked, unless `ciphertext_only` and its index is in clear:
    then the index is parsed unauthenticated, for checks of the ciphertext alone.
    `authenticate` (signed encrypted files, section 17.8): called with the prologue, the
    footer, the SHA-256 of the stored index, the signature block and the SHA-256 of the
    encryption block once their structure is checked, before any key is used: it raises to
    refuse the file (a signed file without encryption is checked by its caller, after this).
    """
    return _IndexParser(fd, path, max_bytes, decrypt, ciphertext_only, authenticate).parse()


class _IndexParser:
    """One parse: the members read so far, which the rules of the later ones depend on."""

    def __init__(
        self,
        fd: int,
        path: str,
        max_bytes: int | None,
        decrypt: encryption.Opener | None = None,
        ciphertext_only: bool = False,
        authenticate: Authenticator | None = None,
    ) -> None:
        self._fd = fd
        self._authenticate = authenticate
        self.path = path
        self.max_bytes = max_bytes
        self.index_memory = 0
        self._decrypt = decrypt
        self._ciphertext_only = ciphertext_only
        self.storages: list[tree.StorageRecord] = []
        self.chunks: list[Chunk] = []

    def _charge_index(self, nbytes: int) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise LimitError(
                f"reading the index needs up to {nbytes} bytes of memory, above max_bytes={self.max_bytes}",
                path=self.path,
                offset=self.footer.index_offset,
            )
        self.index_memory = nbytes

    def _read(self, offset: int, n: int) -> bytes:
        return pread_exact(self._fd, offset, n)

    def parse(self) -> Index:
        path = self.path
        size = os.fstat(self._fd).st_size
        self.prologue = fmt.parse_prologue(self._read(0, fmt.PROLOGUE_SIZE), size, path)
        length = self.prologue.file_length
        self.footer = fmt.parse_footer(
            self._read(length - fmt.FOOTER_SIZE, fmt.FOOTER_SIZE), self.prologue, path
        )
        ioff, ilen = self.footer.index_offset, self.footer.index_length
        # signed files: the signature block lies between the index's padding and the footer
        block_at = length - fmt.FOOTER_SIZE - self.footer.signature_length
        self._charge_index(length - fmt.FOOTER_SIZE - ioff)  # the raw bytes, before they are read
        raw = self._read(ioff, ilen)
        padding = self._read(ioff + ilen, block_at - ioff - ilen)
        if len(raw) + len(padding) != block_at - ioff:
            raise IncompleteError("file shrank while its index was read", path=path, offset=ioff)
        if fmt.index_checksum(self.prologue.file_id, ioff, raw) != self.footer.index_checksum:
            raise CorruptError("index checksum mismatch", path=path, offset=ioff)
        if any(padding):
            raise CorruptError("padding after the index is not zero", path=path, offset=ioff + ilen)
        required = self.prologue.required_features
        # SHA-256 of the index bytes as stored (ciphertext when encrypted): what a signature binds
        index_sha256 = hashlib.sha256(raw).digest() if required & fmt.FEATURE_SIGNED else b""
        enc, data_key, early_block, enc_sha256 = None, b"", None, b""
        if required & fmt.FEATURE_ENCRYPTED:
            enc, early_block, enc_sha256 = self._encrypted_tail(block_at)
            if early_block is None and self._authenticate is not None:
                raise SignatureError(
                    "file is not signed, and a signature by a trusted key is required", path=path
                )
            if early_block is not None and self._authenticate is not None:
                # signed encrypted files: the signature is checked before the data key is
                # unwrapped or anything decrypted (section 17.8)
                self._authenticate(self.prologue, self.footer, index_sha256, early_block, enc_sha256)
            data_key, raw = self._decrypted_index(enc, block_at, raw)
        elif self._decrypt is not None:
            raise DecryptionError(
                "file is not encrypted (required feature bit 2 is clear), and a key was given to decrypt it",
                path=path,
                offset=40,
            )
        self._charge_index(fmt.index_memory_bound(raw))  # before json builds anything
        external = bool(self.prologue.required_features & fmt.FEATURE_EXTERNAL)
        fields = INDEX_FIELDS_EXTERNAL if external else INDEX_FIELDS
        # what the index's members are checked with (_members): where the signature or encryption
        # block starts, the index's SHA-256 (signed files), the blocks, the data key
        self._block_at, self._index_sha256, self._data_key = block_at, index_sha256, data_key
        self._enc, self._early_block, self._enc_sha256 = enc, early_block, enc_sha256
        if raw.find(b"\\") >= 0:  # escapes: every object's members checked as json builds it
            members = parse_index_json(raw, path, fields)
            del raw
            return self._members(members, external, None)
        # no escapes (the indexes ckptfmt writes of ASCII keys): the members are counted instead,
        # `raw` kept until they are counted and checked, as a refusal is made from it again
        count = validate.TextCount()
        failure: Exception | None = None
        try:
            index = self._members(parse_index_json(raw, path, fields, repeats=False), external, count)
        except Exception as e:
            failure = e
        else:
            if raw.count(b":") == count.members + count.colons:
                return index
            del index  # a member repeated (or a colon the count missed)
        # parsed again, json refusing a repeated member, as it did before any other check: the
        # first parse's objects freed first (a failure's traceback holds them in its frames), so
        # that a refusal takes no more memory than fmt.index_memory_bound
        if failure is not None:
            traceback.clear_frames(failure.__traceback__)
        self.chunks, self.storages = [], []
        members = parse_index_json(raw, path, fields)
        if failure is not None:
            raise failure
        return self._members(members, external, None)

    def _members(self, index: dict[str, Any], external: bool, count: validate.TextCount | None) -> Index:
        """The Index from the parsed JSON `index` (every member checked) and what parse read
        before it (where the blocks after the index lie, the data key); with `count`, every member of the objects it accepts and every
        colon of the strings it keeps that may hold one counted (validate.TextCount)."""
        block_at, enc, data_key = self._block_at, self._enc, self._data_key
        path = self.path
        c = validate.Check(path)
        self.chunk_size = c.bounded_int(index["chunk_size"], "chunk_size", fmt.MAX_CHUNK_SIZE)
        if self.chunk_size < fmt.MIN_CHUNK_SIZE or self.chunk_size & (self.chunk_size - 1):
            raise CorruptError(f"index: chunk_size {self.chunk_size} is not a power of two", path=path)
        self.producer = _str_map(c, index["producer"], "producer", 64)
        self.metadata = _str_map(c, index["metadata"], "metadata", Limits.MAX_METADATA_ENTRIES)
        self.source_devices = [
            c.str_(d, "source_devices entry") for d in c.list_(index["source_devices"], "source_devices")
        ]
        self._storage_colons = 0
        self.storages = self._parse_storages(c, index["storages"])
        self.has_digests = external
        self.externals = self._parse_externals(c, index["externals"]) if external else []
        if count is not None:  # chunk records hold no colon: ints, and strings of hex digits
            count.members += len(index) + len(self.producer) + len(self.metadata)
            count.colons += self._storage_colons
            count.strings(*self.producer, *self.producer.values(), *self.metadata, *self.metadata.values())
            count.strings(*self.source_devices, *(e.rel for e in self.externals))
        # the JSON records are dropped as soon as they are parsed: they cost more than the Chunks
        self.chunks = self._parse_chunks(c, index.pop("chunks"))
        nodes = validate.validate_tree(index.pop("nodes"), self.storages, path, count)
        block = self._early_block
        if self._index_sha256 and block is None:
            from . import signing

            want = signing.block_length(len(self.chunks))
            if self.footer.signature_length != want:  # checked before the block is read
                raise CorruptError(
                    f"signature block is {self.footer.signature_length} bytes, {want} for {len(self.chunks)} chunks",
                    path=path,
                    offset=self.prologue.file_length - fmt.FOOTER_SIZE + 40,
                )
            raw_block = self._read(block_at, self.footer.signature_length)
            if len(raw_block) != self.footer.signature_length:
                raise IncompleteError(
                    "file shrank while its signature block was read", path=path, offset=block_at
                )
            block = signing.parse_block(raw_block, len(self.chunks), path, block_at)
        if enc is not None:
            if enc.nchunks != len(self.chunks):
                raise CorruptError(
                    f"encryption block lists {enc.nchunks} chunks, the index {len(self.chunks)}",
                    path=path,
                    offset=block_at + 24,
                )
            for k, ch in enumerate(self.chunks):
                if ch.source >= 0 and any(enc.tag_of(k)):  # its tag is its own file's (17.9)
                    raise CorruptError("tag table entry of an external chunk is not zero", path=path, chunk=k)
            if data_key:
                self.chunks = [
                    ch._replace(tag=enc.tag_of(k)) if ch.source < 0 else ch
                    for k, ch in enumerate(self.chunks)
                ]
        return Index(
            self.prologue,
            self.footer,
            self.chunk_size,
            self.producer,
            self.metadata,
            self.source_devices,
            self.storages,
            self.has_digests,
            self.externals,
            self.chunks,
            nodes,
            self.index_memory,
            block,
            self._index_sha256,
            enc,
            data_key,
            self._enc_sha256,
            self._decrypt if data_key else None,
        )

    def _encrypted_tail(
        self, block_at: int
    ) -> tuple[encryption.EncryptionBlock, signing.SignatureBlock | None, bytes]:
        """Encrypted files: the encryption block (structure checked); for a signed one (section
        17.8) also the signature block after it and the SHA-256 of the whole encryption block."""
        size = self.footer.signature_length
        tail = self._read(block_at, size)
        if len(tail) != size:
            raise IncompleteError(
                "file shrank while its encryption block was read", path=self.path, offset=block_at
            )
        if not self.prologue.required_features & fmt.FEATURE_SIGNED:
            return encryption.parse_block(tail, self.path, block_at), None, b""
        enc_len = encryption.block_length_from_header(tail)
        if enc_len is None or enc_len >= size:
            raise CorruptError(
                "encryption block's header does not leave room for the signature block after it",
                path=self.path,
                offset=block_at,
            )
        from . import signing

        enc = encryption.parse_block(tail[:enc_len], self.path, block_at)
        sig = signing.parse_block(tail[enc_len:], enc.nchunks, self.path, block_at + enc_len)
        return enc, sig, hashlib.sha256(tail[:enc_len]).digest()

    def _decrypted_index(
        self, enc: encryption.EncryptionBlock, block_at: int, raw: bytes
    ) -> tuple[bytes, bytes]:
        """Encrypted files: the data key (b"" without an opener) and the index's plaintext, its
        tag checked (section 17.6)."""
        if self._decrypt is None:
            if enc.index_encrypted or not self._ciphertext_only:
                what = " (its index too)" if enc.index_encrypted else ""
                msg = f"file is encrypted{what}: pass decrypt_with=<key> to read it"
                if self._ciphertext_only:  # verify and inspect show what is in clear
                    raise encryption.KeyRequired(msg, enc, path=self.path)
                raise DecryptionError(msg, path=self.path)
            return b"", raw
        file_id = self.prologue.file_id
        try:
            data_key = self._decrypt.data_key(enc, file_id)
        except DecryptionError as e:
            if e.path is not None:
                raise
            raise DecryptionError(e.reason, path=self.path, offset=block_at) from None
        return data_key, encryption.open_index(
            self._decrypt.gcm, data_key, enc, file_id, self.footer.index_offset, raw, self.path
        )

    def _parse_storages(self, c: validate.Check, raw: object) -> list[tree.StorageRecord]:
        items = c.list_(raw, "storages")
        if len(items) > Limits.MAX_STORAGES:
            raise c.fail(f"{len(items)} storages exceed the limit {Limits.MAX_STORAGES}", limit=True)
        out = []
        first = 0
        # devices checked already, with their colons: a file names few, each many times
        valid: dict[str, int] = {}
        colons = 0
        max_nbytes = Limits.MAX_STORAGE_BYTES
        chunk_size = self.chunk_size
        for sid, item in enumerate(items):
            if type(item) is not list or len(item) != 2:
                raise c.fail(f"storage {sid} is not a [nbytes, device] pair")
            nbytes = item[0]
            if type(nbytes) is not int or not 0 <= nbytes <= max_nbytes:  # the message built only here
                c.bounded_int(nbytes, f"storage {sid} size", max_nbytes)  # raises
            device = item[1]
            k = valid.get(device) if type(device) is str else None
            if k is None:
                c.str_(device, f"storage {sid} device")
                if not locations.valid_location(device):
                    raise c.fail(f"storage {sid} has invalid device {device[:40]!r}")
                k = valid[device] = device.count(":")
            colons += k
            n = -(-nbytes // chunk_size)
            out.append(tree.StorageRecord(nbytes, device, first, n))
            first += n
        self._n_chunks_expected = first
        self._storage_colons = colons
        return out

    def _parse_externals(self, c: validate.Check, raw: object) -> list[External]:
        """The `externals` member (section 12): reference paths, file ids and lengths."""
        items = c.list_(raw, "externals")
        if len(items) > Limits.MAX_EXTERNALS:
            raise c.fail(f"{len(items)} externals exceed the limit {Limits.MAX_EXTERNALS}", limit=True)
        here = os.path.dirname(self.path)
        out: list[External] = []
        seen_paths: set[str] = set()
        seen_ids: set[bytes] = {self.prologue.file_id}
        for e, item in enumerate(items):
            if type(item) is not list or len(item) != 3:
                raise c.fail(f"external {e} is not a [path, file id, length] record")
            rel = c.str_(item[0], f"external {e} path")
            if fmt.REF_PATH_RE.fullmatch(rel) is None:
                raise c.fail(f"external {e} has the path {rel[:80]!r}, which is not a permitted reference")
            if not _is_hex(item[1], 32):
                raise c.fail(f"external {e} file id must be 32 lowercase hex digits")
            fid = bytes.fromhex(item[1])
            length = c.int_(item[2], f"external {e} file length", 2 * fmt.ALIGNMENT, (1 << 63) - 1)
            if length % fmt.ALIGNMENT:
                raise c.fail(f"external {e} file length {length} is not a multiple of {fmt.ALIGNMENT}")
            if rel in seen_paths or fid in seen_ids:
                raise c.fail(f"external {e} repeats a path or file id (or names this file itself)")
            seen_paths.add(rel)
            seen_ids.add(fid)
            path = os.path.join(here, rel)
            if is_url(path) and folded_url(path) is None:  # no other bucket, no other store
                raise c.fail(f"external {e} has the path {rel!r}, which would leave the bucket")
            out.append(External(rel, fid, length, path))
        return out

    def _parse_chunks(self, c: validate.Check, raw: object) -> list[Chunk]:
        items = c.list_(raw, "chunks")
        if len(items) > Limits.MAX_CHUNKS:
            raise c.fail(f"{len(items)} chunks exceed the limit {Limits.MAX_CHUNKS}", limit=True)
        if len(items) != self._n_chunks_expected:
            raise c.fail(f"{len(items)} chunks listed, the storages need {self._n_chunks_expected}")
        # raw length of every chunk follows from the storage sizes and the chunk size (listed only
        # now: as many as the chunk records, checked above)
        chunk_size = self.chunk_size
        raw_lens: list[int] = []
        for rec in self.storages:
            n = rec.n_chunks
            if n == 1:  # the common storage: one chunk of all its bytes
                raw_lens.append(rec.nbytes)
            elif n:
                raw_lens.extend(min(chunk_size, rec.nbytes - j * chunk_size) for j in range(n))
        end_of_data = self.footer.index_offset
        if not self.externals:  # every record a plain raw chunk (most files): accepted column by column
            plain = plain_raw_chunks(items, raw_lens, end_of_data, self.has_digests)
            if plain is not None:
                return plain
        # 7 fields; with content digests (bit 0) 8 for a local chunk, 10 for an external one
        sizes = (8, 10) if self.has_digests else (7,)
        out: list[Chunk] = []
        used = [False] * len(self.externals)
        expect = fmt.PROLOGUE_SIZE  # where the next local chunk must start
        for k, item in enumerate(items):
            if type(item) is not list or len(item) not in sizes:
                raise c.fail(f"chunk {k} is not a record of " + " or ".join(map(str, sizes)) + " fields")
            ch = plain_raw_chunk(item, expect, raw_lens[k], end_of_data, self.has_digests)
            if ch is None:  # anything but a plain raw chunk: every field checked one by one
                ch = self._parse_layout(c, k, item, raw_lens[k])
                if len(item) == 10:
                    ch = self._parse_external_ref(c, k, item, ch)
                    used[ch.source] = True
                else:
                    ch = self._check_local(c, k, ch, expect, end_of_data)
            if ch.source < 0:
                expect = ch.offset + ch.stored_len + ch.pad
            out.append(ch)
        if expect != end_of_data:
            raise CorruptError(
                f"data ends at {expect} but the index starts at {end_of_data}", path=self.path, offset=expect
            )
        if not all(used):
            raise c.fail(f"external {used.index(False)} is not used by any chunk")
        return out

    def _check_local(self, c: validate.Check, k: int, ch: Chunk, expect: int, end_of_data: int) -> Chunk:
        """A chunk of this file: it starts where the previous one's padding ends, ends before
        the index, and its padding reaches the next alignment boundary (where the next local
        chunk, or the index, must start)."""
        c.int_(ch.offset, f"chunk {k} offset", expect, expect)
        end = ch.offset + ch.stored_len
        if end > end_of_data:
            raise CorruptError(
                f"chunk ends at {end}, inside the index at {end_of_data}",
                path=self.path,
                chunk=k,
                offset=ch.offset,
            )
        return _placed(ch, fmt.align_up(end) - end)

    def _parse_layout(self, c: validate.Check, k: int, item: list[Any], raw_len: int) -> Chunk:
        """Fields 0-6 (and the digest, field 7, with bit 0): lengths, codec, filter, checksum."""
        off, slen, rlen, codec, filt, width, check = item[:7]
        where = f"chunk {k}"
        c.int_(off, f"{where} offset", 0, (1 << 63) - 1)
        c.int_(rlen, f"{where} raw length", raw_len, raw_len)
        c.int_(codec, f"{where} codec", 0, 255)
        c.int_(filt, f"{where} filter", 0, 255)
        c.int_(width, f"{where} filter width", 0, 255)
        if codec not in fmt.CODEC_NAMES:
            raise UnsupportedError(f"unknown codec id {codec}", path=self.path, chunk=k, offset=off)
        if filt not in fmt.FILTER_NAMES:
            raise UnsupportedError(f"unknown filter id {filt}", path=self.path, chunk=k, offset=off)
        if codec == fmt.CODEC_RAW:
            c.int_(slen, f"{where} stored length", rlen, rlen)
            if filt != fmt.FILTER_NONE:
                raise c.fail(f"{where} is raw but has a filter")
        else:
            c.int_(slen, f"{where} stored length", 1, rlen - 1)
            if rlen > slen * fmt.ZSTD_MAX_RATIO:
                raise c.fail(f"{where} claims {rlen} bytes from {slen}: more than any zstd frame holds")
        if filt == fmt.FILTER_NONE and width != 0:
            raise c.fail(f"{where} has a filter width without a filter")
        if filt == fmt.FILTER_SHUFFLE and (width not in fmt.SHUFFLE_WIDTHS or rlen % width):
            raise c.fail(f"{where} has shuffle width {width} for {rlen} bytes")
        if not _is_hex(check, 16):
            raise c.fail(f"{where} checksum must be 16 lowercase hex digits")
        digest = b""
        if self.has_digests:
            if not _is_hex(item[7], 32):
                raise c.fail(f"{where} content digest must be 32 lowercase hex digits")
            digest = bytes.fromhex(item[7])
        return Chunk(off, slen, rlen, codec, filt, width, int(check, 16), 0, digest)

    def _parse_external_ref(self, c: validate.Check, k: int, item: list[Any], ch: Chunk) -> Chunk:
        """Fields 8 and 9 of an external record: which file, which chunk of it."""
        where = f"chunk {k}"
        if not self.externals:
            raise c.fail(f"{where} is external but the file lists no externals")
        e = c.int_(item[8], f"{where} external", 0, len(self.externals) - 1)
        number = c.int_(item[9], f"{where} chunk number in the referenced file", 0, Limits.MAX_CHUNKS - 1)
        ext = self.externals[e]
        # the referenced file's data section ends at its index, at least 128 bytes before its end
        if ch.offset < fmt.PROLOGUE_SIZE or ch.offset % fmt.ALIGNMENT:
            raise c.fail(f"{where} is external at offset {ch.offset}, not a chunk position")
        if fmt.align_up(ch.offset + ch.stored_len) > ext.length - fmt.FOOTER_SIZE - fmt.ALIGNMENT:
            raise c.fail(f"{where} is external but lies past the data of {ext.rel} ({ext.length} bytes)")
        pad = fmt.align_up(ch.offset + ch.stored_len) - ch.offset - ch.stored_len
        return _placed(ch, pad, e, number)

"""What the writers of one file are told (engine/chunkwrite.py, the background writers, the C
engine's binding): the options of a file's bytes, and the interfaces of the signer and of an
incremental save's chunk finder that the layers above hand down.  Imports no writer, so the
engine binding (engine/native.py) names these types without a cycle."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from ..format import encryption
from ..format import layout as fmt

ChunkRecord = tuple[int, int, int, int, int, int, int]


#: makes a signature block (files/signing.py): (prologue, footer, SHA-256 of the index as
#: stored, the chunks' digests, SHA-256 of the encryption block or b"") -> the block's bytes
Signer = Callable[[bytes, bytes, bytes, bytes, bytes], bytes]


class Dedup(Protocol):
    """Finds chunks whose bytes an earlier file already holds (incremental saves, spec section 12).

    Given to build_file / finish_file / the background writer, it turns the file into
    one with content digests (required feature bit 0) whose unchanged chunks are
    external records instead of bytes.
    """

    @property
    def can_refer(self) -> bool:
        """False when no chunk can be referred to (no base): the writer then writes every
        chunk and takes the digests in the same pass, reporting them to `written`."""
        ...

    def written(self, first_index: int, digests: list[bytes]) -> None:
        """The digests of chunks first_index.., all written here (used when not can_refer)."""
        ...

    def classify(
        self, first_index: int, pieces: list[tuple[memoryview, int]], engine: str, threads: int
    ) -> list[ChunkRecord | None]:
        """Digest chunks first_index.. (the bytes being saved) and return, per chunk, the record
        of the chunk in an earlier file that holds the same bytes, or None to write it here."""
        ...

    def held_keys(self) -> list[tuple[int, bytes]]:
        """For a writer that cannot call `classify` (a forked child, csrc/snapshot.c): the
        (raw length, content digest) of every chunk it may refer to, sorted, the limits
        `classify` applies already applied; [] when not can_refer."""
        ...

    def adopt(self, digests: list[bytes], matches: list[int]) -> list[ChunkRecord | None]:
        """What that writer found, for every chunk of the file: its digest and the position in
        held_keys() of the same bytes (-1: written).  Returns what `classify` would have: the
        record of each chunk found, None for those written."""
        ...

    def externals(self) -> list[list[Any]]:
        """The index's `externals` member: the files the external records name."""
        ...

    def record(self, k: int, rec: ChunkRecord) -> list[Any]:
        """The index record of chunk k (8 fields when local, 10 when external)."""
        ...

    def recheck(self) -> None:
        """Once the file is committed: read again, within a bounded budget, what held_keys()
        kept from the writer because an earlier check could not read it, for the next save.
        Never raises (the save is committed)."""
        ...

    def claim(self) -> None:
        """A background writer takes it: from now on that writer closes it once its save is
        over (on whatever thread), and its caller must not, even when an error reaches it
        while the save goes on."""
        ...

    def close(self) -> None:
        """Let go of what it holds open (the base it reads): called by every writer once its
        save is over, committed or failed, before a failure is raised (its traceback may
        be kept long after); idempotent.  After it nothing is referred to: classify writes
        every chunk and adopt refuses the writer's findings (CheckpointError)."""
        ...


@dataclass(frozen=True)
class WriteOptions:
    """How the bytes of one file are written: one value, checked where it is made (the public
    call, files/save.py), taken whole by every writer below it (ChunkWriter, finish_file, the
    background writers, the engine).

    compression, level: zstd per chunk (level None: the engine's fast profile);
    chunk_size: a power of two within the format's limits; metadata: the index's string
    pairs (held read-only); sign: makes the signature block (spec section 16); seal: the
    file's data key and the sealing of its index (section 17); dedup: an incremental save's
    chunk finder (section 12)."""

    compression: str | None = None
    level: int | None = None
    chunk_size: int = fmt.DEFAULT_CHUNK_SIZE
    metadata: Mapping[str, str] = field(default_factory=dict)
    sign: Signer | None = None
    seal: encryption.Sealer | None = None
    dedup: Dedup | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))
        if self.sign is not None and self.dedup is not None:  # checked here for every writer
            raise ValueError("signed files cannot have external chunks in this version (spec section 16)")

    @property
    def key(self) -> bytes | None:
        """The data key each chunk is encrypted with (None: a clear file)."""
        return None if self.seal is None else self.seal.data_key

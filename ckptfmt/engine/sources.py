"""Where a chunk reader's bytes come from, besides a local file: the two protocols that
`chunkread.ChunkReader` reads through.  A `Fetcher` brings a remote object's byte ranges
into the spool the reader's descriptor reads, or straight into a load's fresh tensors
(storage/download.py's RemoteObject); a
`References` opens the files a file's external chunks lie in (spec 12.3): a
`ckptdir.CheckpointDir`, or the prefix of an object on a store (storage/references.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol


class Fetcher(Protocol):
    """A remote object's bytes on demand (storage/download.py's RemoteObject): the chunk
    reader's descriptor is a spool that holds only what `start` has fetched into it."""

    #: the memory the load reading it may take (its max_bytes), or None: unbounded
    max_bytes: int | None

    def plan(self, ranges: Sequence[tuple[int, int]], cut: bool = True) -> list[tuple[int, int]]:
        """The requests `ranges` waits for (sorted): those in flight already that overlap them,
        and those `start` would make for the rest by default (bytes held left out, near
        neighbours merged, cut at the fetcher's grid); cut=False: the rest as each stretch
        neither held nor being fetched, whole (no gap merged, no cut)."""

    def start(
        self,
        ranges: Sequence[tuple[int, int]],
        cell: int | None = None,
        gap: int | None = None,
        uses: Sequence[tuple[int, int]] = (),
    ) -> list[Future[None]]:
        """Begin fetching `ranges` and `uses` (bytes held or in flight left out; ranges closer
        than `gap` merged, cut at a grid of `cell` bytes; None: the fetcher's own).  `uses`: what
        the caller reads from the spool, kept there, whatever other reads give back, until it
        gives each back (release)."""

    def held_within(self, ranges: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]] | None]:
        """For each range: None where a fetch into the spool overlaps it, else the parts of it
        the spool holds (none: untouched)."""

    def copy_held(self, targets: Sequence[tuple[int, memoryview]]) -> list[tuple[int, int]]:
        """Copy the bytes of (offset, memory) targets the spool holds into that memory and give
        them back; the ranges copied."""

    def start_into(
        self,
        targets: Sequence[tuple[int, memoryview]],
        landed: Callable[[tuple[int, int]], None],
        spooled: Sequence[tuple[int, int]] = (),
        futures: list[Future[None]] | None = None,
        copied: Sequence[tuple[int, int]] = (),
    ) -> list[Future[None]]:
        """Fetch (offset, memory) targets straight into that memory, not the spool (less the
        `copied` ranges, there already), and the `spooled` ranges into the spool, in one plan;
        `landed` is called with each request's range on its thread once its bytes are in; the
        futures appended to `futures` too."""

    def wait(
        self,
        futures: Sequence[Future[None]],
        needs: Sequence[tuple[int, int]] | None = None,
        cell: int | None = None,
        gap: int | None = None,
        into: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Wait for `futures`; another read's request among them never sent is asked for again:
        the bytes of it the caller `needs` in the spool (None: what the start that gave the
        futures asked for, else all), by `cell` and `gap`; one that was to bring bytes of
        `into` (the caller's memory) straight there is an error."""

    def wait_quietly(self, futures: Sequence[Future[None]]) -> None: ...

    def release(self, ranges: Sequence[tuple[int, int]], wait: bool = False) -> None:
        """Give back ranges read (one use of each); `wait`: return once the memory of those no
        other read uses is freed."""

    def occupied(self) -> int:
        """Bytes held, in flight or not yet freed: the memory the fetcher takes now."""

    def idle(self) -> int:
        """occupied()'s bytes no read uses and no request brings in: what reads left."""

    def close(self) -> None: ...


class References(Protocol):
    """Where a file's reference paths are opened (spec 12.3): a CheckpointDir, or the prefix
    of an object on a store (storage/references.py), whose objects' bytes a Fetcher brings."""

    def open_ref(self, relpath: str) -> int: ...

    def fetcher_of(self, fd: int) -> Fetcher | None: ...

    def opening_time(self) -> float:
        """Seconds an open_ref may take at most (its requests' deadlines), 0 where it takes no
        requests: a read waiting for another's opening waits that long."""

    def release(self, fd: int) -> None:
        """Close descriptor `fd` that open_ref gave, with what it holds."""

    def close(self) -> None: ...

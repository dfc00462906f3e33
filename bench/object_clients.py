"""Raw throughput of candidate object-store clients against a local S3 server (issue 24's choice
of client): upload and download of one object, fresh processes, interleaved rounds, medians.

The bench starts moto's S3 server (tests/s3_server.py) on 127.0.0.1 for the run.  Clients:

* boto3-parallel: boto3 with explicit multipart: 16 MiB parts uploaded from 8 threads; download
  by 8 threads of 16 MiB ranged GETs (If-Match on the ETag), each body read with readinto
  into its slice of one preallocated buffer
* boto3-managed: boto3's managed transfer, upload_fileobj / download_fileobj (16 MiB parts,
  8 threads), the download written into a preallocated buffer
* obstore: obstore.put (multipart, 16 MiB chunks, max_concurrency 8); download by 8 threads of
  obstore.get_range copied into the buffer (get_ranges would coalesce adjacent ranges into one
  request)
* s3fs: pipe_file (16 MiB chunks, max_concurrency 8); cat_ranges of 16 MiB ranges, 8 at a time
  (batch_size; by default fsspec sends them all at once)

Each measurement is one fresh process: the payload (random bytes) or the destination buffer is
made and the client built before the clock starts; peak RSS is the process's high-water mark,
`extra` its rise over the RSS when the clock started.  Every download is checked against the
source's digest after the clock stops.  A client that is not installed is reported missing.

    python bench/object_clients.py [--sizes 256M,1G] [--rounds 3] [--clients boto3-parallel,...]
                                   [--out bench/results] [--name object_clients] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from common import (  # noqa: E402
    command_line,
    machine_state,
    parse_size,
    reset_peak_rss,
    rotated,
    status_bytes,
    summarise,
    write_json,
)

CLIENTS = ["boto3-parallel", "boto3-managed", "obstore", "s3fs"]
MODULES = {"boto3-parallel": "boto3", "boto3-managed": "boto3", "obstore": "obstore", "s3fs": "s3fs"}
PART = 16 << 20
THREADS = 8


def payload(size: int) -> bytes:
    import numpy as np

    return np.random.default_rng(size).bytes(size)


def ranges(size: int, part: int = PART) -> list[tuple[int, int]]:
    """[start, end) of each part of an object of `size` bytes."""
    return [(a, min(a + part, size)) for a in range(0, size, part)]


# -- the clients (run in the child) --------------------------------------------------------------


def boto3_client(opts: dict[str, str]) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        region_name=opts["region"],
        aws_access_key_id=opts["aws_access_key_id"],
        aws_secret_access_key=opts["aws_secret_access_key"],
        config=Config(max_pool_connections=THREADS * 2, s3={"addressing_style": "path"}),
    )


class BufferFile(io.RawIOBase):
    """A writable, seekable file over a preallocated buffer (download_fileobj's destination)."""

    def __init__(self, buf: bytearray) -> None:
        self.view = memoryview(buf)
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.view) + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        n = len(data)
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n


def prepare(client: str, opts: dict[str, str], bucket: str) -> Any:
    """The client object, built before the clock starts."""
    if client.startswith("boto3"):
        return boto3_client(opts)
    if client == "obstore":
        from obstore.store import S3Store

        return S3Store(
            bucket,
            endpoint=opts["endpoint_url"],
            region=opts["region"],
            access_key_id=opts["aws_access_key_id"],
            secret_access_key=opts["aws_secret_access_key"],
            client_options={"allow_http": True},
        )
    import s3fs

    return s3fs.S3FileSystem(
        key=opts["aws_access_key_id"],
        secret=opts["aws_secret_access_key"],
        endpoint_url=opts["endpoint_url"],
        client_kwargs={"region_name": opts["region"]},
        max_concurrency=THREADS,
    )


def upload(client: str, c: Any, bucket: str, key: str, data: bytes) -> None:
    if client == "boto3-parallel":
        view = memoryview(data)
        uid = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def part(i_ab: tuple[int, tuple[int, int]]) -> dict[str, Any]:
            i, (a, b) = i_ab
            r = c.upload_part(
                Bucket=bucket, Key=key, UploadId=uid, PartNumber=i + 1, Body=view[a:b].tobytes()
            )
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        with ThreadPoolExecutor(THREADS) as pool:
            parts = list(pool.map(part, enumerate(ranges(len(data)))))
        c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
    elif client == "boto3-managed":
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS)
        c.upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg)  # BytesIO shares the bytes
    elif client == "obstore":
        import obstore

        obstore.put(c, key, data, use_multipart=True, chunk_size=PART, max_concurrency=THREADS)
    else:
        c.pipe_file(f"{bucket}/{key}", data, chunksize=PART, max_concurrency=THREADS)


def download(client: str, c: Any, bucket: str, key: str, buf: bytearray) -> None:
    view = memoryview(buf)
    parts = ranges(len(buf))
    if client == "boto3-parallel":
        etag = c.head_object(Bucket=bucket, Key=key)["ETag"]

        def get(ab: tuple[int, int]) -> None:
            a, b = ab
            body = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}", IfMatch=etag)["Body"]
            got = a
            while got < b:
                n = body.readinto(view[got:b])
                if not n:
                    raise OSError(f"short body at {got} of range {a}-{b}")
                got += n

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(get, parts))
    elif client == "boto3-managed":
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS)
        c.download_fileobj(bucket, key, BufferFile(buf), Config=cfg)
    elif client == "obstore":
        import obstore

        def oget(ab: tuple[int, int]) -> None:
            a, b = ab
            view[a:b] = memoryview(obstore.get_range(c, key, start=a, end=b))

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(oget, parts))
    else:
        starts, ends = [a for a, _ in parts], [b for _, b in parts]
        # batch_size: fsspec would otherwise send every range at once
        got_all = c.cat_ranges([f"{bucket}/{key}"] * len(parts), starts, ends, batch_size=THREADS)
        for (a, b), got in zip(parts, got_all):
            if isinstance(got, Exception):
                raise got
            view[a:b] = got


def child(client: str, op: str, size: int, opts: dict[str, str], bucket: str, key: str) -> dict[str, Any]:
    c = prepare(client, opts, bucket)
    if op == "up":
        data = payload(size)
        buf = None
    else:
        buf = bytearray(size)
        buf[:] = b"\1" * size  # touched: its pages are resident before the clock starts
    reset_peak_rss()
    base = status_bytes("VmRSS")
    t = time.perf_counter()
    if op == "up":
        upload(client, c, bucket, key, data)
    else:
        assert buf is not None
        download(client, c, bucket, key, buf)
    took = time.perf_counter() - t
    peak = status_bytes("VmHWM")
    digest = hashlib.blake2b(buf, digest_size=16).hexdigest() if buf is not None else None
    return {"seconds": took, "peak_rss": peak, "extra_rss": max(0, peak - base), "digest": digest}


# -- the parent ----------------------------------------------------------------------------------


def installed(client: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(MODULES[client]) is not None


def run_child(client: str, op: str, size: int, opts: dict[str, str], bucket: str, key: str) -> dict[str, Any]:
    args = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        client,
        op,
        str(size),
        json.dumps(opts),
        bucket,
        key,
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{client} {op} {size}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def server_peak_rss(server: Any) -> int:
    pid = server._proc.pid if server._proc is not None else None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(sizes: list[int], rounds: int, clients: list[str]) -> dict[str, Any]:
    from s3_server import S3Server

    rows: dict[str, list[dict[str, Any]]] = {}
    with S3Server() as server:
        opts = server.storage_options()
        bucket = server.new_bucket()
        s3 = server.client()
        for size in sizes:
            src = f"src-{size}"
            data = payload(size)
            upload("boto3-parallel", s3, bucket, src, data)  # the object every download reads
            want = hashlib.blake2b(data, digest_size=16).hexdigest()
            del data
            for r in range(rounds):
                for client in rotated(clients, r):
                    for op in ("up", "down") if r % 2 == 0 else ("down", "up"):
                        key = src if op == "down" else f"{client}/up-{size}"
                        got = run_child(client, op, size, opts, bucket, key)
                        if op == "down" and got["digest"] != want:
                            raise RuntimeError(f"{client} downloaded other bytes than were uploaded")
                        if op == "up":
                            s3.delete_object(Bucket=bucket, Key=key)
                        rows.setdefault(f"{client}/{op}/{size}", []).append(got)
                        print(
                            f"round {r + 1}/{rounds} {client:15s} {op:4s} {size >> 20} MiB "
                            f"{got['seconds']:.3f} s",
                            flush=True,
                        )
            s3.delete_object(Bucket=bucket, Key=src)
        server_rss = server_peak_rss(server)
    return {"rows": {k: summary(v, k) for k, v in rows.items()}, "server_peak_rss": server_rss}


def summary(samples: list[dict[str, Any]], row: str) -> dict[str, Any]:
    size = int(row.rsplit("/", 1)[1])
    secs = [s["seconds"] for s in samples]
    return {
        "seconds": summarise(secs),
        "gbps": size / statistics.median(secs) / 1e9,
        "peak_rss": max(s["peak_rss"] for s in samples),
        "extra_rss": max(s["extra_rss"] for s in samples),
        "samples": secs,
    }


def markdown(doc: dict[str, Any]) -> str:
    st = doc["machine"]
    lines = [
        f"# Object-store clients (bench/object_clients.py), {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Machine: {st['cores']} cores ({st['cpu']}), load average at the start {st['loadavg'].split()[:3]};"
        f" server: moto {doc['versions'].get('moto')} on 127.0.0.1 (its peak RSS"
        f" {doc['server_peak_rss'] / 2**30:.2f} GiB).",
        f"Versions: {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}.",
        f"Missing (not measured): {', '.join(doc['missing']) or 'none'}.",
        "",
        "| client | size | up GB/s | down GB/s | up s (min-max) | down s (min-max) | peak RSS up / down | extra RSS up / down |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for client in doc["clients"]:
        for size in doc["sizes"]:
            up, down = doc["rows"][f"{client}/up/{size}"], doc["rows"][f"{client}/down/{size}"]
            lines.append(
                f"| {client} | {size >> 20} MiB | {up['gbps']:.3f} | {down['gbps']:.3f} | "
                f"{up['seconds']['median']:.2f} ({up['seconds']['min']:.2f}-{up['seconds']['max']:.2f}) | "
                f"{down['seconds']['median']:.2f} ({down['seconds']['min']:.2f}-{down['seconds']['max']:.2f}) | "
                f"{up['peak_rss'] / 2**20:.0f} / {down['peak_rss'] / 2**20:.0f} MiB | "
                f"{up['extra_rss'] / 2**20:.0f} / {down['extra_rss'] / 2**20:.0f} MiB |"
            )
    return "\n".join(lines) + "\n"


def client_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("moto", "boto3", "botocore", "obstore", "s3fs", "aiobotocore"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        client, op, size, opts, bucket, key = argv[1:7]
        print(json.dumps(child(client, op, int(size), json.loads(opts), bucket, key)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256M,1G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="one round of 40 MiB: a check that it runs")
    ap.add_argument("--name", default=None, help="result files' name (default object_clients)")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in ("40M" if args.quick else args.sizes).split(",")]
    rounds = 1 if args.quick else args.rounds
    wanted = args.clients.split(",")
    clients = [c for c in wanted if installed(c)]
    doc: dict[str, Any] = {
        "command": command_line(__file__, argv),
        "machine": machine_state(),
        "versions": client_versions(),
        "sizes": sizes,
        "rounds": rounds,
        "clients": clients,
        "missing": [c for c in wanted if c not in clients],
    }
    doc.update(measure(sizes, rounds, clients))
    name = args.name or ("object_clients-quick" if args.quick else "object_clients")
    write_json(os.path.join(args.out, name + ".json"), doc, echo=False)
    md = markdown(doc)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main(sys.argv[1:])

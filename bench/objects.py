"""Checkpoints on an object store (issue 24's numbers): ckptfmt's s3:// save and load against
its peers and against the raw client, on one local S3 server, fresh processes, interleaved
rounds, medians.

The bench starts moto's S3 server (tests/s3_server.py) on 127.0.0.1 for the run.  Rows:

* ckptfmt: `ckptfmt.save(state, "s3://...")` and `ckptfmt.load(...)`, default storage options
* s3torchconnector: `S3Checkpoint(region, endpoint=...)` (CRT client, path-style addressing),
  `torch.save` into its writer and `torch.load(weights_only=True)` from its reader.  Its save
  cannot complete against moto (see `S3TORCH_SAVE_BLOCKED`): its load reads a torch file the
  parent uploads with boto3
* dcp-s3fs: torch.distributed.checkpoint's FsspecWriter / FsspecReader over s3fs (default
  writer options), one process with `no_dist=True`; the load fills a preallocated state in
  place, as DCP does
* floor: bench/object_clients.py's best raw client (boto3 with explicit parallel multipart and
  ranged readinto) moving as many bytes as the state's tensors hold, in the same rounds

The state is training-like: bf16 weights of mixed shapes (attention, MLP, norms, biases) and an
optimizer dict (fp32 master weights, two fp32 moments, a step per parameter, param groups).
Each measurement is one fresh process; the state (or a load's destination) is built before the
clock starts, peak RSS is the process's high-water mark restarted then (`extra`: its rise over
the RSS at the start).  Every load is checked against the saved state's digest after the clock
stops.  The server's request log gives each row's requests (GETs, PUTs, ...): moto reads the
whole object for every GET, ranged or not, so a load's GET count times the object size is the
copying the server itself does.  A peer that is not installed is reported missing.

    python bench/objects.py [--size 1G] [--rounds 3] [--out bench/results] [--name objects] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
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
    walk_tensors,
    write_json,
)
from object_clients import download, payload, prepare, server_peak_rss, upload  # noqa: E402
from object_clients import summary as client_summary  # noqa: E402

TOOLS = ["ckptfmt", "s3torchconnector", "dcp-s3fs", "floor"]
MODULES = {
    "ckptfmt": "ckptfmt",
    "s3torchconnector": "s3torchconnector",
    "dcp-s3fs": "s3fs",
    "floor": "boto3",
}
PEERS = ["s3torchconnector", "dcp-s3fs"]
FLOOR_CLIENT = "boto3-parallel"
S3TORCH_SAVE_BLOCKED = (
    "s3torchconnector's save fails against moto 5.2.1 with `S3Exception: Internal S3 client error: "
    'Header "ETag" not found`: its CRT client always writes by multipart upload and takes the '
    "object's ETag from the CompleteMultipartUpload response body at the path "
    "CompleteMultipartUploadResult/ETag (AWS's element name); moto answers with a root element "
    "named CompleteMultipartUploadResponse, so the CRT finds no ETag and the mountpoint client "
    "fails the upload after every part and the completion succeeded (plain HTTP itself works: "
    "the parts, the completion and its reads go through)"
)

# -- the state ---------------------------------------------------------------------------------


def layer_shapes(d: int) -> list[tuple[int, ...]]:
    """One transformer block's parameters: norms, attention, MLP, with biases."""
    return [
        (d,),
        (d,),
        (3 * d, d),
        (3 * d,),
        (d, d),
        (d,),
        (d,),
        (d,),
        (4 * d, d),
        (4 * d,),
        (d, 4 * d),
        (d,),
    ]


def state_shapes(size: int) -> list[tuple[int, ...]]:
    """Parameter shapes whose weights (bf16) and optimizer state (three fp32 tensors each) fill
    about `size` bytes: an embedding, blocks of a width fitted to the size, a head."""
    per_param = 2 + 3 * 4
    params = max(size // per_param, 4096)
    d = 64
    while 12 * (2 * d) ** 2 * 4 <= params and d < 2048:
        d *= 2
    vocab = max(256, params // (8 * d))
    fixed = 2 * vocab * d
    layers = max(1, (params - fixed) // (12 * d * d + 13 * d))
    return [(vocab, d)] + [s for _ in range(layers) for s in layer_shapes(d)] + [(d,), (vocab, d)]


def build_state(size: int, seed: int = 0) -> dict[str, Any]:
    """The training-like state of about `size` bytes, the same for the same size and seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shapes = state_shapes(size)
    names = ["embed.weight"] + [f"blocks.{(i - 1) // 12}.p{(i - 1) % 12}" for i in range(1, len(shapes) - 2)]
    names += ["norm.weight", "head.weight"]
    model, opt_state = {}, {}
    for i, (name, shape) in enumerate(zip(names, shapes)):
        master = torch.randn(shape, generator=gen) * 0.02
        model[name] = master.to(torch.bfloat16)
        opt_state[i] = {
            "step": torch.tensor(float(7)),
            "master": master,
            "exp_avg": torch.randn(shape, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=gen) * 1e-6,
        }
    groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "params": list(range(len(shapes))),
        }
    ]
    return {"model": model, "optim": {"state": opt_state, "param_groups": groups}, "step": 7, "epoch": 0}


def state_bytes(size: int) -> int:
    """Bytes of the tensors of build_state(size), from its shapes alone: per parameter, bf16
    weights, three fp32 tensors and a 4-byte step."""
    import math

    return sum(math.prod(s) * (2 + 3 * 4) + 4 for s in state_shapes(size))


def digest(state: Any) -> str:
    """blake2b over every tensor's bytes, in order, and the plain values beside them."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    for t in walk_tensors(state):
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr((state["step"], state["epoch"], state["optim"]["param_groups"])).encode())
    return h.hexdigest()


# -- the tools (run in the child) --------------------------------------------------------------


def s3torch_checkpoint(opts: dict[str, str]) -> Any:
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    os.environ.update(
        AWS_ACCESS_KEY_ID=opts["aws_access_key_id"], AWS_SECRET_ACCESS_KEY=opts["aws_secret_access_key"]
    )
    return S3Checkpoint(
        opts["region"], endpoint=opts["endpoint_url"], s3client_config=S3ClientConfig(force_path_style=True)
    )


def fsspec_options(opts: dict[str, str]) -> dict[str, Any]:
    return {
        "key": opts["aws_access_key_id"],
        "secret": opts["aws_secret_access_key"],
        "endpoint_url": opts["endpoint_url"],
        "client_kwargs": {"region_name": opts["region"]},
    }


def save(tool: str, state: Any, url: str, opts: dict[str, str], ctx: Any) -> None:
    if tool == "ckptfmt":
        import ckptfmt

        ckptfmt.save(state, url, storage_options=opts)
    elif tool == "s3torchconnector":
        import torch

        with ctx.writer(url) as w:
            torch.save(state, w)
    elif tool == "dcp-s3fs":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(state, storage_writer=FsspecWriter(url, **fsspec_options(opts)), no_dist=True)
    else:
        bucket, key = url.removeprefix("s3://").split("/", 1)
        upload(FLOOR_CLIENT, ctx, bucket, key, state)


def load(tool: str, url: str, opts: dict[str, str], ctx: Any, into: Any) -> Any:
    if tool == "ckptfmt":
        import ckptfmt

        return ckptfmt.load(url, storage_options=opts)
    if tool == "s3torchconnector":
        import torch

        with ctx.reader(url) as r:
            return torch.load(r, weights_only=True)
    if tool == "dcp-s3fs":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(into, storage_reader=FsspecReader(url, **fsspec_options(opts)), no_dist=True)
        return into
    bucket, key = url.removeprefix("s3://").split("/", 1)
    download(FLOOR_CLIENT, ctx, bucket, key, into)
    return into


IMPORTS = {
    "ckptfmt": ["torch", "boto3", "ckptfmt", "ckptfmt.storage.client"],
    "s3torchconnector": ["torch", "s3torchconnector"],
    "dcp-s3fs": [
        "torch",
        "s3fs",
        "torch.distributed.checkpoint",
        "torch.distributed.checkpoint._fsspec_filesystem",
    ],
    "floor": ["boto3"],
}


def context(tool: str, opts: dict[str, str], bucket: str) -> Any:
    """The client object a tool reuses, built before the clock starts, and the modules it uses
    imported (a client made inside the call, as ckptfmt's and s3fs's are, stays on the clock)."""
    import importlib

    for name in IMPORTS[tool]:
        importlib.import_module(name)
    if tool == "s3torchconnector":
        return s3torch_checkpoint(opts)
    if tool == "floor":
        return prepare(FLOOR_CLIENT, opts, bucket)
    return None


def child(tool: str, op: str, size: int, opts: dict[str, str], url: str) -> dict[str, Any]:
    """One measurement: build what the clock must not see, then save or load once."""
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    ctx = context(tool, opts, bucket)
    state: Any = None
    into: Any = None
    if tool == "floor":
        state = payload(size) if op == "save" else None  # size: the state's tensor bytes
        if op == "load":
            into = bytearray(size)
            into[:] = b"\1" * size  # resident before the clock starts
    elif op == "save" or tool == "dcp-s3fs":
        state = build_state(size)
        if op == "load":  # DCP loads in place: the destination exists before the clock starts
            from common import empty_like_state

            into, state = empty_like_state(state), None
    reset_peak_rss()
    base = status_bytes("VmRSS")
    t = time.perf_counter()
    if op == "save":
        save(tool, state, url, opts, ctx)
        got = None
    else:
        got = load(tool, url, opts, ctx, into)
    took = time.perf_counter() - t
    peak = status_bytes("VmHWM")
    out = {"seconds": took, "peak_rss": peak, "extra_rss": max(0, peak - base)}
    if tool == "floor":
        out["digest"] = hashlib.blake2b(state if op == "save" else got, digest_size=16).hexdigest()
    else:
        out["digest"] = digest(state if op == "save" else got)
    return out


def put_torch_file(size: int, opts: dict[str, str], url: str) -> dict[str, Any]:
    """The torch file s3torchconnector's load reads, written by torch.save and uploaded with boto3
    (its own writer cannot complete against moto: S3TORCH_SAVE_BLOCKED)."""
    import io

    import torch

    state = build_state(size)
    buf = io.BytesIO()
    torch.save(state, buf)
    bucket, key = url.removeprefix("s3://").split("/", 1)
    upload(FLOOR_CLIENT, prepare(FLOOR_CLIENT, opts, bucket), bucket, key, buf.getbuffer())
    return {"digest": digest(state), "object_bytes": buf.tell()}


# -- the parent --------------------------------------------------------------------------------


def installed(tool: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(MODULES[tool]) is not None


def run_child(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


REQUEST = re.compile(rb'"(GET|PUT|POST|HEAD|DELETE) ')


class RequestLog:
    """The server's request log, read from where the last call left off: requests by method."""

    def __init__(self, server: Any) -> None:
        self.fd = server._log.fileno()
        self.pos = os.fstat(self.fd).st_size

    def since_last(self) -> dict[str, int]:
        end = os.fstat(self.fd).st_size
        text = os.pread(self.fd, end - self.pos, self.pos)  # pread: the server's offset is shared
        self.pos = end
        return dict(Counter(m.decode() for m in REQUEST.findall(text)))


def object_bytes(s3: Any, bucket: str, prefix: str) -> int:
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sum(o["Size"] for o in listed)


def delete_prefix(s3: Any, bucket: str, prefix: str) -> None:
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        s3.delete_object(Bucket=bucket, Key=o["Key"])


def loadable(tool: str) -> str:
    return {
        "ckptfmt": "src.ckpt",
        "s3torchconnector": "src.pt",
        "dcp-s3fs": "src-dcp",
        "floor": "src.bin",
    }[tool]


def prepare_sources(tools: list[str], size: int, opts: dict[str, str], bucket: str) -> dict[str, Any]:
    """The objects every load reads (saved once, untimed), and the digest each load must match."""
    want: dict[str, Any] = {}
    for tool in tools:
        url = f"s3://{bucket}/{loadable(tool)}"
        op = "put-torch" if tool == "s3torchconnector" else "save"
        arg = state_bytes(size) if tool == "floor" else size
        want[tool] = run_child(tool, op, str(arg), json.dumps(opts), url)["digest"]
    return want


def measure(size: int, rounds: int, tools: list[str]) -> dict[str, Any]:
    from s3_server import S3Server

    samples: dict[str, list[dict[str, Any]]] = {}
    with S3Server() as server:
        opts = server.storage_options()
        bucket = server.new_bucket()
        s3 = server.client()
        want = prepare_sources(tools, size, opts, bucket)
        sizes = {t: object_bytes(s3, bucket, loadable(t)) for t in tools}
        nbytes = state_bytes(size)
        log = RequestLog(server)
        for r in range(rounds):
            for tool in rotated(tools, r):
                ops = ["save", "load"] if r % 2 == 0 else ["load", "save"]
                for op in ops:
                    if op == "save" and tool == "s3torchconnector":
                        continue
                    key = (
                        loadable(tool)
                        if op == "load"
                        else f"{tool}-save-{r}" + ("" if tool == "dcp-s3fs" else ".obj")
                    )
                    arg = str(nbytes if tool == "floor" else size)
                    got = run_child(tool, op, arg, json.dumps(opts), f"s3://{bucket}/{key}")
                    got["requests"] = log.since_last()
                    if got["digest"] != want[tool]:
                        raise RuntimeError(f"{tool} {op}: other bytes than the first save's")
                    if op == "save":
                        got["object_bytes"] = object_bytes(s3, bucket, key)
                        delete_prefix(s3, bucket, key)
                        log.since_last()
                    samples.setdefault(f"{tool}/{op}", []).append(got)
                    print(
                        f"round {r + 1}/{rounds} {tool:17s} {op:4s} {got['seconds']:.3f} s {got['requests']}",
                        flush=True,
                    )
        server_rss = server_peak_rss(server)
    return {
        "tensor_bytes": nbytes,
        "object_bytes": sizes,
        "rows": {k: summary(v, nbytes) for k, v in samples.items()},
        "server_peak_rss": server_rss,
    }


def summary(samples: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """object_clients' summary of a row (seconds, GB/s, peak RSS), and the requests it made."""
    return {**client_summary(samples, f"row/{nbytes}"), "requests": samples[-1]["requests"]}


def ratios(rows: dict[str, Any], tools: list[str]) -> dict[str, Any]:
    """ckptfmt against each peer and the floor, op by op: the other's median seconds over
    ckptfmt's (above 1: ckptfmt is faster); for the floor, the floor's seconds over ckptfmt's
    (the share of the floor's speed ckptfmt reaches)."""
    out: dict[str, Any] = {}
    for op in ("save", "load"):
        ours = rows.get(f"ckptfmt/{op}")
        if ours is None:
            continue
        for other in tools:
            theirs = rows.get(f"{other}/{op}")
            if other != "ckptfmt" and theirs is not None:
                out[f"{op}/{other}"] = theirs["seconds"]["median"] / ours["seconds"]["median"]
    return out


# -- the report --------------------------------------------------------------------------------


def markdown(doc: dict[str, Any]) -> str:
    st = doc["machine"]
    gib = 2**30
    lines = [
        f"# Checkpoints on an object store (bench/objects.py), {time.strftime('%Y-%m-%d')}",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"State: {doc['tensor_bytes'] / gib:.2f} GiB of tensors ({doc['tensors']} tensors, bf16 weights and an"
        f" fp32 optimizer dict); {doc['rounds']} round(s), medians.",
        f"Machine: {st['cores']} cores ({st['cpu']}), load average at the start {st['loadavg'].split()[:3]},"
        f" at the end {doc['machine_after']['loadavg'].split()[:3]}; server: moto"
        f" {doc['versions'].get('moto')} on 127.0.0.1 (its peak RSS {doc['server_peak_rss'] / gib:.2f} GiB).",
        f"Versions: {', '.join(f'{k} {v}' for k, v in doc['versions'].items())}.",
        f"Missing (not measured): {', '.join(doc['missing']) or 'none'}.",
        "",
        "| tool | op | seconds (min-max) | GB/s | object GiB | requests | peak RSS | extra RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tool in doc["tools"]:
        for op in ("save", "load"):
            row = doc["rows"].get(f"{tool}/{op}")
            if row is None:
                lines.append(f"| {tool} | {op} | not measured | | | | | |")
                continue
            s = row["seconds"]
            reqs = ", ".join(f"{k} {v}" for k, v in sorted(row["requests"].items()))
            lines.append(
                f"| {tool} | {op} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {row['gbps']:.3f} | "
                f"{doc['object_bytes'][tool] / gib:.2f} | {reqs} | {row['peak_rss'] / 2**20:.0f} MiB | "
                f"{row['extra_rss'] / 2**20:.0f} MiB |"
            )
    lines += ["", "| ckptfmt against | ratio (other's seconds / ckptfmt's) |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in doc["ratios"].items()]
    if "s3torchconnector" in doc["tools"]:
        lines += ["", f"s3torchconnector save: not measured. {S3TORCH_SAVE_BLOCKED}."]
    return "\n".join(lines) + "\n"


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("ckptfmt", "torch", "moto", "boto3", "s3torchconnector", "s3torchconnectorclient", "s3fs"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        tool, op, size, opts, url = argv[1:6]
        if op == "put-torch":
            print(json.dumps(put_torch_file(int(size), json.loads(opts), url)))
        else:
            print(json.dumps(child(tool, op, int(size), json.loads(opts), url)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="one round of a 24 MiB state: a check that it runs")
    ap.add_argument("--name", default=None, help="result files' name (default objects)")
    args = ap.parse_args(argv)
    size = parse_size("24M" if args.quick else args.size)
    rounds = 1 if args.quick else args.rounds
    wanted = args.tools.split(",")
    tools = [t for t in wanted if installed(t)]
    doc: dict[str, Any] = {
        "command": command_line(__file__, argv),
        "machine": machine_state(),
        "versions": tool_versions(),
        "size": size,
        "rounds": rounds,
        "tools": tools,
        "missing": [t for t in wanted if t not in tools],
        "tensors": len(state_shapes(size)) * 5,
        "s3torchconnector_save": S3TORCH_SAVE_BLOCKED,
    }
    doc.update(measure(size, rounds, tools))
    doc["machine_after"] = machine_state()
    doc["ratios"] = ratios(doc["rows"], tools)
    name = args.name or ("objects-quick" if args.quick else "objects")
    write_json(os.path.join(args.out, name + ".json"), doc, echo=False)
    md = markdown(doc)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Gets of one object from several threads through one open Reader, on a local moto server:
the same gets under two source trees (`--trees A,B`: each a checkout whose `ckptfmt` is
imported), each run in a fresh process, the trees alternated round by round.

With `--latency S`, every GET of the object passes a proxy (tests/s3_faults.py) that holds it
S seconds before forwarding it: the first-byte latency of a real store, which a local moto
server lacks (there, one process serving every request bounds any client).

With `--incremental N`, the object read is the last of N chained incremental objects (each
saved against the one before it), its keys' bytes spread over all N: key i lies in object
i mod N, read through the reader's referenced objects.

Two patterns: `overlap` (every thread gets every key, each in an order of its own) and
`disjoint` (each thread gets its share of the keys).  Each run prints the clock time of the
gets (from the threads' start to the last one's end) and the CPU time the process spent in
them; the driver prints each tree's medians and the load average before and after.

    python bench/concurrent_gets.py --trees /tmp/base,. --threads 4 --rounds 5 --latency 0.03
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args: argparse.Namespace) -> None:
    """One measured run: open the object, get its keys from `threads` threads, print the times."""
    from concurrent.futures import ThreadPoolExecutor

    import ckptfmt

    options = json.loads(args.options)
    with ckptfmt.open(args.url, storage_options=options) as r:
        keys = list(r.keys())
        rng = random.Random(0)
        if args.pattern == "overlap":
            plans = [rng.sample(keys, len(keys)) for _ in range(args.threads)]
        else:
            plans = [keys[t :: args.threads] for t in range(args.threads)]

        def read(plan: list[str]) -> int:
            return sum(r.get(k).nbytes for k in plan)

        cpu, clock = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            got = sum(pool.map(read, plans))
        clock, cpu = time.perf_counter() - clock, time.process_time() - cpu
    print(json.dumps({"clock": clock, "cpu": cpu, "bytes": got, "ckptfmt": ckptfmt.__file__}))


def _saved(bucket: str, options: dict[str, object], args: argparse.Namespace) -> str:
    """The object the gets read, saved: one, or the last of a chain (--incremental)."""
    import torch

    import ckptfmt
    from ckptfmt.files import incremental

    g = torch.Generator().manual_seed(0)
    n = (args.size << 20) // 4 // args.keys
    state = {f"k{i:02d}": torch.randn(n, generator=g) for i in range(args.keys)}
    if args.incremental < 2:
        url = f"s3://{bucket}/concurrent.ckpt"
        ckptfmt.save(state, url, storage_options=options)
        return url
    base = None
    for step in range(args.incremental):
        state = {k: t + 1 if i % args.incremental == step else t for i, (k, t) in enumerate(state.items())}
        url = f"s3://{bucket}/f{step}/concurrent.ckpt"
        incremental.save(state, url, base=base, min_reference_bytes=1024, storage_options=options)
        base = url
    return url


def driver(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import contextlib

    from s3_faults import FaultProxy
    from s3_server import S3Server

    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    with S3Server() as server, contextlib.ExitStack() as stack:
        endpoint = server
        if args.latency:
            endpoint = stack.enter_context(FaultProxy(server.endpoint_url))
            endpoint.delay("GET", "concurrent.ckpt", seconds=args.latency)
        options = endpoint.storage_options() | {"request_size": args.request_size << 20}
        url = _saved(server.new_bucket(), options, args)
        print(f"loadavg before: {open('/proc/loadavg').read().split()[:3]}")
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for rnd in range(args.rounds):
            for pattern in args.patterns.split(","):
                order = trees if rnd % 2 == 0 else list(reversed(trees))
                for tree in order:
                    env = os.environ | {"PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1"}
                    cmd = [
                        sys.executable,
                        __file__,
                        "--child",
                        "--url",
                        url,
                        "--options",
                        json.dumps(options),
                    ]
                    cmd += ["--threads", str(args.threads), "--pattern", pattern]
                    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
                    if out.returncode:
                        raise SystemExit(f"{tree} {pattern}: {out.stderr[-2000:]}")
                    run = json.loads(out.stdout.strip().splitlines()[-1])
                    assert run["ckptfmt"].startswith(tree), run["ckptfmt"]
                    results.setdefault((tree, pattern), []).append(run)
        print(f"loadavg after: {open('/proc/loadavg').read().split()[:3]}")
    mib = 1 << 20
    for (tree, pattern), runs in results.items():
        clock = statistics.median(r["clock"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        print(
            f"{tree:40s} {pattern:8s} {args.threads} threads: clock {clock:.3f} s "
            f"({runs[0]['bytes'] / mib / clock:.0f} MiB/s), CPU {cpu:.3f} s; "
            f"rounds {[round(r['clock'], 3) for r in runs]}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", default=".")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=64, help="MiB of the object's tensors")
    p.add_argument("--keys", type=int, default=8)
    p.add_argument("--incremental", type=int, default=0, help="chained incremental objects the keys lie in")
    p.add_argument("--request-size", type=int, default=4, help="MiB per request")
    p.add_argument("--patterns", default="overlap,disjoint")
    p.add_argument("--latency", type=float, default=0.0, help="seconds each GET is held")
    p.add_argument("--child", action="store_true")
    p.add_argument("--url")
    p.add_argument("--options")
    p.add_argument("--pattern", default="overlap")
    args = p.parse_args()
    child(args) if args.child else driver(args)


if __name__ == "__main__":
    main()

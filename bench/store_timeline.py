"""Where a load from a store spends its time, request by request, beside the floor's.

For each store (emulator on 127.0.0.1) and round: one `ckptfmt.load` of a state and one floor
download (bench/stores.py's floor_down) of an object of the same length, each request timed
relative to the start of its load: when it was sent, when its answer's head came, when its
first and last body bytes were read; and for the load, when the chunk reader first claimed a
request (the index parsed, the tensors allocated), when the chunks read straight into them
were checked (the first and last check, and the seconds all checks took: each runs on the
thread that read a request's last bytes) and when the load returned.  Each run also gives its
CPU seconds (this process's), the emulator's (stores.server_cpu) and this process's minor
page faults (every large block a fresh mapping, as in bench/stores.py).  The two alternate as bench/stores.py's rows do: the floor first in odd rounds.
The requests are timed by wrapping the shared Store's `head` and `get` and each answer's body
(this process only; the requests themselves are unchanged).  Medians over rounds of each phase.

    python bench/store_timeline.py [--size 64M] [--rounds 5] [--stores s3,az] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import stores  # noqa: E402
from common import command_line, machine_state, parse_size, write_json  # noqa: E402


class Clock:
    """The requests of one timed operation, relative to its start."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.marks: dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self, name: str) -> None:
        with self.lock:
            self.marks.setdefault(name, self.now())

    def add(self, name: str, seconds: float) -> None:
        """Sum `seconds` into the mark `name` (a total, not a moment)."""
        with self.lock:
            self.marks[name] = self.marks.get(name, 0.0) + seconds

    def record(self, what: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"what": what, "sent": self.now()}
        with self.lock:
            self.requests.append(rec)
        return rec


CLOCK: list[Clock] = []


class TimedBody:
    """An answer's body whose first and last reads are timed."""

    def __init__(self, body: Any, rec: dict[str, Any], clock: Clock) -> None:
        self._body = body
        self._rec = rec
        self._clock = clock
        self._raw_stream = getattr(body, "_raw_stream", body)

    def readinto(self, view: Any) -> int:
        self._rec.setdefault("asked", self._clock.now())
        n = self._body.readinto(view)
        now = self._clock.now()
        self._rec.setdefault("first", now)
        if n:
            self._rec["last"] = now
            self._rec["bytes"] = self._rec.get("bytes", 0) + n
        return n

    def close(self) -> None:
        self._body.close()


def instrument(store: Any) -> None:
    """Time every head and get of the shared `store` against the current Clock."""
    if getattr(store, "_timed", False):
        return
    head, get = store.head, store.get

    def timed_head(url: Any) -> Any:
        rec = CLOCK[-1].record("HEAD")
        out = head(url)
        rec["head"] = CLOCK[-1].now()
        return out

    def timed_get(url: Any, byte_range: Any, version: Any) -> Any:
        clock = CLOCK[-1]
        rec = clock.record(f"GET {byte_range[0]}-{byte_range[1]}" if byte_range else "GET")
        rec["range"] = byte_range
        reply = get(url, byte_range, version)
        rec["head"] = clock.now()
        return type(reply)(
            reply.length, reply.content_range, reply.version, TimedBody(reply.body, rec, clock)
        )

    store.head, store.get, store._timed = timed_head, timed_get, True


def mark_claims() -> None:
    """The first start_into of a load marks when the index was parsed and the tensors made."""
    from ckptfmt.storage import download

    start_into = download.RemoteObject.start_into

    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        CLOCK[-1].mark("claimed")
        return start_into(self, *args, **kwargs)

    download.RemoteObject.start_into = marked  # type: ignore[method-assign]


def mark_checks() -> None:
    """Each check of the chunks a request read straight into the tensors (DirectReads.landed,
    on the fetching thread) marks the first check's start and the last one's end, and adds
    its seconds to the checks' total."""
    from ckptfmt.engine import directread

    landed = directread.DirectReads.landed

    def marked(self: Any, request: Any) -> None:
        clock = CLOCK[-1]
        start = clock.now()
        clock.mark("first check")
        try:
            landed(self, request)
        finally:
            end = clock.now()
            with clock.lock:
                clock.marks["last check ended"] = max(clock.marks.get("last check ended", 0.0), end)
            clock.add("checks' seconds", end - start)

    directread.DirectReads.landed = marked  # type: ignore[method-assign]


def summary(clock: Clock, end: float) -> dict[str, float]:
    """The phases of one timed operation (seconds from its start)."""
    gets = [r for r in clock.requests if r["what"].startswith("GET")]
    heads = [r for r in clock.requests if r["what"] == "HEAD"]
    out: dict[str, float] = {"end": end, "requests": len(clock.requests)}
    if heads:
        out["HEAD answered"] = heads[0]["head"]
    if gets:
        out["first GET sent"] = min(r["sent"] for r in gets)
        out["first answer head"] = min(r["head"] for r in gets)
        out["first body byte read"] = min(r.get("first", end) for r in gets)
        out["last GET sent"] = max(r["sent"] for r in gets)
        out["last body byte"] = max(r.get("last", 0.0) for r in gets)
        size = max(r["range"][1] for r in gets if r["range"])
        for r in gets:
            if r["range"] and r["range"][0] == 0:
                out["first cell's head"] = r["head"]
            if r["range"] and r["range"][1] == size:
                out["last range's head"] = r["head"]
        out["most GETs in flight"] = most_in_flight(gets, end)
    out.update(clock.marks)
    return out


def most_in_flight(gets: list[dict[str, Any]], end: float) -> int:
    """The most GETs at once between being sent and their last body byte read."""
    events = sorted([(r["sent"], 1) for r in gets] + [(r.get("last", end), -1) for r in gets])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def one_round(
    url: str, raw: str, options: dict[str, Any], server: Any, n: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    import ckptfmt

    runs = {}
    for name in ("load", "floor") if n % 2 == 0 else ("floor", "load"):
        gc.collect()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        server_start, cpu_start = server(), time.process_time()
        CLOCK.append(Clock())
        if name == "load":
            out = ckptfmt.load(url, storage_options=options)
        else:
            out = stores.floor_down(raw, options)
        end = CLOCK[-1].now()
        phases = summary(CLOCK[-1], end)
        phases["CPU"] = time.process_time() - cpu_start
        phases["server CPU"] = server() - server_start
        phases["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        runs[name] = {"phases": phases, "requests": CLOCK[-1].requests}
        del out
    return runs["load"], runs["floor"]


def measure(store: str, size: int, rounds: int) -> dict[str, Any]:
    import ckptfmt
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.download import head
    from ckptfmt.storage.urls import parse_url

    state = stores.the_state(size)
    results: dict[str, list[Any]] = {"load": [], "floor": []}
    with stores.served(store) as (prefix, options, server):
        url, raw = f"{prefix}/state.ckpt", f"{prefix}/raw.bin"
        ckptfmt.save(state, url, storage_options=options)
        length = head(parse_url(url), options)[0]
        stores.floor_up(raw, options, memoryview(os.urandom(length)))
        instrument(store_for(parse_url(url), options))
        for n in range(rounds + 1):  # the first round warms the clients up, left out
            load, floor = one_round(url, raw, options, server, n)
            results["load"].append(load)
            results["floor"].append(floor)
    for k in results:
        results[k] = results[k][1:]
    return {"bytes": length, "rounds": results, "medians": medians(results)}


def medians(results: dict[str, list[Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, runs in results.items():
        keys = sorted(
            {k for r in runs for k in r["phases"]},
            key=lambda k: statistics.median(r["phases"].get(k, 0.0) for r in runs),
        )
        out[name] = {k: statistics.median(r["phases"][k] for r in runs if k in r["phases"]) for k in keys}
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stores", default="s3,az")
    p.add_argument("--out", default=None)
    p.add_argument("--reuse-memory", action="store_true", help="as bench/stores.py's")
    args = p.parse_args(argv)
    if not args.reuse_memory:
        stores.fresh_memory()
    mark_claims()
    mark_checks()
    doc: dict[str, Any] = {"command": command_line(__file__, argv), "machine": machine_state(), "stores": {}}
    for store in args.stores.split(","):
        why = stores.missing(store)
        doc["stores"][store] = {"missing": why} if why else measure(store, parse_size(args.size), args.rounds)
        for name, phases in doc["stores"][store].get("medians", {}).items():
            print(
                f"{store} {name}: "
                + ", ".join(
                    f"{k} {v:g}"
                    if k in ("requests", "faults", "most GETs in flight")
                    else f"{k} {v * 1000:.1f}"
                    for k, v in phases.items()
                ),
                flush=True,
            )
    if args.out:
        write_json(args.out, doc)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where a save to an object store spends its time, against the floor's upload of the same bytes.

One process, one emulator (bench/stores.py's: moto, fake-gcs-server or Azurite), the store's
client made before the first round.  Each round times `ckptfmt.save(state, URL)` and then
bench/stores.py's floor_up of as many bytes, recording, relative to the start of each, every
request of the store's upload (each part, the commit request: S3's CompleteMultipartUpload,
GCS's compose and the parts' deletes, Azure's block list) when it was sent and when it was
answered, the engine's writes into the spool, the index's, and the spool's close.  The
functions are wrapped to read the clock, nothing else changed.

    python bench/save_timeline.py [--store gs] [--size 64M] [--rounds 4] [--verbose]

Prints one line per round (ms): `written` (the last chunk in the spool), `first` and `last`
(when the first and the last part of a full part's size were sent), `parts_done` (the last
part answered), `commit` (the commit request, composes and deletes included), `compose`,
`deletes` (first sent to last answered), `close`, and the process's CPU; --verbose adds every
event.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import stores  # noqa: E402
from common import parse_size  # noqa: E402

#: (sent, answered, thread, what, detail), seconds from the round's start
EVENTS: list[tuple[float, float, str, str, str]] = []
START = [0.0]


def _timed(what: str, call: Callable[..., Any], detail: Callable[..., str] = lambda *a: "") -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            ended = time.perf_counter()
            name = threading.current_thread().name[-12:]
            EVENTS.append((began - START[0], ended - START[0], name, what, detail(*args)))

    return timed


def _part_detail(store: Any, url: Any, upload_id: str, number: int, body: memoryview) -> str:
    return f"part {number}, {len(body) >> 10} KiB"


def instrument() -> None:
    """Wrap the upload's requests and the save's phases to record when each began and ended."""
    import ckptfmt.engine.chunkwrite as chunkwrite
    import ckptfmt.files.save as files_save
    from ckptfmt.storage import azure, gcs, s3, upload

    for cls in (s3.S3Store, gcs.GCSStore, azure.AzureStore):
        cls.put_part = _timed("put_part", cls.put_part, _part_detail)  # type: ignore[method-assign]
        for name in ("put", "start_upload", "complete_upload"):
            setattr(cls, name, _timed(name, getattr(cls, name)))
    gcs.GCSStore._compose = _timed("compose", gcs.GCSStore._compose)  # type: ignore[method-assign]
    gcs.GCSStore._delete = _timed("delete", gcs.GCSStore._delete)  # type: ignore[method-assign]
    chunkwrite._native.write_chunks = _timed(
        "engine write",
        chunkwrite._native.write_chunks,
        lambda *a: f"{sum(len(p[0]) for p in a[4]) >> 20} MiB",
    )
    chunkwrite.finish_file = _timed("index, footer, prologue", chunkwrite.finish_file)
    files_save.encode = _timed("encode", files_save.encode)
    upload.ObjectFile.close = _timed("close", upload.ObjectFile.close)  # type: ignore[method-assign]


def summary() -> dict[str, float]:
    """The round's landmarks, in ms (see the module's docstring)."""

    def of(what: str) -> list[tuple[float, float, str, str, str]]:
        return [e for e in EVENTS if e[3] == what]

    full = [e for e in of("put_part") if e[4].endswith(f"{stores.PART >> 10} KiB")]
    spans = {
        "written": max((e[1] for e in of("engine write")), default=0.0),
        "first": min(e[0] for e in full),
        "last": max(e[0] for e in full),
        "parts_done": max(e[1] for e in of("put_part")),
        "commit": sum(e[1] - e[0] for e in of("complete_upload")),
        "compose": sum(e[1] - e[0] for e in of("compose")),
        "deletes": max((e[1] for e in of("delete")), default=0.0)
        - min((e[0] for e in of("delete")), default=0.0),
        "close": sum(e[1] - e[0] for e in of("close")),
    }
    return {k: v * 1000 for k, v in spans.items()}


def clocked(title: str, verbose: bool, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`call(*args, **kwargs)` timed, its line printed."""
    EVENTS.clear()
    START[0], cpu = time.perf_counter(), time.process_time()
    call(*args, **kwargs)
    wall, cpu = time.perf_counter() - START[0], time.process_time() - cpu
    marks = " ".join(f"{k} {v:.0f}" for k, v in summary().items())
    print(f"{title}: {wall * 1000:.0f} ms, CPU {cpu * 1000:.0f} ms | {marks}", flush=True)
    if verbose:
        for sent, answered, thread, what, detail in sorted(EVENTS):
            print(f"  {sent * 1000:8.1f} {answered * 1000:8.1f}  {thread:12s} {what:24s} {detail}")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", default="gs", choices=stores.STORES)
    p.add_argument("--size", default="64M")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    import ckptfmt
    from ckptfmt.storage.backends import store_for
    from ckptfmt.storage.download import head
    from ckptfmt.storage.urls import parse_url

    instrument()
    state = stores.the_state(parse_size(args.size))
    with stores.served(args.store) as (prefix, options):
        store_for(parse_url(f"{prefix}/state.ckpt"), options)
        for n in range(args.rounds):
            url, raw = f"{prefix}/state-{n}.ckpt", f"{prefix}/raw-{n}.bin"
            clocked(
                f"save  {args.store} round {n}",
                args.verbose,
                ckptfmt.save,
                state,
                url,
                storage_options=options,
            )
            data = memoryview(os.urandom(head(parse_url(url), options)[0]))
            clocked(f"floor {args.store} round {n}", args.verbose, stores.floor_up, raw, options, data)


if __name__ == "__main__":
    main(sys.argv[1:])

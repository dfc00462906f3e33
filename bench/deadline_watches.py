"""What the deadline watches of one ranged GET cost: a request sets two (its answer's head,
http.HeadWatch; then its body, client.Watchdog) and almost never lets one fire.  Wall-clock
and CPU microseconds per request for entering and leaving both, on 1 thread and on 8 at once
(as a load's fetch threads run), medians of 5 runs; and the threads left a second later.

    python bench/deadline_watches.py [--requests 4000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ckptfmt.storage import client, http


class _Answer:
    """What a body's watchdog would cut (never, here: the deadlines are a minute away)."""

    def close(self) -> None:
        pass


def one_request(_: int) -> None:
    with http.HeadWatch(60.0):
        pass
    with client.Watchdog(_Answer(), 60.0):
        pass


def per_request(threads: int, n: int) -> tuple[float, float]:
    """Wall-clock and CPU microseconds per request, `n` requests on `threads` threads."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one_request, range(50)))  # the threads started before the clock
        start, start_cpu = time.perf_counter(), time.process_time()
        list(pool.map(one_request, range(n)))
        return (time.perf_counter() - start) / n * 1e6, (time.process_time() - start_cpu) / n * 1e6


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000)
    n = p.parse_args(argv).requests
    for threads in (1, 8):
        walls, cpus = zip(*(per_request(threads, n) for _ in range(5)))
        print(
            f"{threads} thread(s): {statistics.median(walls):.1f} us wall, "
            f"{statistics.median(cpus):.1f} us CPU per request (medians of 5 x {n})"
        )
    time.sleep(1.0)
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print(f"threads left a second later: {left}")


if __name__ == "__main__":
    main(sys.argv[1:])

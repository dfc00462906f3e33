"""Helper for test_crash: forks savers on request so each kill costs no torch import.

stdin: one integer per line (which state the worker starts with); for each, it
forks a worker that saves states A and B alternately to PATH forever, prints
the worker's pid, waits for the worker to be killed, and prints "reaped".
"""

import os
import sys

import torch

import ckptfmt


def make_states():
    g = torch.Generator().manual_seed(11)
    out = []
    for tag in range(2):
        out.append(
            {
                "tag": tag,
                "model": {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(8)},
                "step": torch.tensor(float(tag)),
            }
        )
    return out


def main() -> None:
    torch.set_num_threads(1)
    path = sys.argv[1]
    states = make_states()
    for line in sys.stdin:
        first = int(line)
        pid = os.fork()
        if pid == 0:
            i = first
            while True:
                ckptfmt.save(
                    states[i % 2], path, compression="zstd" if i % 3 == 0 else None, chunk_size=1 << 16
                )
                i += 1
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


if __name__ == "__main__":
    main()

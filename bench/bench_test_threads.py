"""Why the test suite gives each pytest-xdist worker ``cores // workers`` torch threads
(``tests/conftest.py``): the same matmul work run by ``--workers`` processes at once, each with
``cores // workers`` threads against each with every core's thread (oversubscribed), in alternating
rounds on this machine. Prints one JSON object: seconds per configuration (best of the rounds) and
their ratio.

    python bench/bench_test_threads.py [--workers 2] [--rounds 3] [--iters 40]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

WORK = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(512, 576), torch.randn(576, 1536)  # SmolLM2's MLP shape
head, x = torch.nn.Linear(576, 49152, bias=False), torch.randn(256, 576)  # and its LM head
with torch.no_grad():
    for _ in range(int(sys.argv[2])):
        (a @ b).sum()
        head(x).sum()
"""


def run_group(workers: int, threads: int, iters: int) -> float:
    """Seconds until all ``workers`` processes of ``threads`` threads each have done ``iters``."""
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORK, str(threads), str(iters)]) for _ in range(workers)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a worker failed (exit {p.returncode})")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    shared = max(1, cores // a.workers)
    times: dict[str, list[float]] = {"shared": [], "oversubscribed": []}
    for _ in range(a.rounds):  # alternating, so a drift of the machine's speed hits both
        times["oversubscribed"].append(run_group(a.workers, cores, a.iters))
        times["shared"].append(run_group(a.workers, shared, a.iters))
    best = {k: min(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "bench": "test_threads",
                "where": f"CPU {platform.machine()}, {cores} cores; torch matmuls, measured, best of {a.rounds} "
                "alternating rounds",
                "workers": a.workers,
                "threads": {"shared": shared, "oversubscribed": cores},
                "seconds": {k: round(v, 2) for k, v in best.items()},
                "samples": {k: [round(x, 2) for x in v] for k, v in times.items()},
                "ratio_shared_to_oversubscribed": round(best["shared"] / best["oversubscribed"], 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

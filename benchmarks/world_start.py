"""How long a world takes to start and finish a trivial collective, per start method.

    python -m benchmarks.world_start [--ranks 1 4] [--repeat 3]

The parent has imported megatron-core first (as the runner does), so fork children inherit it;
spawn children import torch and the harness afresh; forkserver children fork from a server that
preloaded megatron-core once (its first world pays for starting the server; reported apart).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness.run.preload import warm
from harness.run.probes import allreduce_ranks
from harness.run.world import launch


def measure(method: str, ranks: int, repeat: int) -> tuple[float, list[float]]:
    times = []
    with tempfile.TemporaryDirectory(prefix="ckpt-harness-bench-") as d:
        for i in range(repeat + 1):
            start = time.perf_counter()
            launch(allreduce_ranks, 1.0, ranks, Path(d) / f"w{i}", backend="gloo", start_method=method, timeout_s=300)
            times.append(time.perf_counter() - start)
    return times[0], times[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    warm()
    print("| start method | ranks | first world s | later worlds s (median) |\n|---|---:|---:|---:|")
    for method in ("fork", "forkserver", "spawn"):
        for n in args.ranks:
            first, rest = measure(method, n, args.repeat)
            print(f"| {method} | {n} | {first:.2f} | {sorted(rest)[len(rest) // 2]:.2f} |", flush=True)


if __name__ == "__main__":
    main()

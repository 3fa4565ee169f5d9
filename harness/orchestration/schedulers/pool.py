"""The pool scheduler (`--jobs N`): the cases spread over N worker processes forked from this one
(after the imports every case needs, so workers start warm): a case is still a world per phase, run
the same way, and most worlds here are 1-2 ranks that leave a 2-core machine half idle between
phases. Several worlds at once on one machine: gloo worlds from the mp launcher only."""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed

from harness.core.result import CaseResult
from harness.orchestration.schedulers import Scheduler, Settings
from harness.orchestration.schedulers._common import preload, serially, worker_threads, writers_first


class Pool(Scheduler):
    name = "pool"

    def __init__(self, jobs: int):
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        self.jobs = jobs

    def _parallel(self, specs) -> bool:
        return self.jobs > 1 and len(specs) > 1

    def check(self, specs, options) -> None:
        if self._parallel(specs) and (options.dist_backend == "nccl" or options.launcher == "torchrun"):
            raise ValueError("jobs > 1 runs several worlds at once on this machine: gloo worlds from the mp launcher only "
                             f"(got dist backend {options.dist_backend!r}, launcher {options.launcher!r}); on GPUs "
                             "pack cases with --gpus-per-node instead")

    def run(self, specs, options, run_one, on_result=None) -> list[CaseResult]:
        specs = list(specs)
        if not self._parallel(specs):
            return serially(specs, options, run_one, on_result)
        self.check(specs, options)
        preload(specs)
        results: dict[int, CaseResult] = {}
        # fork when this process has one thread (the CLI): the workers inherit the imports above. A caller
        # with threads (pytest-xdist's execnet, an embedding program) gets forkserver workers instead, which
        # import for themselves: a fork taken while another thread holds a lock (stdout, logging) hangs
        # the worker on it. A worker is not a daemon, so its cases can start ranks.
        method = "fork" if threading.active_count() == 1 else "forkserver"
        threads = max(1, (os.cpu_count() or 1) // self.jobs)
        with ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context(method),
                                 initializer=worker_threads, initargs=(threads,)) as pool:
            futures = {pool.submit(run_one, specs[i], options): i for i in writers_first(specs)}
            for done in as_completed(futures):
                i = futures[done]
                results[i] = done.result()
                if on_result:
                    on_result(results[i])
        return [results[i] for i in range(len(specs))]


def make(settings: Settings) -> Pool:
    return Pool(settings.jobs)

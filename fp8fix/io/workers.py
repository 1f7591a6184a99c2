"""Forked worker processes for CPU-bound work split into independent tasks: shards to write,
runs of tensors to verify.

Workers are forked, so they inherit what the parent prepared (open descriptors, the
described checkpoint, the plan) and receive only small task arguments. One shared byte
counter drives the parent's single progress bar. Ctrl-C and SIGTERM are left to the
parent, which reports once and terminates the workers; a worker's exception is re-raised
in the parent. Results come back in task order, so output never depends on scheduling.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from fp8fix.io.progress import Progress

#: Bytes done by all workers, shared with the parent (which draws the one progress bar).
_done: Any = None


def worker_count(jobs: int, tasks: int) -> int:
    """How many processes to use: `jobs`, capped at the task count; 1 where fork is unavailable, and
    in a process that has loaded torch (a Python caller's: the CLI has not at this point). A child
    forked after torch started its OpenMP threads hangs in its first parallel torch operation
    (it did in this suite, in verify's float checks), so such a caller gets one process."""
    if jobs < 2 or tasks < 2 or "torch" in sys.modules:
        return 1
    import multiprocessing  # here, not at the top: a conversion that runs in one process never needs it

    return min(jobs, tasks) if "fork" in multiprocessing.get_all_start_methods() else 1


class SharedProgress:
    """A worker's progress: added to the counter the parent shows."""

    def update(self, n: int) -> None:
        with _done.get_lock():
            _done.value += n


def _init_worker(counter: Any) -> None:
    global _done
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _done = counter


def run_tasks(function: Callable[..., Any], tasks: list[tuple[Any, ...]], workers: int, bar: Progress) -> list[Any]:
    """`function(SharedProgress(), *task)` for every task in `workers` forked processes; the results
    in task order. `function` must be a module-level function (it is sent by name)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    counter = context.Value("q", 0)
    pool = context.Pool(workers, initializer=_init_worker, initargs=(counter,))
    try:
        pending = [pool.apply_async(function, (SharedProgress(), *task)) for task in tasks]
        shown = 0
        while not all(r.ready() for r in pending):
            time.sleep(0.05)
            shown = _show(bar, counter, shown)
        results = [r.get() for r in pending]  # re-raises a worker's error here, in the parent
        _show(bar, counter, shown)
        pool.close()
        return results
    finally:
        pool.terminate()
        pool.join()


def _show(bar: Progress, counter: Any, shown: int) -> int:
    value = int(counter.value)
    if value > shown:
        bar.update(value - shown)
    return value

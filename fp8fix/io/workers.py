"""Forked worker processes for CPU-bound work split into independent tasks: shards to write,
runs of tensors to verify.

Workers are forked, so they inherit what the parent prepared (open descriptors, the
described checkpoint, the plan, the task list itself) and receive only a task's number
over their own pipe. One shared byte counter drives the parent's single progress bar.
Ctrl-C and SIGTERM are left to the parent, which reports once and ends the workers; a
worker's exception is re-raised in the parent. Results come back in task order, so
output never depends on scheduling.

A worker that dies without answering (the out-of-memory killer's SIGKILL, a SIGTERM sent
to it alone) is seen at once through its process sentinel: the parent stops the others
and raises `WorkerDied`, naming the task. No pool: each worker is a plain process with
one pipe, so the parent never waits on a queue a dead worker held (multiprocessing.Pool
hung in both cases, and in its own terminate about once in 650 runs).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8fix.errors import WorkerDied
from fp8fix.io.progress import Progress
from fp8fix.vocab import AUTO_JOBS, AutoJobs

#: Bytes done by all workers, shared with the parent (which draws the one progress bar).
_done: Any = None
#: How often the parent redraws the progress bar while it waits, in seconds.
_TICK = 0.05
#: How long a worker asked to stop may take before it is killed, in seconds.
_GRACE = 5.0


#: Why a Python caller that imported torch gets one process (warned once per calling line).
TORCH_ONE_PROCESS = (
    "fp8fix: jobs={jobs} ran in one process: torch is imported in this process, and a process forked after "
    "torch started its threads can hang in its first torch operation. Run fp8fix before importing torch, in "
    "a process of its own (subprocess: `fp8fix convert ... --jobs N`), or pass jobs=1 to silence this."
)


#: A process count, or `AUTO_JOBS`: the cores other processes leave idle (`idle_cores`).
Jobs = int | AutoJobs
#: cgroup v2's CPU quota of this process's group ("max 100000" or "200000 100000": quota, period in µs).
_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
#: The kernel's CPU time per core since boot, in clock ticks (Linux).
_PROC_STAT = Path("/proc/stat")
#: At most this much of /proc/stat is read (about 150 bytes a core: thousands of cores).
_STAT_BYTES = 1 << 20
#: The shortest time `idle_cores` watches the CPU time others spend, in seconds (5 clock ticks a core).
WINDOW = 0.05
#: How old the reading taken as fp8fix was imported may be for a command to start its window from it, in seconds.
IMPORT_AGE = 1.0
#: Work smaller than this runs in one process under "auto": forking and starting workers costs more than a
#: second core saves, and `idle_cores` need not watch the machine (bytes to write or check).
PARALLEL_BYTES = 64 << 20


@dataclass(frozen=True)
class CpuReading:
    """CPU time spent so far: on this process's cores by every process (None: no /proc/stat), and by this
    process and its ended workers; seconds, at `at` (monotonic)."""

    at: float
    busy: float | None
    own: float


def read_cpu() -> CpuReading:
    """The CPU time spent now (`CpuReading`). A conversion takes one as it starts, so that `idle_cores` can
    tell, after planning, how busy other processes kept the cores meanwhile."""
    stat = _small_text(_PROC_STAT, _STAT_BYTES)  # None: not Linux
    busy = None if stat is None else busy_seconds(stat, _cores())
    own = os.times()
    return CpuReading(time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system)


def window_start() -> CpuReading:
    """Where a command's window of `idle_cores` starts: at the reading taken as fp8fix was imported, if recent
    (the CLI's: its imports and its planning then fill the window, and it waits for nothing), else now."""
    return _AT_IMPORT if time.monotonic() - _AT_IMPORT.at < IMPORT_AGE else read_cpu()


def busy_seconds(proc_stat: str, cores: set[int]) -> float | None:
    """Seconds `cores` spent working (user, nice, system, irq, softirq, steal; not idle or waiting on the disk)
    by /proc/stat's text; None where it lists none of them."""
    ticks = found = 0
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
            continue
        fields = rest.split()[:8]
        if len(fields) < 4 or not all(f.isdigit() for f in fields):
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = [int(f) for f in fields] + [0] * (8 - len(fields))
        ticks += user + nice + system + irq + softirq + steal
        found += 1
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


def others_busy(start: CpuReading, end: CpuReading) -> float | None:
    """How many of this process's cores other processes kept busy between two readings, on average; None
    where the readings cannot tell (no /proc/stat, no time between them)."""
    elapsed = end.at - start.at
    if start.busy is None or end.busy is None or elapsed <= 0:
        return None
    return max(0.0, (end.busy - start.busy - (end.own - start.own)) / elapsed)


def idle_cores(since: CpuReading | None = None) -> int:
    """The cores a conversion may use without slowing itself down, on this machine now: this process's cores
    (a cgroup quota caps them) less those other processes kept busy since `since` (watched for `WINDOW` at
    least; where the kernel cannot tell, the 1-minute load average), rounded (`cores_left_idle`).

    Watched, not the load average alone: that average lags a minute, so a conversion started right after
    other work (a benchmark's previous run, a CI step) took one process on an idle machine."""
    start = since or read_cpu()
    time.sleep(max(0.0, start.at + WINDOW - time.monotonic()))
    busy = others_busy(start, read_cpu())
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:  # no load figure on this platform
            busy = 0.0
    cores = len(_cores())
    quota = quota_cores(_small_text(_CPU_MAX, 64) or "")  # no cgroup v2 here: no quota
    return min(quota or cores, cores_left_idle(cores, busy))


def _cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _small_text(path: Path, limit: int) -> str | None:
    """The first `limit` bytes of a kernel file as text; None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("ascii", "replace")
    except OSError:
        return None


#: The reading taken as this module was imported (`window_start`).
_AT_IMPORT = read_cpu()


def quota_cores(cpu_max: str) -> int | None:
    """The cores a cgroup v2 `cpu.max` text allows ("200000 100000": 2; "150000 100000": 2), as a container
    sets it while its affinity lists every core of the host; None for no quota ("max ...") or a text this
    does not know."""
    parts = cpu_max.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) == 0:
        return None
    return max(1, -(-int(parts[0]) // int(parts[1])))


def cores_left_idle(cores: int, busy: float) -> int:
    """`cores` less the cores other processes keep `busy`, rounded; at least 1, at most `cores`. A second
    process on a core something else keeps busy makes both slower (issue 30: the default `--jobs` of all
    cores ran 13-27% slower than `--jobs 1` with a core busy), so a loaded machine gets one process. More
    busy cores than this process has (a container seeing its host's load average) gives 1 too: the safe
    answer."""
    return max(1, min(cores, math.floor(cores - busy + 0.5)))


def resolve_jobs(jobs: Jobs, nbytes: int | None = None, since: CpuReading | None = None) -> int:
    """`jobs` as a number: `AUTO_JOBS` is 1 for work of fewer than `PARALLEL_BYTES` (`nbytes`), else
    `idle_cores(since)`, asked now."""
    if jobs != AUTO_JOBS:
        return int(jobs)
    return 1 if nbytes is not None and nbytes < PARALLEL_BYTES else idle_cores(since)


def worker_count(jobs: Jobs, tasks: int) -> int:
    """How many processes to use: `jobs` (`AUTO_JOBS`: `idle_cores()`), capped at the task count; 1 where fork
    is unavailable, and in a process that has loaded torch (a Python caller's: the CLI has not at this
    point). A child forked after torch started its OpenMP threads hangs in its first parallel torch
    operation (it did in this suite, in verify's float checks), so such a caller gets one process, and a
    RuntimeWarning saying so (Python shows it once per calling line)."""
    jobs = resolve_jobs(jobs)
    if jobs < 2 or tasks < 2:
        return 1
    if "torch" in sys.modules:
        import warnings

        warnings.warn(TORCH_ONE_PROCESS.format(jobs=jobs), RuntimeWarning, stacklevel=2)
        return 1
    import multiprocessing  # here, not at the top: a conversion that runs in one process never needs it

    return min(jobs, tasks) if "fork" in multiprocessing.get_all_start_methods() else 1


class SharedProgress:
    """A worker's progress: added to the counter the parent shows."""

    def update(self, n: int) -> None:
        with _done.get_lock():
            _done.value += n


def _serve(function: Callable[..., Any], tasks: list[tuple[Any, ...]], conn: Any, counter: Any) -> None:
    """A worker's life: run each task number the parent sends, answer ("ok", result) or ("error", exception),
    until it sends None."""
    global _done
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # held since the fork (`_start`): now they act plainly
    _done = counter
    while (index := _next_task(conn)) is not None:
        try:
            answer: tuple[str, Any] = ("ok", function(SharedProgress(), *tasks[index]))
        except Exception as e:
            answer = ("error", e)
        try:
            try:
                conn.send(answer)
            except (OSError, EOFError):
                raise
            except Exception as e:  # an exception that does not pickle: its text still reaches the parent
                conn.send(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]} ({e})")))
        except (OSError, EOFError):  # the parent is gone or has stopped listening: nothing left to do
            return


def _next_task(conn: Any) -> int | None:
    """The next task number from the parent; None when it says stop or is gone."""
    try:
        index: int | None = conn.recv()
    except (EOFError, OSError):
        return None
    return index


@dataclass
class _Worker:
    process: Any
    conn: Any
    task: int | None = None


def run_tasks(
    function: Callable[..., Any],
    tasks: list[tuple[Any, ...]],
    workers: int,
    bar: Progress,
    names: list[str] | None = None,
) -> list[Any]:
    """`function(SharedProgress(), *task)` for every task in `workers` forked processes; the results
    in task order. `function` must be a module-level function; `names` say what each task is, for the
    error when a worker dies."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork")
    counter = context.Value("q", 0)
    pool: list[_Worker] = []
    results: list[Any] = [None] * len(tasks)
    queue = iter(range(len(tasks)))
    try:
        for _ in range(workers):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_serve, args=(function, tasks, child_end, counter), daemon=True)
            _start(process)
            child_end.close()
            pool.append(_Worker(process, parent_end))
        for worker in pool:
            _assign(worker, queue, names)
        shown = 0
        while busy := [w for w in pool if w.task is not None]:
            wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=_TICK)
            shown = _show(bar, counter, shown)
            for worker in busy:
                if worker.conn.poll():
                    kind, value = _answer(worker, names)
                    if kind == "error":
                        raise value
                    results[worker.task] = value  # type: ignore[index]
                    _assign(worker, queue, names)
                elif not worker.process.is_alive():
                    raise _died(worker, names)
        _show(bar, counter, shown)
        for worker in pool:
            try:
                worker.conn.send(None)
            except OSError:  # it died after its last answer: every result is in
                pass
        return results
    finally:
        _stop(pool)  # after success each has been told to stop; on any error they are ended


#: Signals a worker must not take with the parent's handlers (fp8fix's SIGTERM handler raises an exception).
_HELD = {signal.SIGINT, signal.SIGTERM}


def _start(process: Any) -> None:
    """Fork `process` with SIGINT and SIGTERM held: a child signalled before `_serve` has set its own
    handlers (the parent stopping it at once, because another worker died) must not run the parent's,
    which raised in the child's after-fork code and printed a traceback. They stay pending in the child
    until `_serve` sets plain handlers and lets them through; the parent's are delivered right after."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _assign(worker: _Worker, queue: Any, names: list[str] | None) -> None:
    """Send `worker` the next task, if any; a worker that died since its last answer is an error (a broken
    pipe here must not reach the CLI, which reads BrokenPipeError as a closed stdout)."""
    worker.task = next(queue, None)
    if worker.task is not None:
        try:
            worker.conn.send(worker.task)
        except OSError:
            raise _died(worker, names) from None


def _answer(worker: _Worker, names: list[str] | None) -> tuple[str, Any]:
    try:
        answer: tuple[str, Any] = worker.conn.recv()
    except (EOFError, OSError):  # it died halfway through its answer
        worker.process.join(_GRACE)
        raise _died(worker, names) from None
    return answer


def _died(worker: _Worker, names: list[str] | None) -> WorkerDied:
    """The error for a worker that ended without answering, naming its task and how it ended."""
    worker.process.join(_GRACE)
    code = worker.process.exitcode
    task = worker.task if worker.task is not None else 0
    what = names[task] if names else f"task {task + 1}"
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        if -code == signal.SIGKILL:
            how += " (the kernel's out-of-memory killer sends it: try fewer --jobs)"
    else:
        how = f"exited with code {code}"
    return WorkerDied(
        f"the worker process (pid {worker.process.pid}) working on {what} {how}; the other workers were "
        "stopped and nothing was written"
    )


def _stop(pool: list[_Worker]) -> None:
    """End every worker: closing its pipe tells an idle one to stop; one still working gets SIGTERM, and
    any left after the grace time SIGKILL."""
    for worker in pool:
        if worker.process.is_alive() and worker.task is not None:
            worker.process.terminate()
        worker.conn.close()
    for worker in pool:
        worker.process.join(_GRACE)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()


def _show(bar: Progress, counter: Any, shown: int) -> int:
    value = int(counter.value)
    if value > shown:
        bar.update(value - shown)
    return value

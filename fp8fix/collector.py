"""Python's cyclic garbage collector, paused while fp8fix reads headers and plans.

Planning makes a few objects per tensor (about a million for a 100k-tensor checkpoint), none of them in
cycles and all freed by reference counting; CPython 3.11's collector still walks the growing heap each time
the objects that outlived a collection grow by a quarter: 40% of the CPU time of `convert --dry-run` on a
100k-tensor DeepSeek-V3-shaped checkpoint (issue 30). It is paused for the header work only (reading,
describing, planning: `conversion.convert`, `inspect_checkpoint`, `verify`'s opening, a streamed conversion's
planning), and on while tensors are streamed and files go to or come from the Hub, so a long conversion's
memory never waits on it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block, or the function it decorates (reference counting still frees
    everything it can); the collector is back as it was after it, nested blocks included."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def collector_running() -> Iterator[None]:
    """The collector on inside the block (tensor streaming, inside a paused command), as it was after it."""
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was_enabled:
            gc.disable()

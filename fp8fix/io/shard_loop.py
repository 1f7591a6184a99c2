"""Output shards one after another under a disk bound, downloads, writes and uploads overlapping.

Used by a streamed conversion (`fp8fix/streaming.py`): the next shard's source shards download while
this one is written and the last one uploads, in daemon threads, as far as the bound allows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from fp8fix.io.writer import shard_file_bytes
from fp8fix.plan.pieces import OutputShard

T = TypeVar("T")


class ShardLoop:
    """Output shards one after another, with the next one's source shards downloading while this one is
    written and the last one uploading: whatever the disk bound allows, the three overlap.

    The working folder's bytes are counted here, in the one thread that decides: source shards from the
    moment their download starts, an output shard from the moment it is about to be written until its
    bytes are sent and it is deleted (its commit, a small request, follows in the background). A download
    starts only when it fits beside all that; when the next shard's inputs do not fit, the loop waits for
    the upload's bytes, then releases source shards kept for later ones (the latest needed first): the
    bound holds at every moment, whatever finishes first."""

    def __init__(
        self,
        todo: list[tuple[int, OutputShard, list[Path]]],
        sizes: dict[Path, int],
        bound: int,
        download: Callable[[str], None],
        source: Path,
    ) -> None:
        self.todo, self.sizes, self.bound, self.download, self.source = todo, sizes, bound, download, source
        self.last_use = {path: i for i, _, inputs in todo for path in inputs}
        self.sources: dict[Path, int] = {}  # source shards on disk or downloading
        self.outputs: dict[str, int] = {}  # output shards being written or uploaded
        self.prefetch: dict[int, Background] = {}
        self.uploads: list[Upload[Any]] = []  # sending, or sent and waiting for their commit, oldest first
        self.base = 0  # bytes the working folder holds throughout
        self.peak = 0

    def run(self, out: Path) -> Iterator[tuple[OutputShard, Path]]:
        """(shard, where to write it) once its source shards are on disk; the caller writes it, then
        calls `upload`."""
        for k, (i, shard, inputs) in enumerate(self.todo):
            size = shard_file_bytes(shard)
            if k not in self.prefetch:
                self._make_room(inputs, size)
                self._start(k)
            self.prefetch.pop(k).result()
            self.outputs[shard.name] = size
            self._note()
            self._prefetch(k + 1)
            yield shard, out / shard.name
            for path in [p for p in self.sources if self.last_use[p] <= i]:
                path.unlink(missing_ok=True)
                del self.sources[path]
            self._prefetch(k + 1)
        self._collect_uploads()

    def upload(self, name: str, path: Path, send: Callable[[], T], commit: Callable[[T], None]) -> None:
        """Upload the shard just written in the background: `send()` its bytes once the previous shard's are
        sent, delete it (its disk bytes are free from then), and `commit(send())` after the previous commit,
        so commits land in order while the next shards download, are written and sent."""
        self._wait_sent()
        while len(self.uploads) >= MAX_UNCOMMITTED:
            self.uploads.pop(0).task.result()
        self.uploads.append(Upload(name, path, send, commit, self.uploads[-1] if self.uploads else None))

    def _wait_sent(self) -> None:
        """Wait until the last upload's bytes are sent, and free the disk bytes of every sent shard."""
        if self.uploads:
            self.uploads[-1].wait_sent()
        self._release_sent()

    def _release_sent(self) -> None:
        for upload in self.uploads:
            if upload.sent.is_set():
                self.outputs.pop(upload.name, None)

    def _collect_uploads(self) -> None:
        while self.uploads:
            self.uploads.pop(0).task.result()
        self.outputs.clear()

    def _fits(self, inputs: list[Path], extra: int) -> bool:
        self._release_sent()
        new = sum(self.sizes[p] for p in inputs if p not in self.sources)
        return self._used() + new + extra <= self.bound

    def _make_room(self, inputs: list[Path], size: int) -> None:
        if not self._fits(inputs, size):
            self._wait_sent()
        for path in sorted(self.sources, key=lambda p: self.last_use[p], reverse=True):
            if self._fits(inputs, size):
                return
            if path not in inputs:
                path.unlink(missing_ok=True)
                del self.sources[path]

    def _prefetch(self, k: int) -> None:
        if k < len(self.todo) and k not in self.prefetch and self._fits(self.todo[k][2], 0):
            self._start(k)

    def _start(self, k: int) -> None:
        missing = [p for p in self.todo[k][2] if p not in self.sources]
        for path in missing:
            self.sources[path] = self.sizes[path]
        self._note()
        names = [p.relative_to(self.source).as_posix() for p in missing]
        self.prefetch[k] = Background(lambda: [self.download(name) for name in names])

    def _used(self) -> int:
        return self.base + sum(self.sources.values()) + sum(self.outputs.values())

    def _note(self) -> None:
        self.peak = max(self.peak, self._used())


def disk_bytes(folder: Path) -> int:
    """Bytes the files under `folder` take on disk (a sparse stand-in: what it holds)."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


#: Shards sent but not yet committed, at most: a kill loses at most these commits (their bytes are on the
#: Hub; a rerun makes them again, and the Hub's LFS storage has them already).
MAX_UNCOMMITTED = 2


class Upload(Generic[T]):
    """One shard's upload in a daemon thread: `send()`, delete the file, then `commit()` what was sent
    once `after` (the previous upload) is committed."""

    def __init__(
        self, name: str, path: Path, send: Callable[[], T], commit: Callable[[T], None], after: Upload[Any] | None
    ) -> None:
        self.name, self.sent = name, threading.Event()

        def work() -> None:
            sent = send()
            path.unlink()
            self.sent.set()
            if after is not None:
                after.task.result()
            commit(sent)

        self.task = Background(work)

    def wait_sent(self) -> None:
        """Until the bytes are sent; what the upload raised, if it failed before."""
        while not self.sent.wait(0.05):
            if self.task.done():
                self.task.result()
                return


class Background:
    """`work()` in a daemon thread (an interrupted run does not wait for a download to end); `result()`
    waits for it and raises what it raised."""

    def __init__(self, work: Callable[[], object]) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as e:  # handed to result(), in the thread that decides
                self._error = e

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

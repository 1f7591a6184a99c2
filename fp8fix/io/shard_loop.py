"""Output shards one after another under a disk bound, downloads, writes and uploads overlapping.

Used by a streamed conversion (`fp8fix/streaming.py`): the next shard's source shards download while
this one is written and the last one uploads, in daemon threads, as far as the bound allows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from fp8fix.io.writer import shard_file_bytes
from fp8fix.plan.pieces import OutputShard


class ShardLoop:
    """Output shards one after another, with the next one's source shards downloading while this one is
    written and the last one uploading: whatever the disk bound allows, the three overlap.

    The working folder's bytes are counted here, in the one thread that decides: source shards from the
    moment their download starts, an output shard from the moment it is about to be written until its
    upload is collected. A download starts only when it fits beside all that; when the next shard's
    inputs do not fit, the loop waits for the upload, then releases source shards kept for later ones
    (the latest needed first): the bound holds at every moment, whatever finishes first."""

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
        self.uploading: tuple[str, Background] | None = None
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
        self._collect_upload()

    def upload(self, name: str, path: Path, commit: Callable[[], None]) -> None:
        """Upload the shard just written (`commit`, then delete it) in the background, once the previous
        one is up."""
        self._collect_upload()

        def send() -> None:
            commit()
            path.unlink()

        self.uploading = (name, Background(send))

    def _collect_upload(self) -> None:
        if self.uploading is not None:
            name, task = self.uploading
            task.result()
            del self.outputs[name]
            self.uploading = None

    def _fits(self, inputs: list[Path], extra: int) -> bool:
        new = sum(self.sizes[p] for p in inputs if p not in self.sources)
        return self._used() + new + extra <= self.bound

    def _make_room(self, inputs: list[Path], size: int) -> None:
        if not self._fits(inputs, size):
            self._collect_upload()
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

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

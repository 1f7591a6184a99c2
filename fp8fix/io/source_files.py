"""Reading source checkpoint files: one descriptor per file, chunks, and memchr-speed code scans.

Convert's writer and verify both read many ranges of the same few shard files; they
share this cache of read-only descriptors and these readers. Everything is read with
pread into bounded buffers, never through a memory map: a SOURCE file truncated by
another process mid-run would turn a mapped read into SIGBUS, while a short pread is
a clean `SourceChanged` naming the file. Scans reuse one window-sized buffer, so the
resident set is bounded by the window, not the file.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import TracebackType

from fp8fix.errors import SourceChanged

#: Bytes read per step when a range is streamed through Python.
CHUNK = 16 * 1024 * 1024
#: Bytes read at a time by a scan.
WINDOW = 64 * 1024 * 1024
#: `SourceFiles.prefetch`: ranges closer than this are read together; at most this many bytes are held.
PREFETCH_GAP = 1024 * 1024
PREFETCH_BYTES = 64 * 1024 * 1024


def source_changed(path: Path, offset: int) -> SourceChanged:
    """The error for a SOURCE file that ends before a byte its header promised."""
    return SourceChanged(
        f"{path.name}: ended at byte {offset} while being read, before the end its header gives; another process "
        "is changing SOURCE. Nothing was written: rerun once SOURCE is complete"
    )


class SourceFiles:
    """Read-only descriptors of source files, opened once each and closed together (a context manager)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        # one file's prefetched spans (`prefetch`): the path, each span's start, and its bytes
        self._spans: tuple[Path | None, list[int], list[bytes]] = (None, [], [])
        # the last `windows` buffer, for the next one of its size: a fresh buffer for every tensor or block row
        # is a fresh mapping to fault in (256 KB block rows of attention: 120k page faults per GB)
        self._spare: bytearray | None = None

    def __enter__(self) -> SourceFiles:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for path in list(self._fds):
            self.close(path)

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self, path: Path) -> None:
        """Close `path`'s descriptor, if open (a file about to be replaced frees its disk only then)."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def read(self, path: Path, start: int, end: int) -> bytes:
        cached, starts, spans = self._spans
        if cached == path:
            i = bisect.bisect_right(starts, start) - 1
            if i >= 0 and end <= starts[i] + len(spans[i]):
                return spans[i][start - starts[i] : end - starts[i]]
        return read_exactly(self.fd(path), path, start, end)

    def prefetch(self, path: Path, ranges: list[tuple[int, int]]) -> None:
        """Read the small ranges `ranges` of `path` (a shard's scales) in a few large reads, for `read` to
        answer from until the next prefetch: ranges less than PREFETCH_GAP apart share a read, and no more
        than PREFETCH_BYTES are held (the rest is read range by range). Exporters write a shard's scales
        side by side (safetensors orders tensors by dtype), so a shard's scales are mostly one read."""
        starts: list[int] = []
        spans: list[tuple[int, int]] = []
        held = 0
        for start, end in sorted(ranges):
            if spans and start - spans[-1][1] <= PREFETCH_GAP:
                held += max(end, spans[-1][1]) - spans[-1][1]
                spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
            else:
                held += end - start
                spans.append((start, end))
            if held > PREFETCH_BYTES:
                spans.pop()
                break
        self._spans = (None, [], [])  # the old spans freed before the new are read
        data = [read_exactly(self.fd(path), path, a, b) for a, b in spans]
        starts = [a for a, _ in spans]
        self._spans = (path, starts, data)

    def chunks(self, path: Path, start: int, end: int, size: int = CHUNK) -> Iterator[bytes]:
        """[start, end) of `path` in pieces of at most `size` bytes."""
        fd = self.fd(path)
        for offset in range(start, end, size):
            yield read_exactly(fd, path, offset, min(end, offset + size))

    def windows(self, path: Path, start: int, end: int, size: int = WINDOW) -> Iterator[tuple[bytearray, int, int]]:
        """[start, end) of `path` read into one reused buffer: (buffer, offset, length) per window.

        The buffer holds the file's bytes [offset, offset + length) from index 0; it is
        overwritten by the next window (and by a later `windows` of the same size), so use it before the
        loop moves on.
        """
        fd = self.fd(path)
        want = min(size, max(end - start, 0))
        spare, self._spare = self._spare, None  # taken: a `windows` inside this loop reads into its own buffer
        buffer = spare if spare is not None and len(spare) == want else bytearray(want)
        try:
            for offset in range(start, end, size):
                length = min(size, end - offset)
                view = memoryview(buffer)[:length]
                got = 0
                while got < length:
                    n = read_into(fd, view[got:], offset + got)
                    if n == 0:
                        raise source_changed(path, offset + got)
                    got += n
                yield buffer, offset, length
        finally:
            self._spare = buffer

    def contains(self, path: Path, start: int, end: int, codes: tuple[int, ...]) -> bool:
        """True when any byte in [start, end) of `path` is one of `codes`."""
        return any(window_contains(buffer, length, codes) for buffer, _, length in self.windows(path, start, end))

    def count(self, path: Path, start: int, end: int, codes: bytes) -> int:
        """How many bytes in [start, end) of `path` are one of `codes`."""
        others = _complement(codes)
        return sum(window_count(buffer, length, others) for buffer, _, length in self.windows(path, start, end))


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """Bytes of `fd` from `offset` into `view`, as many as one read gives: `os.preadv` where the platform
    has it (no copy), `os.pread` and a copy where it does not (macOS before 11, some BSDs)."""
    if PREADV is not None:
        return int(PREADV(fd, [view], offset))
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


#: None where the platform lacks it (tests set it to None to take the other path).
PREADV = getattr(os, "preadv", None)


def read_exactly(fd: int, path: Path, start: int, end: int) -> bytes:
    """[start, end) of the open file `fd` (named `path`), or SourceChanged if it ends sooner."""
    data = os.pread(fd, end - start, start)
    while len(data) < end - start:
        more = os.pread(fd, end - start - len(data), start + len(data))
        if not more:
            raise source_changed(path, start + len(data))
        data += more
    return data


@cache
def _complement(codes: bytes) -> bytes:
    """Every byte value not in `codes`, worked out once per set (`count` runs once per tensor: 50k of them)."""
    return bytes(c for c in range(256) if c not in codes)


def window_count(buffer: bytearray, length: int, others: bytes) -> int:
    """How many of the window's bytes are not in `others` (every byte value but the ones counted): one
    `translate` pass that keeps only the counted bytes."""
    kept = buffer.translate(None, others) if length == len(buffer) else buffer[:length].translate(None, others)
    return len(kept)


def window_contains(buffer: bytearray, length: int, codes: tuple[int, ...]) -> bool:
    return any(buffer.find(c, 0, length) >= 0 for c in codes)


def file_contains(path: Path, start: int, end: int, codes: tuple[int, ...]) -> bool:
    """`SourceFiles.contains` for a file not yet open."""
    with SourceFiles() as files:
        return files.contains(path, start, end, codes)

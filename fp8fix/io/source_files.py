"""Reading source checkpoint files: one descriptor per file, chunks, and memchr-speed code scans.

Convert's writer and verify both read many ranges of the same few shard files; they
share this cache of read-only descriptors and these readers. Scans go through a
sliding read-only memory map, so the resident set is bounded by the window, not the
file: scanning a 700 GB checkpoint needs no more memory than a 2 GB one.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

#: Bytes read per step when a range is streamed through Python.
CHUNK = 16 * 1024 * 1024
#: Bytes mapped at a time by a scan.
WINDOW = 64 * 1024 * 1024


class SourceFiles:
    """Read-only descriptors of source files, opened once each and closed together (a context manager)."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> SourceFiles:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stack.close()
        self._fds.clear()

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            fd = os.open(path, os.O_RDONLY)
            self._stack.callback(os.close, fd)
            self._fds[path] = fd
        return self._fds[path]

    def read(self, path: Path, start: int, end: int) -> bytes:
        return os.pread(self.fd(path), end - start, start)

    def chunks(self, path: Path, start: int, end: int, size: int = CHUNK) -> Iterator[bytes]:
        """[start, end) of `path` in pieces of at most `size` bytes."""
        fd = self.fd(path)
        for offset in range(start, end, size):
            yield os.pread(fd, min(size, end - offset), offset)

    def contains(self, path: Path, start: int, end: int, codes: tuple[int, ...]) -> bool:
        """True when any byte in [start, end) of `path` is one of `codes`."""
        return range_contains(self.fd(path), start, end, codes)


def mapped_windows(fd: int, start: int, end: int, size: int = WINDOW) -> Iterator[tuple[mmap.mmap, int, int, int]]:
    """Read-only maps covering [start, end) of `fd`, `size` bytes at a time.

    Yields (window, first, offset, stop): the window holds the file's bytes [offset, stop)
    from index `first` (maps start at an allocation-granularity boundary). Each window is
    unmapped when the loop moves on.
    """
    for offset in range(start, end, size):
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        stop = min(end, offset + size)
        with mmap.mmap(fd, stop - base, prot=mmap.PROT_READ, offset=base) as window:
            yield window, offset - base, offset, stop


def window_contains(window: mmap.mmap, first: int, codes: tuple[int, ...]) -> bool:
    return any(window.find(bytes([c]), first) >= 0 for c in codes)


def range_contains(fd: int, start: int, end: int, codes: tuple[int, ...]) -> bool:
    """True when any byte in [start, end) of the file `fd` is one of `codes`."""
    return any(window_contains(window, first, codes) for window, first, _, _ in mapped_windows(fd, start, end))


def file_contains(path: Path, start: int, end: int, codes: tuple[int, ...]) -> bool:
    """`range_contains` for a file not yet open."""
    with SourceFiles() as files:
        return files.contains(path, start, end, codes)

"""Streaming the plan to disk: each header first, then each tensor's bytes at its offset.

Unchanged byte ranges go through `os.copy_file_range` (the kernel copies, nothing is
decoded); rewritten weights are read in fixed-size chunks, so memory stays at a few
chunks whatever the checkpoint's size.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

from tqdm import tqdm

from fp8fix.dtypes import NAN_CODES, count_nan_codes
from fp8fix.errors import InvalidCheckpoint
from fp8fix.plan import ConversionPlan, CopyRange, OutputShard, RepeatRange, Requantize
from fp8fix.safetensors_file import encode_header
from fp8fix.transforms import RequantizeError

CHUNK = 16 * 1024 * 1024
SCAN_WINDOW = 64 * 1024 * 1024
_NO_COPY_FILE_RANGE = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)


class _Sources:
    """Read-only descriptors of the source files, opened once each."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            fd = os.open(path, os.O_RDONLY)
            self._stack.callback(os.close, fd)
            self._fds[path] = fd
        return self._fds[path]


def write_plan(plan: ConversionPlan, out_dir: Path, quiet: bool = False) -> dict[str, RequantizeError]:
    """Write every shard of `plan` into `out_dir`; return the requantization error per source tensor."""
    errors: dict[str, RequantizeError] = {}
    with ExitStack() as stack:
        sources = _Sources(stack)
        bar = stack.enter_context(
            tqdm(
                total=plan.total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="fp8fix convert",
                disable=True if quiet else None,
            )
        )
        for shard in plan.shards:
            _write_shard(shard, out_dir / shard.name, sources, bar, errors)
    return errors


def _write_shard(
    shard: OutputShard, path: Path, sources: _Sources, bar: tqdm, errors: dict[str, RequantizeError]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = encode_header([(t.name, t.dtype, t.shape) for t in shard.tensors], shard.metadata)
    with open(path, "wb", buffering=0) as f:
        out = f.fileno()
        _write_all(out, header)
        copier = _RangeCopier(sources, out, bar)
        for tensor in shard.tensors:
            for piece in tensor.pieces:
                if isinstance(piece, CopyRange):
                    if piece.nan_check:
                        _refuse_nan_codes(sources.fd(piece.path), piece, piece.nan_check, tensor.source)
                    copier.add(piece)
                    continue
                copier.flush()
                if isinstance(piece, RepeatRange):
                    data = os.pread(sources.fd(piece.path), piece.end - piece.start, piece.start)
                    _write_all(out, data * piece.times)
                    bar.update(piece.nbytes)
                else:
                    error = _requantize(sources.fd(piece.path), out, piece, tensor.source, bar)
                    errors.setdefault(tensor.source, RequantizeError()).update(error)
        copier.flush()


class _RangeCopier:
    """Copies byte ranges in order, merging ranges that continue each other into one kernel copy."""

    def __init__(self, sources: _Sources, out: int, bar: tqdm) -> None:
        self._sources, self._out, self._bar = sources, out, bar
        self._pending: CopyRange | None = None

    def add(self, piece: CopyRange) -> None:
        p = self._pending
        if p is not None and p.path == piece.path and p.end == piece.start:
            self._pending = CopyRange(p.path, p.start, piece.end)
            return
        self.flush()
        self._pending = piece

    def flush(self) -> None:
        if self._pending is not None:
            p, self._pending = self._pending, None
            _copy(self._sources.fd(p.path), self._out, p.start, p.end, self._bar)


def _copy(src: int, dst: int, start: int, end: int, bar: tqdm) -> None:
    offset = start
    while offset < end:
        count = min(end - offset, 1 << 30)
        try:
            copied = os.copy_file_range(src, dst, count, offset)
        except OSError as e:
            if e.errno not in _NO_COPY_FILE_RANGE:
                raise
            copied = _write_all(dst, os.pread(src, min(count, CHUNK), offset))
        if copied == 0:
            raise InvalidCheckpoint(f"source file shrank while reading (offset {offset}); is it being written?")
        offset += copied
        bar.update(copied)


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def _chunks(src: int, start: int, end: int) -> Iterator[bytes]:
    for offset in range(start, end, CHUNK):
        yield os.pread(src, min(CHUNK, end - offset), offset)


def _nan_error(src: int, piece: CopyRange | Requantize, dtype: str, source: str) -> InvalidCheckpoint:
    count = sum(count_nan_codes(chunk, dtype) for chunk in _chunks(src, piece.start, piece.end))
    return InvalidCheckpoint(
        f"{piece.path.name}: weight '{source}' holds {count} NaN code(s) (0x7F/0xFF in e4m3fn) in rows being "
        "rewritten; the checkpoint is corrupt: re-export it"
    )


def _refuse_nan_codes(src: int, piece: CopyRange, dtype: str, source: str) -> None:
    """Scan a range for NaN codes through a sliding memory map (memchr speed, no copy, bounded RSS)."""
    codes = [bytes([c]) for c in NAN_CODES[dtype]]
    for offset in range(piece.start, piece.end, SCAN_WINDOW):
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        stop = min(piece.end, offset + SCAN_WINDOW)
        with mmap.mmap(src, stop - base, prot=mmap.PROT_READ, offset=base) as window:
            if any(window.find(code, offset - base) >= 0 for code in codes):
                raise _nan_error(src, piece, dtype, source)


def _requantize(src: int, out: int, piece: Requantize, source: str, bar: tqdm) -> RequantizeError:
    from fp8fix.transforms import requantize

    worst = RequantizeError()
    for chunk in _chunks(src, piece.start, piece.end):
        if count_nan_codes(chunk, piece.dtype):
            raise _nan_error(src, piece, piece.dtype, source)
        codes, error = requantize(chunk, piece.dtype, piece.scale, piece.target_scale)
        worst.update(error)
        _write_all(out, codes)
        bar.update(len(chunk))
    return worst

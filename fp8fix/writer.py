"""Streaming the plan to disk: each header first, then each tensor's bytes at its offset.

Unchanged byte ranges go through `os.copy_file_range` (the kernel copies, nothing is
decoded); rewritten weights are read in fixed-size chunks, so memory stays at a few
chunks whatever the checkpoint's size.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

from tqdm.auto import tqdm

from fp8fix.dtypes import count_nan_codes
from fp8fix.errors import InvalidCheckpoint
from fp8fix.plan import ConversionPlan, CopyRange, OutputShard, Piece, RepeatRange, Requantize
from fp8fix.safetensors_file import encode_header
from fp8fix.transforms import RequantizeError

CHUNK = 16 * 1024 * 1024
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
        for source, piece in _coalesced(shard):
            if isinstance(piece, CopyRange) and piece.nan_check is None:
                _copy(sources.fd(piece.path), out, piece.start, piece.end, bar)
            elif isinstance(piece, CopyRange):
                _copy_checked(sources.fd(piece.path), out, piece, source, bar)
            elif isinstance(piece, RepeatRange):
                data = os.pread(sources.fd(piece.path), piece.end - piece.start, piece.start)
                _write_all(out, data * piece.times)
                bar.update(piece.nbytes)
            else:
                errors.setdefault(source, RequantizeError()).update(
                    _requantize(sources.fd(piece.path), out, piece, source, bar)
                )


def _coalesced(shard: OutputShard) -> Iterator[tuple[str, Piece]]:
    """The shard's pieces in order, with adjacent plain copies of one file merged into one range."""
    pending: CopyRange | None = None
    for tensor in shard.tensors:
        for piece in tensor.pieces:
            if isinstance(piece, CopyRange) and piece.nan_check is None:
                if pending and pending.path == piece.path and pending.end == piece.start:
                    pending = CopyRange(pending.path, pending.start, piece.end)
                    continue
                if pending:
                    yield "", pending
                pending = piece
                continue
            if pending:
                yield "", pending
                pending = None
            yield tensor.source, piece
    if pending:
        yield "", pending


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


def _copy_checked(src: int, out: int, piece: CopyRange, source: str, bar: tqdm) -> None:
    assert piece.nan_check is not None
    for chunk in _chunks(src, piece.start, piece.end):
        if count_nan_codes(chunk, piece.nan_check):
            raise _nan_error(src, piece, piece.nan_check, source)
        _write_all(out, chunk)
        bar.update(len(chunk))


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

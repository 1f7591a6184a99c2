"""Streaming the plan to disk: each header first, then each tensor's bytes at its offset.

Unchanged byte ranges go through `os.copy_file_range` (the kernel copies, nothing is
decoded); rewritten weights are read in fixed-size chunks, so memory stays at a few
chunks whatever the checkpoint's size. Shards are independent files, so where the work
is CPU-bound (recoding, requantizing) `jobs` worker processes write one shard each; a
shard's bytes do not depend on who writes it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from fp8fix.collector import collector_running
from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.io.checkpoint import first_invalid_scale
from fp8fix.io.progress import NoProgress, Progress, progress_bar
from fp8fix.io.safetensors_file import TensorInfo, encode_header
from fp8fix.io.source_files import SourceFiles, read_into, source_changed, window_contains
from fp8fix.io.workers import Jobs, run_tasks, worker_count
from fp8fix.numerics.dequantize import LookupArrays, dequantize_rows, lookup_tables
from fp8fix.numerics.dtypes import BITS, E4M3FN, E8M0_NAN, NAN_CODES, decode_floats, encode_floats
from fp8fix.numerics.mx import MX_BLOCK, MxRangeError, MxRows, e2m1_as_e4m3, e8m0_row_bytes, mx_to_bf16, mx_values
from fp8fix.numerics.mx_blocks import ReblockedRows, ReblockStats, reblock_rows
from fp8fix.numerics.nvfp4_shared import SharedScaleNaN, SharedStats, share_rows
from fp8fix.numerics.recodings import RECODINGS, inexact_codes, recode, scale_exactly
from fp8fix.numerics.requantize import RoundingStats, requantize, requantize_map
from fp8fix.numerics.ue8m0 import BlockRow, Ue8m0Stats, ue8m0_rows
from fp8fix.plan.pieces import (
    ConversionPlan,
    CopyRange,
    Dequantize,
    Fill,
    MxBlockCodes,
    MxBlockScales,
    MxDequantize,
    MxScales,
    Nvfp4Dequantize,
    Nvfp4Shared,
    OutputShard,
    PadRows,
    Recode,
    RepeatRange,
    Requantize,
    RequantizeBlocks,
    Rescale,
    ScaleRef,
    Ue8m0Codes,
    Ue8m0Scales,
)

#: Recoded bytes pass through one buffer of this size: small enough to stay in the CPU cache,
#: large enough that the two syscalls per window cost little.
RECODE_WINDOW = 1024 * 1024
PAGE = 4096
#: Copies at least this long start at a page boundary (see `_copy`).
PAGE_ALIGN_MIN = 1024 * 1024
#: One buffer for unaligned copies: reused, so its pages are never faulted in again.
_BUFFER = memoryview(bytearray(1024 * 1024))
#: The kernel's copy, where the platform has it (Linux; not macOS, Windows or an old glibc): without it,
#: or where it fails at run time with one of _NO_COPY_FILE_RANGE (across file systems, a file system or
#: kernel without it), bytes are read and written through _BUFFER.
COPY_FILE_RANGE = getattr(os, "copy_file_range", None)
_NO_COPY_FILE_RANGE = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)


@dataclass
class WriteStats:
    """What the data revealed while writing: requantization errors per source tensor, inexact recodes."""

    requantized: dict[str, RoundingStats] = field(default_factory=dict)
    inexact_codes: int = 0
    dequantized: dict[str, RoundingStats] = field(default_factory=dict)  # BF16 rounding, per source weight
    ue8m0: dict[str, Ue8m0Stats] = field(default_factory=dict)  # `--scales ue8m0`, per source weight
    reblocked: dict[str, ReblockStats] = field(default_factory=dict)  # `--blocks 128x128`, per source weight
    shared: dict[str, SharedStats] = field(default_factory=dict)  # NVFP4 at a shared global scale, per packed weight
    processes: int = 1  # how many processes wrote the shards (`jobs`, as far as it applied)

    def merge(self, other: WriteStats) -> None:
        for name, error in other.requantized.items():
            self.requantized.setdefault(name, RoundingStats()).update(error)
        for name, rounding in other.dequantized.items():
            self.dequantized.setdefault(name, RoundingStats()).update(rounding)
        for name, figures in other.ue8m0.items():
            self.ue8m0.setdefault(name, Ue8m0Stats()).update(figures)
        for name, counted in other.reblocked.items():
            self.reblocked.setdefault(name, ReblockStats()).update(counted)
        for name, moved in other.shared.items():
            self.shared.setdefault(name, SharedStats()).update(moved)
        self.inexact_codes += other.inexact_codes


class _Sources(SourceFiles):
    """The source files, and the source tensors (to name and count codes in a whole tensor)."""

    def __init__(self, tensors: dict[str, TensorInfo]) -> None:
        super().__init__()
        self.tensors = tensors
        # `--scales ue8m0`: the exponents each block row got, by its piece, for its scale tensor written
        # after it (a scale written first works them out from the rows itself; a grid's worth of ints)
        self.exponents: dict[Ue8m0Codes | MxBlockCodes, list[int]] = {}
        self.shared_scales: dict[Nvfp4Shared, bytes] = {}  # NVFP4 rows' new scale bytes, for their scale tensor
        self.scales_to_come: set[Nvfp4Shared] = set()  # ... which the shard being written holds further on
        self.lookup_arrays = LookupArrays()  # `--to bf16`'s index and output, reused window after window


def write_plan(plan: ConversionPlan, out_dir: Path, quiet: bool = False, jobs: Jobs = 1) -> WriteStats:
    """Write every shard of `plan` into `out_dir`, in up to `jobs` processes where the work is CPU-bound."""
    workers = worker_count(jobs, len(plan.shards)) if _cpu_bound(plan) else 1
    with collector_running(), progress_bar(plan.total_bytes, "fp8fix convert", quiet) as bar:
        stats = WriteStats(processes=workers)
        if workers > 1:
            order = sorted(plan.shards, key=lambda s: -s.nbytes)  # biggest first: the last to start is small
            tasks = [(s, out_dir / s.name, plan.sources) for s in order]
            names = [s.name for s in order]
            for result in run_tasks(_write_shard_job, tasks, workers, bar, names):
                stats.merge(result)
            return stats
        sources = _Sources(plan.sources)
        with sources:
            for shard in plan.shards:
                _write_shard(shard, out_dir / shard.name, sources, bar, stats)
        return stats


def write_shard(plan: ConversionPlan, shard: OutputShard, path: Path, bar: Progress) -> WriteStats:
    """One shard of `plan` written to `path` (a streamed conversion writes them one at a time)."""
    with collector_running():
        return _write_shard_job(bar, shard, path, plan.sources)


def shard_inputs(shard: OutputShard) -> set[Path]:
    """The source files the shard's pieces read (with the scales read as rows are written: a streamed
    conversion must have their shard too, where an exporter put a scale apart from its weight)."""
    paths = set()
    for t in shard.tensors:
        for p in t.pieces:
            if isinstance(p, Ue8m0Scales | MxScales):
                paths |= {r.path for r in p.rows} | {r.col_scales.path for r in p.rows}
            elif isinstance(p, Ue8m0Codes):
                paths |= {p.path, p.col_scales.path}
            elif isinstance(p, Dequantize):
                paths |= {p.path} | {ref.path for ref in (p.col_scales, p.row_scales) if ref is not None}
            elif isinstance(p, MxDequantize | MxBlockCodes | Nvfp4Shared):
                paths |= {p.path, p.scales.path}
            elif isinstance(p, Nvfp4Dequantize):
                paths |= {p.path, p.scales.path, p.global_scale.path}
            elif isinstance(p, MxBlockScales):
                paths |= {r.path for r in p.rows} | {r.scales.path for r in p.rows}
            elif not isinstance(p, Fill):
                paths.add(p.path)
    return paths


#: The pieces whose bytes pass through Python (recoded, requantized, dequantized, re-blocked).
CPU_BOUND_PIECES = (
    Recode,
    Requantize,
    RequantizeBlocks,
    PadRows,
    Dequantize,
    MxDequantize,
    Nvfp4Dequantize,
    MxBlockCodes,
    Ue8m0Codes,
    Nvfp4Shared,
)


def _cpu_bound(plan: ConversionPlan) -> bool:
    """Recoding and requantizing pass bytes through Python; plain copies are the kernel's (and the disk's)."""
    return any(isinstance(p, CPU_BOUND_PIECES) for s in plan.shards for t in s.tensors for p in t.pieces)


def _write_shard_job(progress: Progress, shard: OutputShard, path: Path, tensors: dict[str, TensorInfo]) -> WriteStats:
    stats = WriteStats()
    sources = _Sources(tensors)
    with sources:
        _write_shard(shard, path, sources, progress, stats)
    return stats


def _header(shard: OutputShard) -> bytes:
    return encode_header(
        [(t.name, t.dtype, t.shape) for t in shard.tensors], shard.metadata, lambda size: _page_padding(shard, size)
    )


def shard_file_bytes(shard: OutputShard) -> int:
    """The size of the shard's file: its header, then its tensors."""
    return len(_header(shard)) + shard.nbytes


def _write_shard(shard: OutputShard, path: Path, sources: _Sources, bar: Progress, stats: WriteStats) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _header(shard)
    sources.scales_to_come = {p for t in shard.tensors for p in t.pieces if isinstance(p, Nvfp4Shared)}
    with open(path, "w+b", buffering=0) as f:  # read too: `_copy` restores bytes it overwrote
        out = f.fileno()
        _write_all(out, header)
        copier = _RangeCopier(sources, out, bar)
        for tensor in shard.tensors:
            for piece in tensor.pieces:
                if isinstance(piece, CopyRange):
                    if piece.nan_check:
                        _refuse_codes(sources, piece, NAN_CODES[piece.nan_check], tensor.source, "NaN codes")
                    copier.add(piece)
                    continue
                copier.flush()
                if isinstance(piece, RepeatRange):
                    _write_all(out, sources.read(piece.path, piece.start, piece.end) * piece.times)
                elif isinstance(piece, Rescale):
                    _write_all(out, _rescale(sources, piece, tensor.name) * piece.times)
                elif isinstance(piece, Recode):
                    stats.inexact_codes += _recode(sources, out, piece, tensor.source)
                elif isinstance(piece, Fill):
                    _fill(out, piece)
                elif isinstance(piece, PadRows):
                    _pad_rows(sources, out, piece, tensor.source)
                elif isinstance(piece, Ue8m0Codes):
                    figures = _ue8m0_codes(sources, out, piece)
                    stats.ue8m0.setdefault(piece.weight, Ue8m0Stats()).update(figures)
                elif isinstance(piece, Ue8m0Scales):
                    _write_all(out, _ue8m0_scales(sources, piece))
                elif isinstance(piece, MxScales):
                    _write_all(out, _mx_scales(sources, piece))
                elif isinstance(piece, MxBlockCodes):
                    row = _mx_block_rows(sources, piece)
                    sources.exponents[piece] = row.exponents
                    _write_all(out, row.codes)
                    stats.reblocked.setdefault(piece.weight, ReblockStats()).update(row.stats)
                elif isinstance(piece, Nvfp4Shared):
                    _write_all(out, _nvfp4_shared(sources, piece, stats))
                elif isinstance(piece, MxBlockScales):
                    exponents = [e for r in piece.rows for e in _exponents_of(sources, r)]
                    _write_all(out, encode_floats([2.0**e for e in exponents], piece.dtype))
                elif isinstance(piece, Dequantize):
                    rounding = _dequantize(sources, out, piece, tensor.source)
                    stats.dequantized.setdefault(tensor.source, RoundingStats()).update(rounding)
                elif isinstance(piece, MxDequantize):
                    rounding = _mx_dequantize(sources, out, piece, tensor.source)
                    stats.dequantized.setdefault(tensor.source, RoundingStats()).update(rounding)
                elif isinstance(piece, Nvfp4Dequantize):
                    rounding = _nvfp4_dequantize(sources, out, piece, tensor.source)
                    stats.dequantized.setdefault(tensor.source, RoundingStats()).update(rounding)
                elif isinstance(piece, RequantizeBlocks):
                    error = _requantize_blocks(sources, out, piece, tensor.source)
                    stats.requantized.setdefault(tensor.source, RoundingStats()).update(error)
                else:
                    error = _requantize(sources, out, piece, tensor.source)
                    stats.requantized.setdefault(tensor.source, RoundingStats()).update(error)
                bar.update(piece.nbytes)
        copier.flush()


class _RangeCopier:
    """Copies byte ranges in order, merging ranges that continue each other into one kernel copy."""

    def __init__(self, sources: _Sources, out: int, bar: Progress) -> None:
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
            _copy(self._sources, p.path, self._out, p.start, p.end, self._bar)


def _page_padding(shard: OutputShard, header_size: int) -> int:
    """Header padding that puts the most copied bytes at the same offset within a page as in the source.

    The kernel copies page-aligned ranges a third faster than ranges whose source and
    destination sit at different offsets within their pages (measured: 0.15 s vs 0.23 s
    for 0.57 GB); a few KiB of spaces in the header buy that for most of the data.
    """
    weights: dict[int, int] = {}
    position = header_size
    for tensor in shard.tensors:
        for piece in tensor.pieces:
            if isinstance(piece, CopyRange):  # copied by the kernel
                delta = (piece.start - position) % PAGE
                if delta % 8 == 0:
                    weights[delta] = weights.get(delta, 0) + piece.nbytes
            position += piece.nbytes
    return max(sorted(weights), key=lambda d: weights[d]) if weights else 0


def _copy(sources: SourceFiles, path: Path, dst: int, start: int, end: int, bar: Progress) -> None:
    """Copy [start, end) of the source file `path` to the current position of `dst`: in the
    kernel when the two sit at the same offset within a page, else through one reused buffer."""
    src = sources.fd(path)
    position = os.lseek(dst, 0, os.SEEK_CUR)
    aligned = (start - position) % PAGE == 0
    lead = start % PAGE
    if aligned and lead and end - start >= PAGE_ALIGN_MIN:
        # The kernel copies whole pages fastest (a fifth faster, measured). Start the copy at the page
        # boundary before `start`, then put back the bytes of `dst` that this overwrote.
        kept = os.pread(dst, lead, position - lead)
        os.lseek(dst, position - lead, os.SEEK_SET)
        _copy_range(src, path, dst, start - lead, end, aligned, NoProgress())
        os.pwrite(dst, kept, position - lead)
        bar.update(end - start)
        return
    _copy_range(src, path, dst, start, end, aligned, bar)


def _copy_range(src: int, path: Path, dst: int, start: int, end: int, aligned: bool, bar: Progress) -> None:
    offset = start
    while offset < end:
        count = min(end - offset, 1 << 30)
        copied = 0
        if aligned and COPY_FILE_RANGE is not None:
            try:
                copied = COPY_FILE_RANGE(src, dst, count, offset)
            except OSError as e:
                if e.errno not in _NO_COPY_FILE_RANGE:
                    raise
                aligned = False
        else:
            aligned = False
        if not aligned:
            view = _BUFFER[: min(count, len(_BUFFER))]
            copied = _write_all(dst, view[: read_into(src, view, offset)])
        if copied == 0:
            raise source_changed(path, offset)
        offset += copied
        bar.update(copied)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def _refuse_codes(
    sources: _Sources,
    piece: CopyRange
    | Recode
    | Requantize
    | RequantizeBlocks
    | PadRows
    | Dequantize
    | MxDequantize
    | MxBlockCodes
    | Ue8m0Codes,
    codes: tuple[int, ...],
    source: str,
    what: str,
) -> None:
    """Raise, naming the tensor and counting the codes in all of it, when the piece holds any of `codes`."""
    if not sources.contains(piece.path, piece.start, piece.end, codes):
        return
    t = sources.tensors.get(source)
    path, start, end = (t.path, t.start, t.end) if t else (piece.path, piece.start, piece.end)
    count = sum(chunk.count(c) for chunk in sources.chunks(path, start, end) for c in codes)
    listed = "/".join(f"0x{c:02X}" for c in codes)
    raise InvalidCheckpoint(
        f"{path.name}: weight '{source}' holds {count} {what} ({listed}); fp8fix will not turn them into "
        "plausible numbers: the checkpoint is corrupt or mislabelled, re-export it"
    )


def _recode(sources: _Sources, out: int, piece: Recode, source: str) -> int:
    """Map the codes window by window; return how many could not keep their exact value.

    Each window is read into one reused buffer, checked for forbidden codes, mapped and
    written. The buffer stays in the CPU cache, so read + map + write moves about the
    bytes the kernel's own copy moves, whatever the density of changed codes (copying in
    the kernel and patching changed bytes costs a syscall per byte: ruinous on random
    codes). `scripts/bench_convert.py --suite`: 0.30 s past start-up for 1.3 GB of
    realistic weights, where `cp -r` takes 0.34 s.
    """
    recoding = RECODINGS[piece.recoding]
    lossy = inexact_codes(piece.recoding)
    inexact = 0
    for window, _, length in sources.windows(piece.path, piece.start, piece.end, RECODE_WINDOW):
        codes = window if length == len(window) else bytes(memoryview(window)[:length])
        if window_contains(window, length, recoding.forbidden):
            _refuse_codes(sources, piece, recoding.forbidden, source, recoding.why)
        inexact += sum(codes.count(c) for c in lossy)
        _write_all(out, recode(codes, piece.recoding))
    return inexact


def _rescale(sources: SourceFiles, piece: Rescale, name: str) -> bytes:
    return _scaled(sources.read(piece.path, piece.start, piece.end), piece.dtype, piece.factor, piece.path, name)


def _scaled(data: bytes, dtype: str, factor: float, path: Path, name: str) -> bytes:
    """Scales multiplied by a power of two, exactly, or a clear error naming the scale."""
    try:
        return scale_exactly(data, dtype, factor)
    except ValueError as e:
        raise InvalidCheckpoint(f"{path.name}: scale '{name}': {e}; cannot convert it exactly") from e


def _requantize(sources: _Sources, out: int, piece: Requantize, source: str) -> RoundingStats:
    """Map the codes window by window, as `_recode` does (one reused buffer, checked for NaN codes as it is
    read: one pass over the bytes, not a check pass and a rewrite pass); the worst error among the codes."""
    forbidden = RECODINGS[piece.normalize].forbidden if piece.normalize else NAN_CODES[piece.dtype]
    worst = RoundingStats()
    for window, _, length in sources.windows(piece.path, piece.start, piece.end, RECODE_WINDOW):
        if window_contains(window, length, forbidden):
            _refuse_codes(sources, piece, forbidden, source, "NaN codes")
        chunk = window if length == len(window) else bytes(memoryview(window)[:length])
        codes = recode(chunk, piece.normalize) if piece.normalize else chunk
        new, error = requantize(codes, piece.dtype, piece.scale, piece.target_scale, piece.out_dtype)
        worst.update(error)
        _write_all(out, new)
    return worst


def _requantize_blocks(sources: _Sources, out: int, piece: RequantizeBlocks, source: str) -> RoundingStats:
    """Rows of codes requantized column block by column block (at most one block row: 128 rows)."""
    import numpy as np

    forbidden = RECODINGS[piece.normalize].forbidden if piece.normalize else NAN_CODES[piece.dtype]
    data = sources.read(piece.path, piece.start, piece.end)
    if any(c in data for c in forbidden):  # checked in the bytes read, not in a second pass over the file
        _refuse_codes(sources, piece, forbidden, source, "NaN codes")
    codes = bytearray(recode(data, piece.normalize) if piece.normalize else data)
    rows = np.frombuffer(codes, dtype=np.uint8).reshape(-1, piece.row_bytes)
    worst = RoundingStats()
    for c, (scale, target) in enumerate(zip(piece.scales, piece.targets, strict=True)):
        if scale == target and piece.dtype == piece.out_dtype:
            continue
        block = rows[:, c * piece.block_cols : (c + 1) * piece.block_cols]
        table = requantize_map(piece.dtype, scale, target, piece.out_dtype)
        worst.update(table.worst(block.tobytes()))
        block[...] = np.frombuffer(table.codes, dtype=np.uint8)[block]
    _write_all(out, codes)
    return worst


def _dequantize(sources: _Sources, out: int, piece: Dequantize, source: str) -> RoundingStats:
    """Rows of codes written as BF16 / F16, window by window (a few MB whatever the tensor's size); the
    scales read from the source as the rows need them."""
    nan = NAN_CODES[piece.dtype]
    cols = _scale_list(sources, piece.col_scales, source) if piece.col_scales else [1.0]
    window_bytes = max(1, RECODE_WINDOW // piece.row_bytes) * piece.row_bytes
    worst = RoundingStats()
    arrays, tables = sources.lookup_arrays, None
    for buffer, first, length in sources.windows(piece.path, piece.start, piece.end, window_bytes):
        codes = memoryview(buffer)[:length]  # one reused buffer: read into, looked up, written from
        if window_contains(buffer, length, nan):
            _refuse_codes(sources, piece, nan, source, "NaN codes")
        rows = None
        if piece.row_scales is not None:
            row = (first - piece.start) // piece.row_bytes
            ref = piece.row_scales
            window = replace(ref, start=ref.start + row * _itemsize(ref), count=length // piece.row_bytes)
            rows = _scale_list(sources, window, source)
        try:
            if rows is None and tables is None:  # column scales only: every window's tables are the same
                tables = lookup_tables(piece.dtype, cols, None, piece.out_dtype)
            data, rounding = dequantize_rows(
                codes, piece.dtype, piece.row_bytes, piece.block_cols, cols, rows, piece.out_dtype, arrays, tables
            )
        except ValueError as e:
            raise InvalidCheckpoint(
                f"{piece.path.name}: weight '{source}': {e}; cannot write it in {piece.out_dtype}"
            ) from e
        worst.update(rounding)
        _write_all(out, data)
    return worst


def _mx_dequantize(sources: _Sources, out: int, piece: MxDequantize, source: str) -> RoundingStats:
    """MX rows written as BF16 (exactly: `numerics.mx.mx_to_bf16`) or F16 (rounded once), window by window, each
    window's E8M0 bytes read beside it. A NaN code, a NaN scale or a value BF16 cannot hold is refused, named."""
    from fp8fix.numerics.dequantize import BF16, output_bits, output_step, round_to

    nan = NAN_CODES[E4M3FN] if piece.element == "e4m3" else ()  # E2M1 has no NaN
    blocks = piece.cols // MX_BLOCK
    window_bytes = max(1, RECODE_WINDOW // piece.row_bytes) * piece.row_bytes
    if piece.transposed_rows:  # one expert a window: written transposed (a few tens of MB at gpt-oss-120b's size)
        window_bytes = piece.transposed_rows * piece.row_bytes
    worst = RoundingStats()
    for buffer, first, length in sources.windows(piece.path, piece.start, piece.end, window_bytes):
        if nan and window_contains(buffer, length, nan):
            _refuse_codes(sources, piece, nan, source, "NaN codes")
        row0, rows = (first - piece.start) // piece.row_bytes, length // piece.row_bytes
        at = piece.scales.start + row0 * blocks
        scales = sources.read(piece.scales.path, at, at + rows * blocks)
        codes, shape = memoryview(buffer)[:length], MxRows(rows, piece.cols, piece.element)
        try:
            if piece.out_dtype == BF16:
                _write_all(out, _transposed(mx_to_bf16(codes, scales, shape, sources.lookup_arrays), piece, rows))
                continue
            exact = mx_values(codes, scales, shape)
            rounded = round_to(exact, piece.out_dtype)
        except MxRangeError as e:
            raise InvalidCheckpoint(
                f"{piece.path.name}: MX weight '{source}' row {row0 + e.row}, block {e.block}: byte {e.scale_byte} "
                f"of its scale '{piece.scales.name}' {e.why}; cannot write it in {piece.out_dtype}"
            ) from e
        except ValueError as e:
            raise InvalidCheckpoint(
                f"{piece.path.name}: MX weight '{source}': {e}; cannot write it in {piece.out_dtype}"
            ) from e
        error = abs(rounded - exact)
        steps = error / output_step(exact, piece.out_dtype)
        worst.update(RoundingStats(float(error.max(initial=0.0)), float(steps.max(initial=0.0))))
        _write_all(out, _transposed(output_bits(rounded, piece.out_dtype).astype("<u2").tobytes(), piece, rows))
    return worst


#: Rows transposed at a time (`_transposed`): 16 16-bit values, 32 bytes, a run per column.
TRANSPOSE_BAND = 16


def _transposed(data: bytes | memoryview, piece: MxDequantize, rows: int) -> bytes | memoryview:
    """16-bit rows [rows, cols] as they are, or (`transposed_rows`: the window is one expert) as [cols, rows]. Bands
    of TRANSPOSE_BAND rows at a time: numpy's whole-array transpose of 16-bit values strides through memory (about
    9 ns a value on these machines), a band's columns land in short runs that stay in cache (about 1.5 ns)."""
    import numpy as np

    if not piece.transposed_rows:
        return data
    values = np.frombuffer(data, dtype="<u2").reshape(rows, piece.cols)
    out = np.empty((piece.cols, rows), dtype="<u2")
    for r0 in range(0, rows, TRANSPOSE_BAND):
        out[:, r0 : r0 + TRANSPOSE_BAND] = values[r0 : r0 + TRANSPOSE_BAND].T
    return out.data.cast("B")


def _nvfp4_dequantize(sources: _Sources, out: int, piece: Nvfp4Dequantize, source: str) -> RoundingStats:
    """NVFP4 rows written as BF16 or F16, rounded once (`numerics.nvfp4`), window by window, each window's scale
    bytes read beside it. A global scale that is not finite and positive, a NaN scale or a value the output cannot
    hold is refused, named."""
    from fp8fix.numerics.nvfp4 import NVFP4_GROUP, Fp4RangeError, nvfp4_rows, nvfp4_table

    (global_scale,) = _scale_list(sources, piece.global_scale, source)
    table = nvfp4_table(global_scale, piece.out_dtype, piece.multiply)
    row_bytes, groups = piece.cols // 2, piece.cols // NVFP4_GROUP
    window_bytes = max(1, RECODE_WINDOW // row_bytes) * row_bytes
    worst = RoundingStats()
    for buffer, first, length in sources.windows(piece.path, piece.start, piece.end, window_bytes):
        row0, rows = (first - piece.start) // row_bytes, length // row_bytes
        at = piece.scales.start + row0 * groups
        scales = sources.read(piece.scales.path, at, at + rows * groups)
        try:
            data, rounding = nvfp4_rows(
                memoryview(buffer)[:length], scales, piece.cols, table, piece.out_dtype, sources.lookup_arrays
            )
        except Fp4RangeError as e:
            raise InvalidCheckpoint(
                f"{piece.path.name}: NVFP4 weight '{source}' row {row0 + e.row}, group {e.group}: its scale "
                f"'{piece.scales.name}' (e4m3 byte {e.scale_byte:#04x}) over the global scale {global_scale:g} makes "
                f"a value NaN or puts it outside {piece.out_dtype}'s range; cannot write it in {piece.out_dtype}"
            ) from e
        worst.update(rounding)
        _write_all(out, data)
    return worst


def _itemsize(ref: ScaleRef) -> int:
    return BITS[ref.dtype] // 8


def _scale_list(sources: _Sources, ref: ScaleRef, weight: str) -> list[float]:
    """The scale values `ref` points at, each finite and positive, or a clear error naming the scale."""
    values = decode_floats(sources.read(ref.path, ref.start, ref.start + ref.count * _itemsize(ref)), ref.dtype)
    bad = first_invalid_scale(values)
    if bad is not None:
        raise InvalidCheckpoint(
            f"{ref.path.name}: scale '{ref.name}' of weight '{weight}' holds {bad}; scales must be finite and "
            "positive (fp8fix inspect lists every such scale)"
        )
    return values


def _ue8m0_rows(sources: _Sources, piece: Ue8m0Codes) -> BlockRow:
    """One block row at power-of-two scales (`numerics.ue8m0`); NaN codes refused."""
    codes = sources.read(piece.path, piece.start, piece.end)
    nan = NAN_CODES[piece.dtype]
    if any(c in codes for c in nan):
        _refuse_codes(sources, piece, nan, piece.weight, "NaN codes")
    scales = _scale_list(sources, piece.col_scales, piece.weight)
    return ue8m0_rows(codes, piece.dtype, piece.row_bytes, piece.block_cols, scales, piece.vllm)


def _ue8m0_codes(sources: _Sources, out: int, piece: Ue8m0Codes) -> Ue8m0Stats:
    row = _ue8m0_rows(sources, piece)
    sources.exponents[piece] = row.exponents
    _write_all(out, recode(row.codes, piece.recoding) if piece.recoding else row.codes)
    return row.stats


def _ue8m0_scales(sources: _Sources, piece: Ue8m0Scales) -> bytes:
    """The powers of two each block row chose, in the scale's dtype (times `factor`: exact)."""
    exponents = [e for row in piece.rows for e in _ue8m0_exponents(sources, row)]
    return encode_floats([piece.factor * 2.0**e for e in exponents], piece.dtype)


def _ue8m0_exponents(sources: _Sources, row: Ue8m0Codes) -> list[int]:
    """The powers of two a block row chose: from its codes written before, else worked out again."""
    found = sources.exponents.pop(row, None)
    return found if found is not None else _ue8m0_rows(sources, row).exponents


def _mx_scales(sources: _Sources, piece: MxScales) -> bytes:
    """`--blocks mx`: each row's E8M0 bytes, one per 32 elements, of the power of two its block chose."""
    out = bytearray()
    for row in piece.rows:
        try:
            out += e8m0_row_bytes(
                _ue8m0_exponents(sources, row), (row.end - row.start) // row.row_bytes, row.row_bytes, row.block_cols
            )
        except ValueError as e:
            raise UnsupportedCheckpoint(
                f"{row.path.name}: weight '{row.weight}' has no MXFP8 form: {e}; a block whose values are all that "
                "small holds almost nothing: write it unquantized (--dequantize)"
            ) from e
    return bytes(out)


def _mx_block_rows(sources: _Sources, piece: MxBlockCodes) -> ReblockedRows:
    """One block row of MXFP8 (or MXFP4) codes at a power of two per 128 x 128 block (`numerics.mx_blocks`); NaN
    codes and NaN scale bytes refused, named."""
    codes = sources.read(piece.path, piece.start, piece.end)
    nan = NAN_CODES[E4M3FN]
    if piece.element == "e2m1":  # MXFP4: its elements as e4m3fn codes (exact; E2M1 has no NaN)
        codes = e2m1_as_e4m3(codes)
    elif any(c in codes for c in nan):
        _refuse_codes(sources, piece, nan, piece.weight, "NaN codes")
    ref = piece.scales
    scales = sources.read(ref.path, ref.start, ref.start + ref.count)
    if E8M0_NAN in scales:
        raise InvalidCheckpoint(
            f"{ref.path.name}: scale '{ref.name}' of weight '{piece.weight}' holds nan (E8M0 255); scales must be "
            "finite and positive (fp8fix inspect lists every such scale)"
        )
    return reblock_rows(codes, scales, piece.cols)


def _nvfp4_shared(sources: _Sources, piece: Nvfp4Shared, stats: WriteStats) -> bytes:
    """NVFP4 rows at their layer's shared global scale (`numerics.nvfp4_shared`): the packed part counted in
    `stats`, its scale bytes kept for the scale part (worked out again where the scales come first)."""
    key = replace(piece, part="scales")
    sources.scales_to_come.discard(piece)
    if piece.part == "scales" and key in sources.shared_scales:
        return sources.shared_scales.pop(key)
    ref = piece.scales
    try:
        packed, scales, moved = share_rows(
            sources.read(piece.path, piece.start, piece.end),
            sources.read(ref.path, ref.start, ref.start + ref.count),
            piece.cols,
            piece.ratio,
            piece.multiplier,
            piece.first_row,
        )
    except SharedScaleNaN as e:
        raise InvalidCheckpoint(
            f"{ref.path.name}: scale '{ref.name}' of NVFP4 weight '{piece.weight}' is NaN at {e}; scales must be "
            "finite (fp8fix inspect lists every such scale)"
        ) from e
    if piece.part == "scales":
        return scales
    if key in sources.scales_to_come:
        sources.shared_scales[key] = scales
    stats.shared.setdefault(piece.weight, SharedStats()).update(moved)
    return packed


def _exponents_of(sources: _Sources, row: MxBlockCodes) -> list[int]:
    """The powers of two a block row got: from its codes written before, else worked out again."""
    found = sources.exponents.pop(row, None)
    return found if found is not None else _mx_block_rows(sources, row).exponents


def _fill(out: int, piece: Fill) -> None:
    """`piece.value` repeated, in writes of at most RECODE_WINDOW bytes."""
    per_window = max(1, RECODE_WINDOW // max(len(piece.value), 1))
    for first in range(0, piece.times, per_window):
        _write_all(out, piece.value * min(per_window, piece.times - first))


def _pad_rows(sources: _Sources, out: int, piece: PadRows, source: str) -> None:
    """Rows copied (recoded or rescaled as the piece says), each followed by its pad, window by window."""
    if piece.recoding:
        recoding = RECODINGS[piece.recoding]
        _refuse_codes(sources, piece, recoding.forbidden, source, recoding.why)
    rows_per_window = max(1, RECODE_WINDOW // piece.row_bytes)
    window = rows_per_window * piece.row_bytes
    for start in range(piece.start, piece.end, window):
        data: bytes | bytearray = sources.read(piece.path, start, min(piece.end, start + window))
        if piece.recoding:
            data = recode(data, piece.recoding)
        if piece.rescale:
            data = _scaled(bytes(data), *piece.rescale, piece.path, source)
        rows = [data[i : i + piece.row_bytes] for i in range(0, len(data), piece.row_bytes)]
        _write_all(out, piece.pad.join(rows) + piece.pad)

"""Splitting a block-scaled fused weight into per-shard weights with standard block grids.

Each output shard gets its rows (gathered from every group of a grouped module) and a
block grid of ceil(rows / block) rows over them, the grid every runtime expects of an
unfused module. An output block row whose rows all come from one source block row keeps
that row's codes and scales byte for byte: exact. Where a shard boundary, a group
boundary or a per-group grid (MiMo-V2.5's pre-sharded chunks) puts rows of several
source block rows into one output block row, that row's scale, column block by column
block, is the largest of the contributing source scales (the bytes of that source
scale), and the codes of the rows at a smaller scale are requantized to it: float32,
clamp, round to nearest even, reported in fp8 steps. Nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.io.checkpoint import check_scale_values
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import FusedModule
from fp8fix.numerics.dtypes import ITEM_SIZE
from fp8fix.plan.pieces import CopyRange, OutputTensor, Piece, RequantizeBlocks

#: Rows [start, end) of the source weight that share one source block-scale row (`scale_row`).
Run = tuple[int, int, int]


@dataclass
class BlockCounts:
    """Output blocks (block rows x column blocks) of a split: all of them, and those requantized."""

    blocks: int = 0
    requantized: int = 0


def split_block_scaled(
    m: FusedModule, scale: TensorInfo, block: tuple[int, int], names: list[tuple[str, str]]
) -> tuple[dict[str, list[OutputTensor]], BlockCounts]:
    """The output weight and block scale of each shard (`names`: (weight name, scale name) per shard)."""
    w = m.weight
    b0, b1 = block
    row_bytes = w.nbytes // w.shape[0]
    grid_cols = scale.shape[1]
    item = ITEM_SIZE[scale.dtype]
    values = check_scale_values(scale)
    weights: list[OutputTensor] = []
    scales: list[OutputTensor] = []
    counts = BlockCounts()
    for shard, (weight_name, scale_name) in enumerate(names):
        spans = m.shard_segments(shard)
        total = sum(b - a for a, b in spans)
        w_pieces: list[Piece] = []
        s_pieces: list[Piece] = []
        for first in range(0, total, b0):
            runs = _runs(m, spans, first, min(total, first + b0), b0)
            counts.blocks += grid_cols
            scale_rows = {r for _, _, r in runs}
            if len(scale_rows) == 1:  # one source block row: its codes and scales, exactly
                row = scale_rows.pop()
                s_pieces.append(
                    CopyRange(
                        scale.path, scale.start + row * grid_cols * item, scale.start + (row + 1) * grid_cols * item
                    )
                )
                w_pieces += [CopyRange(w.path, w.start + a * row_bytes, w.start + b * row_bytes) for a, b, _ in runs]
                continue
            top = [max(scale_rows, key=lambda r: values[r * grid_cols + c]) for c in range(grid_cols)]
            targets = tuple(values[top[c] * grid_cols + c] for c in range(grid_cols))
            s_pieces += [
                CopyRange(
                    scale.path, scale.start + (r * grid_cols + c) * item, scale.start + (r * grid_cols + c + 1) * item
                )
                for c, r in enumerate(top)
            ]
            counts.requantized += sum(
                any(values[r * grid_cols + c] != targets[c] for r in scale_rows) for c in range(grid_cols)
            )
            for a, b, r in runs:
                start, end = w.start + a * row_bytes, w.start + b * row_bytes
                own = tuple(values[r * grid_cols : (r + 1) * grid_cols])
                if own == targets:
                    w_pieces.append(CopyRange(w.path, start, end, nan_check=w.dtype))
                else:
                    w_pieces.append(RequantizeBlocks(w.path, start, end, w.dtype, row_bytes, b1, own, targets, w.dtype))
        weights.append(OutputTensor(weight_name, w.dtype, (total, *w.shape[1:]), w_pieces, w.name))
        scales.append(OutputTensor(scale_name, scale.dtype, (-(-total // b0), grid_cols), s_pieces, scale.name))
    return {w.name: weights, scale.name: scales}, counts


def _runs(m: FusedModule, spans: list[tuple[int, int]], first: int, end: int, b0: int) -> list[Run]:
    """The source rows of a shard's output rows [first, end), cut where the source block-scale row changes."""
    runs: list[Run] = []
    offset = 0
    for a, b in spans:
        lo, hi = max(first, offset), min(end, offset + b - a)
        if lo < hi:
            row = a + lo - offset
            while row < a + hi - offset:
                scale_row = m.scale_row(row, b0)
                stop = min(a + hi - offset, m.next_block_start(row, b0))
                runs.append((row, stop, scale_row))
                row = stop
        offset += b - a
    return runs

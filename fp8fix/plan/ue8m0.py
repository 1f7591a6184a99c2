"""`--scales ue8m0`: every block scale a power of two, as DeepGEMM on Hopper / Blackwell reads them.

On top of a layout plan that keeps the block-scaled weights (and their scales) as they are: each such
weight is rewritten one block row at a time (`Ue8m0Codes`: codes kept where the block's scale is a power
of two, else requantized once, `numerics.ue8m0`), and its scale tensor is written as the powers of two
those rows chose (`Ue8m0Scales`, in the source's scale dtype: F32, BF16 and E8M0 all hold them exactly).
For `quant_method: fp8` checkpoints `quantization_config.scale_fmt` becomes "ue8m0", as DeepSeek-V3.1
ships (vLLM reads it: transformers_utils/config.py, and sets VLLM_USE_DEEP_GEMM_E8M0). The scales are
read when the rows are written (`ScaleRef`), so planning reads headers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.model import CheckpointModel, Fp8Weight, block_grid
from fp8fix.numerics.dtypes import E4M3FN
from fp8fix.plan.dequantized import scale_values_at
from fp8fix.plan.pieces import OutputShard, OutputTensor, Ue8m0Codes, Ue8m0Scales
from fp8fix.registry.formats import COMPRESSED_TENSORS


@dataclass
class Ue8m0Module:
    """One weight written with power-of-two block scales; the figures are filled in once written."""

    module: str
    weight: str
    blocks: int
    blocks_kept: int | None = None
    blocks_requantized: int | None = None
    blocks_halved: int | None = None
    max_steps: float | None = None  # source fp8 steps, fp8fix's requantization
    rms_steps: float | None = None
    vllm_max_steps: float | None = None  # the same, vLLM 0.32's load-time requantization of SOURCE
    vllm_rms_steps: float | None = None


@dataclass
class Ue8m0Change:
    modules: list[Ue8m0Module] = field(default_factory=list)
    scale_fmt: bool = False  # quantization_config.scale_fmt set to "ue8m0"
    mx: bool = False  # `--blocks mx`: the powers of two written as MXFP8's E8M0 bytes (`plan.block_mx`)


def plan_ue8m0(model: CheckpointModel, shards: list[OutputShard]) -> Ue8m0Change:
    """Rewrite `shards` in place so every block-scaled FP8 weight has power-of-two block scales."""
    fmt = model.require_format()
    if fmt.block is None:
        raise UnsupportedCheckpoint(
            f"--scales ue8m0: {fmt.label} checkpoints have no block scales; UE8M0 is a block-scale format "
            "(DeepGEMM's), for block FP8 and compressed-tensors block checkpoints"
        )
    weights = {w.name: w for w in model.module_weights() if w.scale_kind == "block" and not w.stacked}
    if any(w.tensor.dtype != E4M3FN for w in weights.values()):
        raise UnsupportedCheckpoint(
            "--scales ue8m0: e4m3fnuz weights are ROCm's, where DeepGEMM's UE8M0 scales do not apply; convert "
            "from the e4m3fn checkpoint"
        )
    outputs = {t.source: t for shard in shards for t in shard.tensors}
    change = Ue8m0Change(scale_fmt=fmt.name != COMPRESSED_TENSORS.name)
    for w in weights.values():
        assert w.scale is not None
        weight_out, scale_out = outputs.get(w.name), outputs.get(w.scale.name)
        if not _kept(weight_out, w) or not _kept(scale_out, w, scale=True):
            raise UnsupportedCheckpoint(
                f"--scales ue8m0: the layout rewrites '{w.name}' or its scale; convert with --layout fused (or "
                "the layout that keeps block-scaled modules as they are)"
            )
        assert weight_out is not None and scale_out is not None
        rows = tuple(row_pieces(w, fmt.block))
        weight_out.pieces = list(rows)
        scale_out.pieces = [Ue8m0Scales(rows, w.scale.dtype)]
        change.modules.append(ue8m0_module(w, fmt.block))
    return change


def ue8m0_module(w: Fp8Weight, block: tuple[int, int]) -> Ue8m0Module:
    """The record of a block-scaled weight written at power-of-two scales, with its count of blocks."""
    grid = block_grid(w.tensor.shape, block) if w.fused is None else w.fused.block_grid(block)
    assert grid is not None
    return Ue8m0Module(w.module, w.name, grid[0] * grid[1])


def _kept(out: OutputTensor | None, w: Fp8Weight, scale: bool = False) -> bool:
    """The output tensor is the source tensor copied as it is (under its name)."""
    source = w.scale if scale else w.tensor
    return out is not None and source is not None and out.unchanged and out.nbytes == source.nbytes


def row_pieces(w: Fp8Weight, block: tuple[int, int], vllm: bool = True) -> list[Ue8m0Codes]:
    """One piece per run of rows in one row of the scale grid (pre-sharded chunks restart the grid); `vllm`:
    vLLM's load-time requantization of each worked out beside, for the report."""
    t, scale = w.tensor, w.scale
    assert scale is not None
    rows, cols = t.shape
    grid_cols = block_grid(t.shape, block)[1]
    pieces = []
    first = 0
    while first < rows:
        if w.fused is not None:
            grid_row, last = w.fused.scale_row(first, block[0]), w.fused.next_block_start(first, block[0])
        else:
            grid_row, last = first // block[0], (first // block[0] + 1) * block[0]
        last = min(last, rows)
        pieces.append(
            Ue8m0Codes(
                t.path,
                t.start + first * cols,
                t.start + last * cols,
                t.dtype,
                cols,
                block[1],
                scale_values_at(scale, grid_row * grid_cols, grid_cols),
                w.name,
                vllm=vllm,
            )
        )
        first = last
    return pieces

"""`--tp-bf16`: the modules `--tp` cannot pad, dequantized to BF16 and left unquantized.

Attention projections are split across ranks by heads: padding them would add heads and
change the model. Where a rank's share of one is not whole blocks, vLLM refuses it (o_proj,
MLA's q_b / kv_b) or gives its ranks other rows' block scales (q / k / v). Asked to, fp8fix
writes such a module's weight as BF16 (each code times its block scale, rounded once: the
error is reported) without its scale, and names it in the format's lists of modules left
unquantized (`registry.formats.NameList.unquantized`), so loaders build it as a plain layer,
which splits at any size whose heads divide.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.checkpoint import check_scale_values
from fp8fix.model import CheckpointModel, Fp8Weight
from fp8fix.numerics.dequantize import BF16
from fp8fix.plan.pieces import Dequantize, OutputTensor, Piece


@dataclass
class Bf16Module:
    """One module written in BF16: its weight, and the bytes it grows by (BF16 codes less the scales)."""

    module: str
    weight: str
    added_bytes: int
    max_error: float | None = None  # filled in by convert from the writer's statistics
    max_error_steps: float | None = None  # in BF16 steps at the value (at most 0.5)


def plan_bf16_modules(
    model: CheckpointModel, modules: list[str]
) -> tuple[list[Bf16Module], dict[str, list[OutputTensor]]]:
    """Each module's weight as BF16 pieces, its scales dropped (an empty list of outputs)."""
    fmt = model.require_format()
    assert fmt.block is not None
    weights = {w.module: w for w in model.module_weights()}
    changed: list[Bf16Module] = []
    outputs: dict[str, list[OutputTensor]] = {}
    for module in modules:
        w = weights[module]
        scale = _block_grid(w, fmt.block)
        outputs[w.name] = [OutputTensor(w.name, BF16, w.tensor.shape, _pieces(w, scale, fmt.block), w.name)]
        dropped = [t for t in (w.scale, w.input_scale) if t is not None]
        for t in dropped:
            outputs[t.name] = []
        added = w.tensor.nbytes - sum(t.nbytes for t in dropped)
        changed.append(Bf16Module(module, w.name, added))
    return changed, outputs


def _block_grid(w: Fp8Weight, block: tuple[int, int]) -> list[float]:
    """The weight's block-scale values, checked to be a grid over its blocks."""
    rows, cols = w.tensor.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if w.scale is None or tuple(w.scale.shape) != grid:
        raise UnsupportedCheckpoint(
            f"'{w.name}': --tp-bf16 dequantizes block-scaled weights; this one has no {list(grid)} block scale"
        )
    return check_scale_values(w.scale)


def _pieces(w: Fp8Weight, scales: list[float], block: tuple[int, int]) -> list[Piece]:
    """One piece per block row: its rows' codes and that row of scales."""
    t = w.tensor
    rows, cols = t.shape
    grid_cols = -(-cols // block[1])
    pieces: list[Piece] = []
    for r, first in enumerate(range(0, rows, block[0])):
        last = min(rows, first + block[0])
        row_scales = tuple(scales[r * grid_cols : (r + 1) * grid_cols])
        pieces.append(
            Dequantize(t.path, t.start + first * cols, t.start + last * cols, t.dtype, cols, block[1], row_scales)
        )
    return pieces

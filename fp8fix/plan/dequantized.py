"""FP8 weights written unquantized, in BF16 or F16: `--to bf16`, `--dequantize`, `--tp-bf16`.

Each weight is written as its codes times its scale, rounded once (`numerics.dequantize`), whatever
the scale covers: one value (per tensor, per expert), one per fused shard, one per row, one per
block (a grid over the weight, or one per pre-sharded chunk), one per expert and shard or per
expert and column (stacked experts). Its weight scale and input scale are dropped. The scale
values are read when the rows are written (`ScaleRef`), so planning reads headers only.

`--tp-bf16` (with `--tp`) writes this way the attention modules padding cannot fix: they are
split across ranks by heads, and a rank's share that is not whole blocks is refused by vLLM or
given other rows' scales. `--dequantize` does it for the modules a user keeps in BF16 (`selection.py`). Both name
the modules in the format's lists of modules left unquantized (`registry.formats.NameList.unquantized`),
so loaders build them as plain layers. `--to bf16` writes every FP8 weight so and drops the
quantization config: a plain model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.fp4_modules import Fp4Weight
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import CheckpointModel, Fp8Weight, block_grid
from fp8fix.numerics.dequantize import BF16
from fp8fix.numerics.dtypes import BITS
from fp8fix.plan.pieces import Dequantize, MxDequantize, Nvfp4Dequantize, OutputTensor, Piece, ScaleRef


@dataclass
class Bf16Module:
    """One module written unquantized: its weight, and the bytes it grows by (16-bit values less the scales)."""

    module: str
    weight: str
    added_bytes: int
    max_error: float | None = None  # filled in by convert from the writer's statistics
    max_error_steps: float | None = None  # in steps of the output dtype at the value (at most 0.5)
    dtype: str = BF16
    scheme: str = "fp8"  # what SOURCE held: fp8, or an FP4 module's nvfp4 / mxfp4


def plan_bf16_modules(
    model: CheckpointModel, modules: list[str], out_dtype: str = BF16
) -> tuple[list[Bf16Module], dict[str, list[OutputTensor]]]:
    """Each module's weight written in `out_dtype`, its scales dropped (an empty list of outputs)."""
    weights = {w.module: w for w in model.module_weights()}
    return plan_unquantized_weights(model, [weights[m] for m in modules], out_dtype)


def plan_unquantized_weights(
    model: CheckpointModel, weights: list[Fp8Weight], out_dtype: str = BF16
) -> tuple[list[Bf16Module], dict[str, list[OutputTensor]]]:
    """Each weight written in `out_dtype` under its own name, its weight and input scales dropped."""
    fmt = model.require_format()
    changed: list[Bf16Module] = []
    outputs: dict[str, list[OutputTensor]] = {}
    for w in weights:
        pieces = _mx_pieces(w, out_dtype) if fmt.mx else _pieces(w, fmt.block, out_dtype)
        outputs[w.name] = [OutputTensor(w.name, out_dtype, w.tensor.shape, pieces, w.name)]
        dropped = [t for t in (w.scale, w.input_scale) if t is not None]
        for t in dropped:
            outputs[t.name] = []
        added = w.tensor.nbytes - sum(t.nbytes for t in dropped)
        changed.append(Bf16Module(w.module, w.name, added, dtype=out_dtype))
    return changed, outputs


def plan_fp4_weights(
    weights: list[Fp4Weight], out_dtype: str = BF16
) -> tuple[list[Bf16Module], dict[str, list[OutputTensor]]]:
    """Each FP4 module's weight written in `out_dtype` as `<module>.weight` (a plain Linear's name; gpt-oss's
    experts: `<proj>` [experts, in, out], `_unquantized`), its packed weight's place; its scales and global
    scales dropped. MXFP4: each element exactly E2M1 x 2^(b - 127) in BF16
    (`numerics.mx`); NVFP4: E2M1 x scale / global scale, rounded once (`numerics.nvfp4`)."""
    changed: list[Bf16Module] = []
    outputs: dict[str, list[OutputTensor]] = {}
    for w in weights:
        t, scale = w.packed, w.scale
        assert scale is not None and w.problem is None, "require_convertible refuses an FP4 module it cannot read"
        scales = scale_values_at(scale, 0, scale.numel)
        piece: Piece
        if w.global_scale is not None:
            global_scale = scale_values_at(w.global_scale, 0, 1)
            multiply = w.global_multiplies
            piece = Nvfp4Dequantize(t.path, t.start, t.end, w.cols, scales, global_scale, out_dtype, multiply)
        else:
            per_expert = w.rows // w.experts if w.experts else 0  # gpt-oss: each expert written transposed
            piece = MxDequantize(t.path, t.start, t.end, "e2m1", w.cols, scales, out_dtype, per_expert)
        name, shape = _unquantized(w)
        outputs[t.name] = [OutputTensor(name, out_dtype, shape, [piece], t.name)]
        dropped = [x for x in w.tensors if x is not t]
        outputs.update({x.name: [] for x in dropped})
        added = w.rows * w.cols * 2 - sum(x.nbytes for x in w.tensors)
        changed.append(Bf16Module(w.module, name, added, dtype=out_dtype, scheme=w.scheme or "fp4"))
    return changed, outputs


def _unquantized(w: Fp4Weight) -> tuple[str, tuple[int, ...]]:
    """An FP4 module's weight unquantized: a Linear's `<module>.weight` [out, in]; gpt-oss's experts the parameter
    `<proj>` [experts, in, out], each expert transposed (transformers' GptOssExperts, vLLM's unquantized gpt-oss)."""
    if w.experts:
        return w.module, (w.experts, w.cols, w.rows // w.experts)
    return f"{w.module}.weight", (w.rows, w.cols)


def _pieces(w: Fp8Weight, block: tuple[int, int] | None, out_dtype: str) -> list[Piece]:
    """The weight's rows with the scales that cover them: one piece per run of rows sharing them."""
    scale = w.scale
    if scale is None or w.scale_kind is None:
        raise UnsupportedCheckpoint(f"'{w.name}': no scale of a known shape; it cannot be written unquantized")
    t, kind = w.tensor, w.scale_kind
    if w.stacked:
        return _expert_pieces(w, scale, out_dtype)
    rows, cols = t.shape

    def rows_at(first: int, last: int, col: ScaleRef | None, row: ScaleRef | None, block_cols: int) -> Dequantize:
        start, end = t.start + first * cols, t.start + last * cols
        return Dequantize(t.path, start, end, t.dtype, cols, block_cols, col, row, out_dtype)

    if kind == "tensor":
        return [rows_at(0, rows, scale_values_at(scale, 0, 1), None, cols)]
    if kind == "channel":
        return [rows_at(0, rows, None, scale_values_at(scale, 0, rows), cols)]
    if kind == "shard":
        assert w.fused is not None
        return [rows_at(a, b, scale_values_at(scale, i, 1), None, cols) for i, a, b in w.fused.segments]
    assert kind == "block" and block is not None
    grid_cols = block_grid(t.shape, block)[1]
    pieces: list[Piece] = []
    first = 0
    while first < rows:  # one piece per run of rows in one row of the scale grid
        if w.fused is not None:
            grid_row, last = w.fused.scale_row(first, block[0]), w.fused.next_block_start(first, block[0])
        else:
            grid_row, last = first // block[0], (first // block[0] + 1) * block[0]
        last = min(last, rows)
        pieces.append(rows_at(first, last, scale_values_at(scale, grid_row * grid_cols, grid_cols), None, block[1]))
        first = last
    return pieces


def _mx_pieces(w: Fp8Weight, out_dtype: str) -> list[Piece]:
    """An MX weight (`model.mx_scale_kind`: [out, in] codes, E8M0 [out, in / 32]) as one piece: the writer
    reads its rows and their scale bytes window by window."""
    t, scale = w.tensor, w.scale
    if scale is None or w.scale_kind != "block":
        raise UnsupportedCheckpoint(f"'{w.name}': no MX scale of its shape; it cannot be written unquantized")
    return [MxDequantize(t.path, t.start, t.end, "e4m3", t.shape[1], scale_values_at(scale, 0, scale.numel), out_dtype)]


def _expert_pieces(w: Fp8Weight, scale: TensorInfo, out_dtype: str) -> list[Piece]:
    """Stacked experts [E, in, out], one piece per expert: its in rows of out codes, column scales from
    the expert's scale (one value, one per fused shard of equal widths, or one per column)."""
    t, kind = w.tensor, w.scale_kind
    experts, inner, cols = t.shape
    size = inner * cols
    widths = w.experts.widths if w.experts else []
    if kind == "shard" and len(set(widths)) != 1:
        raise UnsupportedCheckpoint(
            f"'{w.name}': per-shard scales over shards of different widths {widths} cannot be written unquantized yet"
        )
    # (values per expert in the scale tensor, values one expert reads, columns per value)
    per_expert = {
        "tensor": (0, 1, cols),
        "expert": (1, 1, cols),
        "shard": (len(widths), len(widths), widths[0] if widths else cols),
        "channel": (cols, cols, 1),
    }
    stride, count, block_cols = per_expert[kind or "tensor"]
    return [
        Dequantize(
            t.path,
            t.start + e * size,
            t.start + (e + 1) * size,
            t.dtype,
            cols,
            block_cols,
            scale_values_at(scale, e * stride, count),
            None,
            out_dtype,
        )
        for e in range(experts)
    ]


def scale_values_at(scale: TensorInfo, first: int, count: int) -> ScaleRef:
    """Values [first, first + count) of the scale tensor."""
    size = BITS[scale.dtype] // 8
    assert (first + count) * size <= scale.nbytes, f"{scale.name}: values {first}+{count} past its end"
    return ScaleRef(scale.path, scale.start + first * size, count, scale.dtype, scale.name)

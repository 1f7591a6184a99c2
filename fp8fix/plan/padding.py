"""`convert --tp N`: zero-padding MLP intermediates so every tensor-parallel share is whole blocks.

An MLP computes down(act(gate(x)) * up(x)). Rows appended to gate and up whose codes are 0x00
give gate(x) = up(x) = 0 there, so act(0) * 0 = 0 (SiLU, GELU: act(0) = 0) and the zero
columns appended to down add nothing: every output of the model is unchanged, bit for bit. The
intermediate of every MLP (dense, shared experts, routed experts) is padded to the next multiple
of N x block (each rank's share then whole blocks at N and at every divisor of N), its block
scales get rows or columns of 1.0 (they multiply zero codes), and config.json's sizes follow so
loaders allocate the padded shapes. BF16 MLP modules are padded the same way, so config and
weights agree. Modules that cannot be padded without changing the model (attention projections
split by heads) are refused with the sizes that load, or with `--tp-bf16` written in BF16
(`dequantized.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import CheckpointModel
from fp8fix.numerics.dtypes import ITEM_SIZE, encode_floats
from fp8fix.parallel import COMMON_SIZES, ModuleShare, TensorParallelReport, tensor_parallel_report
from fp8fix.plan.dequantized import Bf16Module, plan_bf16_modules
from fp8fix.plan.pieces import CopyRange, Fill, OutputTensor, PadRows, Piece
from fp8fix.registry.expressions import ExpressionError, config_lookup, evaluate
from fp8fix.registry.parallel import mlp_weights, packed_siblings, padded_size_of


@dataclass
class PaddedMlp:
    """One MLP padded: its module path, intermediate before and after, and the bytes it grows by."""

    module: str
    size: str  # the config expression sizing it
    intermediate: int
    padded: int
    added_bytes: int


@dataclass
class TpPadding:
    tp: int
    multiple: int  # every padded intermediate is a multiple of this (tp x block)
    mlps: list[PaddedMlp] = field(default_factory=list)
    config: dict[str, int] = field(default_factory=dict)  # config.json sizes, new values
    outputs: dict[str, list[OutputTensor]] = field(default_factory=dict)  # by source tensor ([]: dropped)
    bf16: list[Bf16Module] = field(default_factory=list)  # `--tp-bf16`: modules written unquantized

    @property
    def added_bytes(self) -> int:
        return sum(m.added_bytes for m in self.mlps) + sum(m.added_bytes for m in self.bf16)

    @property
    def unquantized(self) -> list[str]:
        """The modules OUTPUT leaves unquantized, for the config's lists."""
        return [m.module for m in self.bf16]


def plan_tp_padding(
    model: CheckpointModel, tp: int, bf16: bool = False, dequantized: frozenset[str] | set[str] = frozenset()
) -> TpPadding:
    """The padding that makes a block-scaled checkpoint load at `tp` (and every divisor of it); with
    `bf16`, the modules padding cannot fix written in BF16 instead of refused. `dequantized`: modules
    `--dequantize` writes in BF16 already (no blocks to align)."""
    fmt = model.require_format()
    if fmt.block is None:
        raise UnsupportedCheckpoint(
            f"--tp {tp}: {fmt.label} checkpoints have no block scales: every tensor-parallel size splits them "
            "whole already; convert without --tp"
        )
    b0, b1 = fmt.block
    multiple = tp * math.lcm(b0, b1)
    report = tensor_parallel_report(model, sorted({tp, *COMMON_SIZES}))  # every share, once
    assert report is not None
    unpaddable = _with_packed_siblings(model, _unpaddable(report, tp, bf16, dequantized))
    unpaddable = [m for m in unpaddable if m not in dequantized]
    ckpt = model.checkpoint
    mlps = _mlps(ckpt.tensors)
    _refuse_unknown_mlps(report, tp, mlps, {*unpaddable, *dequantized})
    config = ckpt.config
    padding = TpPadding(tp, multiple)
    padding.bf16, padding.outputs = plan_bf16_modules(model, unpaddable)
    sizes = {mlp: _size_expression(mlp, weights) for mlp, weights in mlps.items()}
    old = {mlp: _evaluate(expr, config, mlp) for mlp, expr in sizes.items()}
    for mlp, weights in mlps.items():
        found = weights["gate_proj"].shape[0]
        if weights["up_proj"].shape[0] != found or weights["down_proj"].shape[1] != found:
            raise UnsupportedCheckpoint(
                f"'{mlp}': gate_proj has {found} rows, up_proj {weights['up_proj'].shape[0]}, down_proj "
                f"{weights['down_proj'].shape[1]} columns: not one intermediate size, nothing to pad to"
            )
        if old[mlp] != found:
            raise UnsupportedCheckpoint(
                f"config.json: '{sizes[mlp]}' is {old[mlp]}, but '{mlp}' has an intermediate of {found}: "
                "the config does not match the weights, so fp8fix cannot say what to pad"
            )
    plain = {expr for expr in sizes.values() if expr.isidentifier()}
    padding.config = {key: _round_up(config[key], multiple) for key in sorted(plain)}
    new_config = {**config, **padding.config}
    for mlp, weights in mlps.items():
        target = _evaluate(sizes[mlp], new_config, mlp)
        if target % multiple:  # an expression of padded sizes that is not itself whole blocks per rank
            raise UnsupportedCheckpoint(f"--tp {tp}: '{mlp}' would be {target}, not a multiple of {multiple}")
        grown = _pad_mlp(model, weights, target, padding)
        padding.mlps.append(PaddedMlp(mlp, sizes[mlp], old[mlp], target, grown))
    return padding


def _unpaddable(
    report: TensorParallelReport, tp: int, bf16: bool, dequantized: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """Modules outside MLPs (split by attention heads) whose share at `tp` is not whole blocks: padding
    them would change the model, so they are refused, or with `bf16` returned to be written in BF16.
    Shares that do not split evenly at all are refused either way: no dtype splits 40 heads 16 ways."""

    def blocked(size: int) -> list[ModuleShare]:
        return [
            s
            for s in report.sizes[size]
            if not s.loads and padded_size_of(_parent(s.module)) is None and s.module not in dequantized
        ]

    at_tp = blocked(tp)
    uneven = [s for s in at_tp if s.per_rank is None]
    if at_tp and (uneven or not bf16):
        shown = uneven or at_tp
        names = ", ".join(sorted({s.module for s in shown})[:3])
        working = ", ".join(str(n) for n in sorted(report.sizes) if not blocked(n)) or "none"
        if uneven:
            fix = "no dtype splits them at this size"
        else:
            fix = "padding them would change the model; --tp-bf16 writes them in BF16 instead"
        raise UnsupportedCheckpoint(
            f"--tp {tp}: {len(shown)} module(s) split by attention heads are not whole blocks per rank "
            f"({names}; {shown[0].message}), and {fix}; sizes whose attention splits whole: {working}"
        )
    return [s.module for s in at_tp]


def _with_packed_siblings(model: CheckpointModel, modules: list[str]) -> list[str]:
    """`modules` and the FP8 shards vLLM packs with them (q with k and v), in checkpoint order."""
    wanted = {sibling for module in modules for sibling in packed_siblings(module)}
    return [w.module for w in model.module_weights() if w.module in wanted]


def _refuse_unknown_mlps(
    report: TensorParallelReport, tp: int, mlps: dict[str, dict[str, TensorInfo]], bf16: set[str]
) -> None:
    """An MLP module whose share is not whole blocks must belong to an MLP fp8fix pads (gate, up and down
    stored apart): a fused gate_up_proj is not padded, and a conversion that leaves it so would not load.
    (`bf16`: the attention modules written in BF16 instead.)"""
    stranded = sorted(
        {s.module for s in report.sizes[tp] if not s.loads and _parent(s.module) not in mlps and s.module not in bf16}
    )
    if stranded:
        raise UnsupportedCheckpoint(
            f"--tp {tp}: '{stranded[0]}' is not whole blocks per rank and fp8fix pads only MLPs whose gate_proj, "
            "up_proj and down_proj are stored apart; convert with --layout unfused first where the model fuses them"
        )


def _parent(module: str) -> str:
    return module.rpartition(".")[0]


def _mlps(tensors: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """MLP module path -> its gate / up / down weights (any dtype), where all three are 2-D."""
    shapes = {name: t.shape for name, t in tensors.items()}
    return {mlp: {p: tensors[n] for p, n in names.items()} for mlp, names in mlp_weights(shapes).items()}


def _size_expression(mlp: str, weights: dict[str, TensorInfo]) -> str:
    expression = padded_size_of(mlp)
    if expression is None:
        raise UnsupportedCheckpoint(
            f"--tp: '{mlp}' is an MLP fp8fix does not know the config.json size of (known: dense mlp, "
            "experts.N, shared_expert, shared_experts); padding it without updating config.json would "
            "make loaders cut it"
        )
    return expression


def _evaluate(expression: str, config: dict[str, Any], mlp: str) -> int:
    try:
        value = evaluate(expression, config_lookup(config, {}))
    except ExpressionError as e:
        raise UnsupportedCheckpoint(f"config.json: cannot size the intermediate of '{mlp}': {e}") from e
    if not isinstance(value, int) or isinstance(value, bool):
        raise UnsupportedCheckpoint(f"config.json: '{expression}' is {value!r}, not a size")
    return value


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pad_mlp(model: CheckpointModel, weights: dict[str, TensorInfo], target: int, padding: TpPadding) -> int:
    """Output tensors of one MLP padded to `target` (none when it is already `target` wide); the bytes added."""
    if weights["gate_proj"].shape[0] == target:
        return 0
    fmt = model.require_format()
    assert fmt.block is not None
    b0, b1 = fmt.block
    added = 0
    for projection, w in weights.items():
        scale = model.checkpoint.tensors.get(fmt.weight_scale_of(w.name))
        item = ITEM_SIZE[w.dtype]
        rows, cols = w.shape
        if projection == "down_proj":  # columns: each row followed by zero codes
            extra = target - cols
            shape = (rows, target)
            pieces: list[Piece] = [PadRows(w.path, w.start, w.end, cols * item, bytes(extra * item))]
        else:  # rows: zero rows after the last
            extra = target - rows
            shape = (target, cols)
            pieces = [CopyRange(w.path, w.start, w.end), Fill(b"\0", extra * cols * item)]
        padding.outputs[w.name] = [OutputTensor(w.name, w.dtype, shape, pieces, w.name)]
        added += extra * (rows if projection == "down_proj" else cols) * item
        if scale is not None and len(scale.shape) == 2:
            padding.outputs[scale.name] = [_padded_grid(scale, projection, shape, (b0, b1))]
            added += padding.outputs[scale.name][0].nbytes - scale.nbytes
    return added


def _padded_grid(scale: TensorInfo, projection: str, shape: tuple[int, int], block: tuple[int, int]) -> OutputTensor:
    """A block grid grown to `shape`'s blocks: new rows (gate, up) or columns (down) of 1.0."""
    rows, cols = scale.shape
    one = encode_floats([1.0], scale.dtype)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    item = ITEM_SIZE[scale.dtype]
    if projection == "down_proj":
        pieces: list[Piece] = [PadRows(scale.path, scale.start, scale.end, cols * item, one * (grid[1] - cols))]
    else:
        pieces = [CopyRange(scale.path, scale.start, scale.end), Fill(one, (grid[0] - rows) * cols)]
    return OutputTensor(scale.name, scale.dtype, grid, pieces, scale.name)

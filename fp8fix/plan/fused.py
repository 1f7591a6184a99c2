"""Planning one fused module (qkv_proj, gate_up_proj, ...) under each layout.

The rules (see docs/layouts.md):
- unfused: the module becomes its per-shard modules; weights, biases and per-channel
  scales are row slices, single scales are repeated, per-shard scale vectors are
  split. Pure byte moves, exact. Block scales: each shard gets a standard block grid
  (`block_split.py`): exact where shard boundaries are block multiples, else only the
  output blocks that mix source blocks are requantized (bounded, reported).
- per-shard: a single weight/input scale becomes a vector of n_shards copies (an input scale only
  beside per-tensor or per-shard weight scales). Exact.
- fused: a per-shard scale vector becomes its largest entry; shards at a smaller
  scale are requantized to it (bounded error, reported). Equal entries change no byte.
- channel: the weight scale becomes one per row ([out, 1]), each row its shard's scale
  (a single scale repeated); per-shard input scales become their largest. Exact: no
  code changes (see `channel.py`, which plans the weights outside fused modules).
"""

from __future__ import annotations

from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.io.checkpoint import check_scale_values
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import FusedModule, scale_kind
from fp8fix.numerics.dtypes import ITEM_SIZE, is_fp8
from fp8fix.plan.block_split import split_block_scaled
from fp8fix.plan.channel import channel_shape
from fp8fix.plan.pieces import CopyRange, ModuleChange, OutputTensor, Piece, RepeatRange, Requantize
from fp8fix.registry.formats import FormatSpec
from fp8fix.vocab import Layout, ScaleKind

#: A fused module's scale tensors and their kinds, by parameter; the output tensors planned, by source tensor.
Scales = dict[str, TensorInfo]
Kinds = dict[str, ScaleKind]
Outputs = dict[str, list[OutputTensor]]

#: Parameters of a fused module fp8fix knows how to split; anything else is refused.
SPLITTABLE = ("weight", "bias")


def plan_fused_module(
    m: FusedModule, fmt: FormatSpec, layout: Layout
) -> tuple[ModuleChange, dict[str, list[OutputTensor]]]:
    """The change to one fused module under `layout`, and the output tensors replacing its source tensors."""
    n = len(m.rows)
    quantized = is_fp8(m.weight.dtype)
    scales = {p: m.params[p] for p in (fmt.weight_scale, fmt.input_scale) if p in m.params}
    kinds: dict[str, ScaleKind] = {
        p: scale_kind(t, m.weight.shape, n, p == fmt.weight_scale, fmt.block, m.block_grid(fmt.block))
        for p, t in scales.items()
    }
    weight_kind: ScaleKind = kinds.get(fmt.weight_scale, "none")
    change = ModuleChange(
        module=m.path,
        weight=m.weight.name,
        fused_module=m.spec.module,
        quantized=quantized,
        scale=weight_kind,
        action="keep",
        reason="",
        shards=[s.shard for s in m.spec.shards],
        rows=list(m.rows),
    )
    known = set(SPLITTABLE) | set(scales)
    unknown = sorted(set(m.params) - known)
    if unknown and layout == "unfused":
        raise UnsupportedCheckpoint(
            f"{m.weight.path.name}: fused module '{m.path}' has tensors fp8fix does not know how to split: "
            + ", ".join(f"{m.path}.{p}" for p in unknown)
        )
    if layout == "unfused":
        return _unfuse(m, fmt, kinds, change)
    outputs: dict[str, list[OutputTensor]] = {}
    if layout == "per-shard":
        for p, t in scales.items():
            # with per-row or block weight scales no loader reads per-shard input scales (vLLM <= 0.5.0 takes
            # per-tensor checkpoints only) and transformers refuses them (issue 24): the input scale stays one
            if kinds[p] == "tensor" and (p == fmt.weight_scale or weight_kind in ("tensor", "shard")):
                outputs[t.name] = [
                    OutputTensor(t.name, t.dtype, (n,), [RepeatRange(t.path, t.start, t.end, n)], t.name)
                ]
        if outputs:
            change.action = "split-scale"
            change.reason = f"one scale for {n} shards; written as a vector of {n} copies"
        else:
            change.reason = "already one scale per shard" if weight_kind == "shard" else _keep_reason(weight_kind)
    elif layout == "fused":
        _fuse_scales(m, fmt, scales, kinds, change, outputs)
    elif layout == "channel":
        _channel_scales(m, fmt, scales, kinds, change, outputs)
    if change.action == "keep" and m.spec.block_grid == "per-group" and weight_kind == "block":
        change.reason = (
            "pre-sharded chunks kept as they are, each with its block grid (a contiguous [q; k; v] is not "
            "offered: runtimes read this module as chunks); runtimes requantize them at load unless the "
            "tensor-parallel size is the chunk count"
        )
    return change, outputs


def _keep_reason(kind: ScaleKind) -> str:
    return {
        "channel": "per-channel scales already cover each row",
        "block": "block scales already cover each block of rows",
        "tensor": "already one scale per fused module",
        "none": "not quantized",
    }.get(kind, "nothing to change")


def _unfuse(
    m: FusedModule, fmt: FormatSpec, kinds: dict[str, ScaleKind], change: ModuleChange
) -> tuple[ModuleChange, dict[str, list[OutputTensor]]]:
    new_paths = [m.spec.unfused_path(m.path, s) for s in m.spec.shards]
    outputs: dict[str, list[OutputTensor]] = {}
    block_note = ""
    if kinds.get(fmt.weight_scale) == "block" and fmt.block:
        scale = m.params[fmt.weight_scale]
        _check_rows(m, scale, (m.block_grid(fmt.block) or (0,))[0])
        names = [(f"{new}.weight", f"{new}.{fmt.weight_scale}") for new in new_paths]
        split, counts = split_block_scaled(m, scale, fmt.block, names)
        outputs.update(split)
        change.blocks, change.blocks_requantized = counts.blocks, counts.requantized
        if counts.requantized:
            block_note = (
                f"; {counts.requantized} of {counts.blocks} {fmt.block[0]}x{fmt.block[1]} blocks mix rows of "
                "several source blocks (shard or chunk boundaries inside a block) and are requantized to the "
                "largest of their scales, every other block kept exactly"
            )
    for param, t in m.params.items():
        if t.name in outputs:
            continue
        kind = kinds.get(param)  # None: a weight or bias, split by rows
        pieces = []
        for i, new in enumerate(new_paths):
            name = f"{new}.{param}"
            if kind == "tensor":
                pieces.append(OutputTensor(name, t.dtype, t.shape, [CopyRange(t.path, t.start, t.end)], t.name))
            elif kind == "shard":
                item = ITEM_SIZE[t.dtype]
                element = CopyRange(t.path, t.start + i * item, t.start + (i + 1) * item)
                pieces.append(OutputTensor(name, t.dtype, fmt.scalar_shape, [element], t.name))
            else:  # weight, bias or per-channel scale: the shard's rows, moved as bytes
                _check_rows(m, t, m.weight.shape[0])
                pieces.append(_row_slices(t, m.shard_segments(i), name))
        outputs[t.name] = pieces
    change.action = "unfuse"
    change.new_modules = new_paths
    grouped = f", gathered from its {len(m.segments) // len(m.rows)} groups" if m.spec.groups else ""
    change.reason = (
        f"runtimes load per-shard names; each shard gets its rows{grouped} "
        + {
            "tensor": "and a copy of the single scale",
            "shard": "and its entry of the scale vector",
            "channel": "and its rows of the channel scale",
            "block": "and a block grid over them",
        }.get(change.scale, "(not quantized)")
        + block_note
    )
    return change, outputs


def _check_rows(m: FusedModule, t: TensorInfo, rows: int) -> None:
    """A tensor split by the weight's rows must have them all (`rows`: of scale blocks for a block scale)."""
    if not t.shape or t.shape[0] != rows:
        raise InvalidCheckpoint(
            f"{t.path.name}: '{t.name}' of fused module '{m.path}' has shape {list(t.shape)}, but splitting "
            f"it by shard needs {rows} rows, as its weight has; the checkpoint is inconsistent"
        )


def _row_slices(t: TensorInfo, segments: list[tuple[int, int]], name: str) -> OutputTensor:
    """A tensor made of row ranges of `t`, in order."""
    row_bytes = t.nbytes // t.shape[0]
    pieces: list[Piece] = [CopyRange(t.path, t.start + a * row_bytes, t.start + b * row_bytes) for a, b in segments]
    rows = sum(b - a for a, b in segments)
    return OutputTensor(name, t.dtype, (rows, *t.shape[1:]), pieces, t.name)


def _fuse_scales(
    m: FusedModule, fmt: FormatSpec, scales: Scales, kinds: Kinds, change: ModuleChange, outputs: Outputs
) -> None:
    """Per-shard scale vectors become one scale: the largest; smaller shards are requantized."""
    for param, t in scales.items():
        if kinds[param] != "shard":
            continue
        values, top = _largest_entry(t, fmt, outputs)
        if param != fmt.weight_scale:
            continue
        if len(set(values)) == 1:
            change.action = "merge-equal-scales"
            change.reason = "all shard scales are equal; one scale, no byte of the weight changes"
            continue
        w = m.weight
        row_bytes = w.nbytes // w.shape[0]
        pieces: list[Piece] = []
        for shard, a, b in m.segments:  # storage order: grouped modules alternate shards
            start, end = w.start + a * row_bytes, w.start + b * row_bytes
            if values[shard] == values[top]:
                pieces.append(CopyRange(w.path, start, end, nan_check=w.dtype))
            else:
                pieces.append(Requantize(w.path, start, end, w.dtype, values[shard], values[top], w.dtype))
        outputs[w.name] = [OutputTensor(w.name, w.dtype, w.shape, list(pieces), w.name)]
        change.action = "requantize"
        change.reason = (
            f"shard scales differ ({', '.join(f'{v:.6g}' for v in values)}); shards requantized to the largest "
            f"({values[top]:.6g}), error bounded by half an fp8 step"
        )
    _input_scales_only(change, outputs)


def _largest_entry(t: TensorInfo, fmt: FormatSpec, outputs: dict[str, list[OutputTensor]]) -> tuple[list[float], int]:
    """A per-shard scale vector written as its largest entry; its values and the index of that entry."""
    values = check_scale_values(t)
    top = max(range(len(values)), key=lambda i: values[i])
    item = ITEM_SIZE[t.dtype]
    element = CopyRange(t.path, t.start + top * item, t.start + (top + 1) * item)
    outputs[t.name] = [OutputTensor(t.name, t.dtype, fmt.scalar_shape, [element], t.name)]
    return values, top


def _input_scales_only(change: ModuleChange, outputs: dict[str, list[OutputTensor]]) -> None:
    """The action and reason of a module whose weight scale stayed as it was."""
    if change.action == "keep" and outputs:
        change.action = "max-input-scale"
        change.reason = "per-shard input scales become their largest, as runtimes do for a fused module"
    elif change.action == "keep":
        change.reason = _keep_reason(change.scale)


def _channel_scales(
    m: FusedModule, fmt: FormatSpec, scales: Scales, kinds: Kinds, change: ModuleChange, outputs: Outputs
) -> None:
    """One weight scale per row, [out, 1]: each row its shard's scale. Per-shard input scales: the largest."""
    rows = m.weight.shape[0]
    for param, t in scales.items():
        kind = kinds[param]
        if param != fmt.weight_scale:
            if kind == "shard":
                _largest_entry(t, fmt, outputs)
            continue
        if kind == "block":
            raise UnsupportedCheckpoint(
                f"{t.path.name}: '{t.name}' holds block scales, which one scale per row cannot hold without "
                "requantizing; the channel layout is for per-tensor and per-shard scales"
            )
        if kind == "channel":
            if t.shape != channel_shape(rows):  # [out] -> [out, 1], same bytes
                outputs[t.name] = [
                    OutputTensor(t.name, t.dtype, channel_shape(rows), [CopyRange(t.path, t.start, t.end)], t.name)
                ]
            continue
        item = ITEM_SIZE[t.dtype]
        pieces: list[Piece] = (
            [RepeatRange(t.path, t.start, t.end, rows)]
            if kind == "tensor"
            else [RepeatRange(t.path, t.start + i * item, t.start + (i + 1) * item, b - a) for i, a, b in m.segments]
        )
        outputs[t.name] = [OutputTensor(t.name, t.dtype, channel_shape(rows), pieces, t.name)]
        change.action = "per-channel-scale"
        change.reason = (
            "shard scales differ; each row keeps its shard's scale as a per-channel [out, 1] scale: exact, "
            "no code changes (a single scale would mean requantizing)"
            if kind == "shard"
            else "one scale repeated for every row as a per-channel [out, 1] scale: exact"
        )
    _input_scales_only(change, outputs)

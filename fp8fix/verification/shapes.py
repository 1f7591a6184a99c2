"""Every OUTPUT tensor's dtype and shape, against what SOURCE and the mapping make it.

The value checks compare bytes and dequantized values, which a reshape leaves alone
(`embed_tokens` [256, 64] as [128, 128], a scale [] as [1]) while loaders would read
the tensor differently or refuse it. The expected shape follows from the source tensor
and where its rows went: a whole tensor keeps its shape, a row split keeps the other
dimensions, a single scale (or one entry of a per-shard scale vector) is the format's
scalar shape, a fused module's single scale repeated per shard is a vector of one per shard,
stacked experts' scales are [experts, shards] or [experts], compressed-tensors output
(from AutoFP8) writes single scales as [1], and the channel layout writes weight scales
as [rows, 1] (one per row of the output weight).
"""

from __future__ import annotations

import math

from fp8fix.numerics.dequantize import BF16, F16
from fp8fix.numerics.dtypes import FP8_WEIGHT_DTYPES
from fp8fix.registry.formats import COMPRESSED_TENSORS
from fp8fix.verification.context import VerifyContext
from fp8fix.verification.mapping import Target


def check_shapes(ctx: VerifyContext, mapping: dict[str, list[Target]], compressed_tensors: bool) -> None:
    """Report each OUTPUT tensor whose dtype or shape is not the one its SOURCE tensor and mapping give."""
    weights = {w.name for w in ctx.model.weights.values()}
    scales = {s.name for w in ctx.model.weights.values() for s in (w.scale, w.input_scale) if s is not None}
    scales |= {t.name for t in ctx.model.kv_cache_scales}
    # a block grid stays a grid, split by rows, even one block wide ([rows / 128, 1], like a per-row
    # scale) or one block in all ([1, 1], like a single scale)
    grids = {w.scale.name for w in ctx.model.weights.values() if w.scale is not None and w.scale_kind == "block"}
    weight_scales = {w.scale.name for w in ctx.model.weights.values() if w.scale is not None} - grids
    scales -= grids
    experts_scales = {  # stacked experts' scales: per-shard [E, shards] or per-expert [E] (plan.experts)
        w.scale.name: {(w.experts.count, len(w.experts.widths)), (w.experts.count,)}
        for w in ctx.model.weights.values()
        if w.experts is not None and w.scale is not None
    }
    # `--blocks 128x128`: an MXFP8 weight's E8M0 grid becomes a float grid per 128 x 128 block (mx_blocks.py
    # checks its values with the weight's)
    # `--blocks mx`: a block grid becomes E8M0 bytes per 32 elements of a row (block_mx.py, the same way)
    reblocked = {w.scale.name: w for w in [*ctx.reblocked.values(), *ctx.block_mx.values()] if w.scale is not None}
    for name, targets in mapping.items():
        t = ctx.src.tensors[name]
        if name in reblocked or name in ctx.renamed:  # (fp4.py, mx_blocks.py check an FP4 module's shape)
            continue
        by_output: dict[str, list[Target]] = {}
        for target in targets:
            by_output.setdefault(target.name, []).append(target)
        for out_name, parts in by_output.items():
            o = ctx.out.tensors[out_name]
            fused = ctx.model.fused.get(name.rpartition(".")[0])
            if name in ctx.padded:  # `--tp`: grown along one axis (padding.py checks how)
                expected = {ctx.padded[name].shape(t.shape)}
            elif name in experts_scales and math.prod(o.shape) > 1:
                expected = {t.shape, *experts_scales[name]}
            elif name in weight_scales and len(o.shape) == 2 and o.shape[1] == 1 and o.shape != t.shape:
                expected = {(_weight_rows(ctx, out_name), 1)}  # the channel layout: one scale per row
            elif name in scales and math.prod(o.shape) == 1:
                expected = _single_scale_shape(ctx, t.shape, compressed_tensors)
            elif name in scales and t.numel == 1 and fused is not None:  # per-shard layout: one entry per shard
                expected = {(len(fused.rows),)}
            elif out_name == name or len(parts) == 1 and (parts[0].start, parts[0].end) == (0, _rows(t.shape)):
                expected = {t.shape}
            else:
                expected = {(sum(p.end - p.start for p in parts), *t.shape[1:])}
            unquantized = {BF16, F16}
            dtypes = (
                unquantized if name in ctx.dequantized else set(FP8_WEIGHT_DTYPES) if name in weights else {t.dtype}
            )
            if o.shape not in expected or o.dtype not in dtypes:
                want = " or ".join(str(list(s)) for s in sorted(expected))
                ctx.report.problem(
                    f"'{out_name}' is {o.dtype} {list(o.shape)}; '{name}' ({t.dtype} {list(t.shape)}) makes it "
                    f"{'/'.join(sorted(dtypes))} {want}"
                )


def _weight_rows(ctx: VerifyContext, scale_name: str) -> int:
    """The rows of the OUTPUT weight a weight scale belongs to (0 when OUTPUT has no such weight)."""
    weight = ctx.out.tensors.get(f"{scale_name.rsplit('.', 1)[0]}.weight")
    return weight.shape[0] if weight is not None and weight.shape else 0


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def _single_scale_shape(ctx: VerifyContext, source: tuple[int, ...], compressed_tensors: bool) -> set[tuple[int, ...]]:
    """The shape of a one-value scale in OUTPUT: [1] in compressed-tensors output, else the source's own
    shape when it held one value, or the format's scalar shape for an entry of a per-shard vector."""
    if compressed_tensors:
        return {COMPRESSED_TENSORS.scalar_shape}
    return {source} if math.prod(source) == 1 else {ctx.fmt.scalar_shape}

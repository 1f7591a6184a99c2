"""Verifying `--tp` padding: the MLPs whose config.json size OUTPUT grew must be SOURCE's tensors with
zeros appended (rows of gate and up, columns of down) and block scales grown to match.

Worked out from the two config.json files and the registry's MLP sizes (`registry.parallel`), never
from the converter's plan: a padded tensor must hold SOURCE's values in its original region (bytes,
or the same values after an encoding change, as elsewhere), zero codes in the padding, and positive
scales over padded blocks (they multiply zeros); the config may change only those sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.model import Fp8Weight
from fp8fix.numerics.dtypes import ITEM_SIZE, is_fp8
from fp8fix.numerics.fp8 import is_power_of_two
from fp8fix.registry.expressions import ExpressionError, config_lookup, evaluate
from fp8fix.registry.parallel import PADDED_SIZES, mlp_weights, padded_size_of
from fp8fix.verification.context import CHUNK_ELEMENTS, Mismatch, VerifyContext, scale_values
from fp8fix.verification.report import WeightCheck
from fp8fix.verification.weights import same_values


@dataclass(frozen=True)
class Padded:
    """A SOURCE tensor OUTPUT holds grown along `axis` (0: rows, 1: columns) from `size` to `padded`."""

    axis: int
    size: int
    padded: int

    def shape(self, source: tuple[int, ...]) -> tuple[int, ...]:
        return (self.padded, source[1]) if self.axis == 0 else (source[0], self.padded)


def padded_sizes(ctx: VerifyContext) -> dict[str, int]:
    """config.json sizes of MLPs (registry.parallel.PADDED_SIZES) that OUTPUT changed: the one edit
    `--tp` makes to config.json, and only where an MLP weight of the model is padded to it (a size no
    padded weight reads, as Phi-3's fused gate_up or a dense model's `moe_intermediate_size`, changed
    is a config the weights do not match: not expected, so config.json's check reports it)."""
    keys = {expression for _, expression in PADDED_SIZES if expression.isidentifier()}
    used: set[str] = set()
    for mlp, names in mlp_weights({n: t.shape for n, t in ctx.src.tensors.items()}).items():
        expression = padded_size_of(mlp)
        if expression is not None and any(name in ctx.padded for name in names.values()):
            used |= set(re.findall(r"[A-Za-z_]\w*", expression))
    src, out = ctx.src.config, ctx.out.config
    return {k: out[k] for k in sorted(keys & used) if k in src and isinstance(out.get(k), int) and out[k] != src[k]}


def padded_tensors(ctx: VerifyContext) -> dict[str, Padded]:
    """SOURCE's MLP weights and block scales that OUTPUT's config.json makes larger, by tensor name."""
    src, fmt = ctx.src, ctx.fmt
    found: dict[str, Padded] = {}
    for mlp, names in mlp_weights({n: t.shape for n, t in src.tensors.items()}).items():
        expression = padded_size_of(mlp)
        if expression is None:
            continue
        try:
            old = evaluate(expression, config_lookup(src.config, {}))
            new = evaluate(expression, config_lookup(ctx.out.config, {}))
        except ExpressionError:
            continue
        if new == old or not isinstance(new, int):
            continue
        for projection, name in names.items():
            axis = 1 if projection == "down_proj" else 0
            found[name] = Padded(axis, src.tensors[name].shape[axis], new)
            scale = src.tensors.get(fmt.weight_scale_of(name))
            if scale is not None and fmt.block and len(scale.shape) == 2:
                found[scale.name] = Padded(axis, scale.shape[axis], -(-new // fmt.block[axis]))
    return found


def check_padded(ctx: VerifyContext, name: str, weight: Fp8Weight | None) -> WeightCheck | None:
    """A padded weight: an FP8 one with its block scale (a WeightCheck), or a BF16 one (bytes). Scale
    values must all be positive (`scale_values`), the padded blocks' included: they multiply zeros."""
    padded = ctx.padded[name]
    t, o = ctx.src.tensors[name], ctx.out.tensors.get(name)
    check = WeightCheck(name, [name], "exact") if weight is not None else None
    try:
        if o is None or o.shape != padded.shape(t.shape) or (o.dtype != t.dtype and not is_fp8(t.dtype)):
            raise Mismatch(f"'{name}' is not SOURCE's {list(t.shape)} padded to {list(padded.shape(t.shape))}")
        ratio = _scale_ratio(ctx, weight) if weight is not None else 1.0
        _compare(ctx, t, o, padded, ratio)
    except Mismatch as e:
        if check is None:  # a BF16 tensor: bytes, no weight record
            ctx.report.problem(str(e))
        else:
            check.mismatched(str(e), e.codes)
    return check


def _scale_ratio(ctx: VerifyContext, weight: Fp8Weight) -> float:
    """The one power of two OUTPUT's block scales are SOURCE's times over the original blocks; the
    padded blocks' scales must be positive (they multiply zero codes)."""
    scale = weight.scale
    if scale is None or scale.name not in ctx.padded:
        raise Mismatch(f"'{weight.name}' is padded, but its block scale is not")
    out = ctx.out.tensors.get(scale.name)
    padded = ctx.padded[scale.name]
    if out is None or out.shape != padded.shape(scale.shape):
        raise Mismatch(
            f"'{scale.name}' is not SOURCE's {list(scale.shape)} padded to {list(padded.shape(scale.shape))}"
        )
    src_values, out_values = scale_values(scale, "SOURCE"), scale_values(out, "OUTPUT")
    rows, cols = scale.shape
    out_cols = out.shape[1]
    kept = [out_values[r * out_cols + c] for r in range(rows) for c in range(cols)]
    ratio = kept[0] / src_values[0]
    if not is_power_of_two(ratio) or kept != [v * ratio for v in src_values]:
        raise Mismatch(f"'{out.name}': the original blocks' scales are not SOURCE's times one power of two")
    return ratio


def _compare(ctx: VerifyContext, t: TensorInfo, o: TensorInfo, padded: Padded, ratio: float) -> None:
    """SOURCE's values in OUTPUT's original region and zero codes in the padding, chunk by chunk of rows:
    SOURCE's rows (for down, each followed by its zero columns), then the rows appended (gate, up)."""
    item = ITEM_SIZE[t.dtype]
    rows, cols = t.shape
    out_rows, out_cols = o.shape
    step = max(1, CHUNK_ELEMENTS // max(out_cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        b = ctx.read_rows(o, r0, r1, out_cols)
        if padded.axis == 1:
            b, pad = _split_rows(b, cols * item, out_cols * item)
            _zeros(pad, o.name, r0, r1)
        _same(ctx.read_rows(t, r0, r1, cols), b, t.dtype, o.dtype, ratio, o.name, r0, cols)
    for r0 in range(rows, out_rows, step):
        r1 = min(out_rows, r0 + step)
        _zeros(ctx.read_rows(o, r0, r1, out_cols), o.name, r0, r1)


def _zeros(pad: bytes, name: str, r0: int, r1: int) -> None:
    if pad.count(0) != len(pad):
        raise Mismatch(f"'{name}' rows {r0}..{r1 - 1}: the padding holds codes other than zero")


def _split_rows(data: bytes, width: int, stride: int) -> tuple[bytes, bytes]:
    """The first `width` bytes of every `stride`-byte row, and the rest of every row."""
    kept = b"".join(data[i : i + width] for i in range(0, len(data), stride))
    rest = b"".join(data[i + width : i + stride] for i in range(0, len(data), stride))
    return kept, rest


def _same(a: bytes, b: bytes, src: str, out: str, ratio: float, name: str, row0: int, cols: int) -> None:
    if not is_fp8(src):
        if src == out and a == b:
            return
        raise Mismatch(f"'{name}' rows from {row0}: the original region is not SOURCE's bytes")
    if not same_values(a, b, src, out, ratio, name, row0, cols):
        raise Mismatch(f"'{name}': codes that round under the encoding change in a padded module (not checked)")

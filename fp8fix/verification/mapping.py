"""Where each SOURCE tensor went in OUTPUT, worked out from names and the registry alone.

Not from the converter's plan: a planner bug cannot vouch for itself. A tensor is
either under its own name in OUTPUT, or, for a fused module of the registry, under
the per-shard names of its shards (rows gathered segment by segment for grouped
layouts, a per-shard scale vector's entry, or the single scale repeated).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fp8fix.registry.formats import LEGACY_RENAMES, compressed_tensors_names
from fp8fix.verification.context import VerifyContext


def current_names(param: str) -> tuple[str, ...]:
    """Today's names of a legacy AutoFP8 parameter (act_scale, kv_scale); () for any other."""
    return tuple(new.lstrip(".") for new in LEGACY_RENAMES.get("." + param, ()))


@dataclass
class Target:
    """Where rows [start, end) of a source tensor went: rows from `out_offset` of `name` in OUTPUT
    (for a per-tensor or per-shard scale: the whole tensor, entry `index` of the source)."""

    name: str
    start: int
    end: int
    index: int | None = None
    out_offset: int = 0


def map_tensors(ctx: VerifyContext) -> dict[str, list[Target]]:
    """Each source tensor -> where it is in OUTPUT: the same name, or the per-shard names of its fused module."""
    out, fmt = ctx.out, ctx.fmt
    mapping: dict[str, list[Target]] = {}
    for name, t in ctx.src.tensors.items():
        rows = t.shape[0] if t.shape else 1
        if name in ctx.dropped:  # the scale of a weight OUTPUT holds unquantized; a plain OUTPUT's kv-cache scale
            if name in out.tensors:
                ctx.report.problem(f"'{name}': OUTPUT holds its weight unquantized, so it must not hold this scale")
            continue
        if name in out.tensors:
            mapping[name] = [Target(name, 0, rows)]
            continue
        module, _, param = name.rpartition(".")
        if name in ctx.renamed:  # an FP4 module's packed weight, now `<module>.weight` (fp4.py, mx_blocks.py)
            mapping[name] = [Target(ctx.renamed[name], 0, rows)]
            continue
        renamed = compressed_tensors_names(name)
        if renamed and all(n in out.tensors for n in renamed):  # legacy AutoFP8 / AMD names, as compressed-tensors
            mapping[name] = [Target(n, 0, rows) for n in renamed]
            continue
        f = ctx.model.fused.get(module)
        if f is not None and f.spec.can_unfuse:
            out_param = next(iter(current_names(param)), param)
            names = [f"{f.spec.unfused_path(module, s)}.{out_param}" for s in f.spec.shards]
            if not all(n in out.tensors for n in names):
                names = [f"{f.spec.unfused_path(module, s)}.{param}" for s in f.spec.shards]
            if all(n in out.tensors for n in names):
                per_shard = t.shape == (len(f.rows),)
                targets: list[Target] = []
                for i, n in enumerate(names):
                    if t.numel == 1 or per_shard:
                        targets.append(Target(n, 0, rows, index=i))
                        continue
                    if fmt.block and param == fmt.weight_scale and len(t.shape) == 2:  # a grid over the shard's rows
                        targets.append(Target(n, 0, -(-f.rows[i] // fmt.block[0])))
                        continue
                    offset = 0
                    for a, b in f.shard_segments(i):  # grouped modules: one segment per group
                        targets.append(Target(n, a, b, out_offset=offset))
                        offset += b - a
                mapping[name] = targets
                continue
        ctx.report.problem(f"tensor '{name}' of SOURCE is missing from OUTPUT")
    claimed = {tg.name for targets in mapping.values() for tg in targets}
    for name in out.tensors:
        if name not in claimed:
            ctx.report.problem(f"OUTPUT has tensor '{name}', which nothing in SOURCE accounts for")
    return mapping


def module_renames(ctx: VerifyContext, mapping: dict[str, list[Target]]) -> dict[str, list[str]]:
    """Fused module -> the per-shard modules OUTPUT holds it under (what config name lists must follow)."""
    return {module: [tg.name.rsplit(".", 1)[0] for tg in targets] for module, targets in _renamed(ctx, mapping)}


def _renamed(ctx: VerifyContext, mapping: dict[str, list[Target]]) -> Iterator[tuple[str, list[Target]]]:
    for name, targets in mapping.items():
        module, _, param = name.rpartition(".")
        if param == "weight" and module in ctx.model.fused and targets[0].name != name:
            yield module, targets

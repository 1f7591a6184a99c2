"""Working out the conversion plan from a checkpoint's headers, its config and the registries.

The rules, per fused module and layout (see README "Layouts"):
- unfused: every fused module becomes its per-shard modules; weights, biases and
  per-channel scales are row slices, single scales are repeated, per-shard scale
  vectors are split. Pure byte moves, exact.
- per-shard: a single weight/input scale becomes a vector of n_shards copies. Exact.
- fused: a per-shard scale vector becomes its largest entry; shards at a smaller
  scale are requantized to it (bounded error, reported). Equal entries change no byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.checkpoint import Checkpoint, check_scale_values
from fp8fix.dtypes import FP8_WEIGHT_DTYPES, ITEM_SIZE, SCALE_DTYPES, is_fp8
from fp8fix.encoding_plan import plan_encoding
from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.experts import find_stacked_experts, is_stacked_experts, plan_experts
from fp8fix.plan import (
    ConversionPlan,
    CopyRange,
    ModuleChange,
    OutputShard,
    OutputTensor,
    Piece,
    RepeatRange,
    Requantize,
)
from fp8fix.registry.architectures import ArchitectureSpec, FusedModuleSpec, architecture_for, known_architectures
from fp8fix.registry.formats import FormatSpec, detect_format
from fp8fix.safetensors_file import TensorInfo

Block = tuple[int, int] | None

#: Parameters of a fused module fp8fix knows how to split; anything else is refused.
SPLITTABLE = ("weight", "bias")


@dataclass
class FusedModule:
    """A fused module found in the checkpoint, with its tensors by parameter name."""

    path: str
    spec: FusedModuleSpec
    rows: list[int]  # rows of each shard in total
    params: dict[str, TensorInfo]
    segments: list[tuple[int, int, int]]  # (shard, first row, end row) in storage order

    def shard_segments(self, shard: int) -> list[tuple[int, int]]:
        return [(a, b) for i, a, b in self.segments if i == shard]

    @property
    def weight(self) -> TensorInfo:
        return self.params["weight"]


def default_layout(arch: ArchitectureSpec) -> str:
    """unfused where the runtimes know per-shard names for every fused module, else per-shard."""
    return "unfused" if arch.fused_modules and all(m.can_unfuse for m in arch.fused_modules) else "per-shard"


def plan_conversion(ckpt: Checkpoint, layout: str | None, to: str | None = None) -> ConversionPlan:
    """The whole conversion: fused-module layout first, then (with `to`) the FP8 encoding."""
    fmt = detect_format(ckpt.config, ckpt.root, set(ckpt.tensors))
    arch_name, arch = architecture_for(ckpt.config)
    chosen = layout or default_layout(arch)
    fused = find_fused_modules(ckpt, arch)
    _check_fp8_weights(ckpt, fmt, arch, {m.path: len(m.rows) for m in fused})
    experts = [x for x in find_stacked_experts(ckpt, arch, fmt) if x.fused]
    replacements: dict[str, list[OutputTensor]] = {}
    changes: list[ModuleChange] = []
    renames: dict[str, list[str]] = {}
    blocked = sorted({m.spec.module for m in fused if not m.spec.can_unfuse} | {f"experts.{x.param}" for x in experts})
    if chosen == "unfused" and blocked:
        raise UnsupportedCheckpoint(
            f"{arch_name}: runtimes know no per-shard names for {', '.join(blocked)}, so there is no unfused "
            "layout; use --layout per-shard or --layout fused"
        )
    for module in fused:
        change, outputs = _plan_module(module, fmt, chosen)
        changes.append(change)
        replacements.update(outputs)
        if change.new_modules:
            renames[module.path] = change.new_modules
    for x in experts:
        change, outputs = plan_experts(x, fmt, chosen)
        changes.append(change)
        replacements.update(outputs)
    shards = [_plan_shard(name, header.metadata, header.tensors, replacements) for name, header in ckpt.shards.items()]
    _check_unique_names(shards)
    encoding = plan_encoding(ckpt, fmt, shards, to) if to else None
    return ConversionPlan(
        source=ckpt.root,
        architecture=arch_name,
        format=fmt,
        layout=chosen,
        layout_was_default=layout is None,
        modules=changes,
        shards=shards,
        renames=renames,
        has_index=ckpt.index is not None,
        encoding=encoding,
        sources=ckpt.tensors,
    )


def _check_fp8_weights(ckpt: Checkpoint, fmt: FormatSpec, arch: ArchitectureSpec, fused_shards: dict[str, int]) -> None:
    """Every FP8 weight is an encoding fp8fix handles and has a scale of a known shape.

    `fused_shards` gives the shard count of each fused module, the only modules
    where a scale vector of that length is a known convention. Stacked experts are
    checked by `find_stacked_experts`.
    """
    fp8 = [t for t in ckpt.tensors.values() if is_fp8(t.dtype)]
    if not fp8:
        raise InvalidCheckpoint(
            f"{ckpt.root.name}: no FP8 tensor in {len(ckpt.shards)} safetensors file(s); not an FP8 checkpoint"
        )
    for t in fp8:
        if t.dtype not in FP8_WEIGHT_DTYPES:
            raise UnsupportedCheckpoint(f"{t.path.name}: tensor '{t.name}' is {t.dtype}; fp8fix handles e4m3 weights")
        if is_stacked_experts(t, arch):
            continue
        if len(t.shape) == 3 and "experts" in t.name:
            known = sorted(name for name, a in known_architectures().items() if a.experts)
            raise UnsupportedCheckpoint(
                f"{t.path.name}: tensor '{t.name}' {list(t.shape)} holds stacked MoE experts, which fp8fix knows "
                f"for {', '.join(known)}; describe this architecture's experts in an --arch-file entry (see README)"
            )
        if not t.name.endswith(".weight") or len(t.shape) != 2:
            raise UnsupportedCheckpoint(
                f"{t.path.name}: tensor '{t.name}' is FP8 but not a 2-D linear weight {t.shape}; not supported yet"
            )
        scale = ckpt.scale_of(t, fmt.weight_scale_of(t.name))
        module = t.name.rsplit(".", 1)[0]
        scale_kind(scale, t.shape, fused_shards.get(module), allow_channel=True, block=fmt.block)
        ckpt.check_scales(scale, fmt.input_scale_of(t.name))


def scale_kind(
    scale: TensorInfo, weight_shape: tuple[int, ...], n_shards: int | None, allow_channel: bool, block: Block = None
) -> str:
    """tensor (one value), shard (one per fused shard), channel (one per row) or block (one per
    rows x columns block); else an error."""
    rows = weight_shape[0]
    if scale.dtype not in SCALE_DTYPES:
        raise UnsupportedCheckpoint(
            f"{scale.path.name}: scale '{scale.name}' is {scale.dtype}; fp8fix reads F32/BF16/F16/E8M0 scales"
        )
    if scale.numel == 1 and len(scale.shape) <= 2:
        return "tensor"
    if block and allow_channel and scale.shape == block_grid(weight_shape, block):
        return "block"
    if n_shards and scale.shape == (n_shards,):
        return "shard"
    if allow_channel and scale.shape in ((rows, 1), (rows,)):
        return "channel"
    grid = f", {list(block_grid(weight_shape, block))} per {block[0]}x{block[1]} block" if block else ""
    raise InvalidCheckpoint(
        f"{scale.path.name}: scale '{scale.name}' has shape {list(scale.shape)}, which fits no known convention "
        f"for a weight of {rows} rows ([] or [1] per tensor, [{rows}, 1] per channel{grid}"
        + (f", [{n_shards}] per fused shard)" if n_shards else ")")
    )


def block_grid(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-weight_shape[0] // block[0]), -(-weight_shape[1] // block[1])


def find_fused_modules(ckpt: Checkpoint, arch: ArchitectureSpec) -> list[FusedModule]:
    by_module: dict[str, dict[str, TensorInfo]] = {}
    for t in ckpt.tensors.values():
        module, _, param = t.name.rpartition(".")
        by_module.setdefault(module, {})[param] = t
    found = []
    for path, params in by_module.items():
        spec = arch.fused_spec_for(path)
        if spec is None or "weight" not in params:
            continue
        rows, segments = arch.row_layout(spec, ckpt.config)
        weight = params["weight"]
        if sum(rows) != weight.shape[0]:
            raise InvalidCheckpoint(
                f"{weight.path.name}: '{weight.name}' has {weight.shape[0]} rows, but config.json makes its shards "
                f"{' + '.join(f'{s.shard} {r}' for s, r in zip(spec.shards, rows, strict=True))} = {sum(rows)}: "
                "the config does not match the weights"
            )
        found.append(FusedModule(path, spec, rows, params, segments))
    return found


def _plan_module(m: FusedModule, fmt: FormatSpec, layout: str) -> tuple[ModuleChange, dict[str, list[OutputTensor]]]:
    n = len(m.rows)
    quantized = is_fp8(m.weight.dtype)
    scales = {p: m.params[p] for p in (fmt.weight_scale, fmt.input_scale) if p in m.params}
    kinds = {
        p: scale_kind(t, m.weight.shape, n, allow_channel=(p == fmt.weight_scale), block=fmt.block)
        for p, t in scales.items()
    }
    weight_kind = kinds.get(fmt.weight_scale, "none")
    change = ModuleChange(
        module=m.path,
        kind=m.spec.module,
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
            if kinds[p] == "tensor":
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
    return change, outputs


def _keep_reason(kind: str) -> str:
    return {
        "channel": "per-channel scales already cover each row",
        "block": "block scales already cover each block of rows",
        "tensor": "already one scale per fused module",
        "none": "not quantized",
    }.get(kind, "nothing to change")


def _unfuse(
    m: FusedModule, fmt: FormatSpec, kinds: dict[str, str], change: ModuleChange
) -> tuple[ModuleChange, dict[str, list[OutputTensor]]]:
    new_paths = [m.spec.unfused_path(m.path, s) for s in m.spec.shards]
    outputs: dict[str, list[OutputTensor]] = {}
    for param, t in m.params.items():
        kind = kinds.get(param, "rows")
        pieces = []
        for i, new in enumerate(new_paths):
            name = f"{new}.{param}"
            if kind == "tensor":
                pieces.append(OutputTensor(name, t.dtype, t.shape, [CopyRange(t.path, t.start, t.end)], t.name))
            elif kind == "shard":
                item = ITEM_SIZE[t.dtype]
                element = CopyRange(t.path, t.start + i * item, t.start + (i + 1) * item)
                pieces.append(OutputTensor(name, t.dtype, fmt.scalar_shape, [element], t.name))
            else:  # weight, bias, per-channel or block scale: the shard's rows, moved as bytes
                block_rows = fmt.block[0] if kind == "block" and fmt.block else 1
                segments = [_block_segment(m, block_rows, a, b) for a, b in m.shard_segments(i)]
                pieces.append(_rows_of(t, segments, name))
        outputs[t.name] = pieces
    change.action = "unfuse"
    change.new_modules = new_paths
    grouped = f", gathered from its {len(m.segments) // len(m.rows)} groups" if m.spec.groups else ""
    change.reason = f"runtimes load per-shard names; each shard gets its rows{grouped} " + (
        {"tensor": "and a copy of the single scale", "shard": "and its entry of the scale vector"}.get(
            change.scale,
            f"and its rows of the {change.scale} scale" if change.scale in ("channel", "block") else "(not quantized)",
        )
    )
    return change, outputs


def _block_segment(m: FusedModule, block_rows: int, r0: int, r1: int) -> tuple[int, int]:
    """Rows [r0, r1) in units of `block_rows` (1 for weights, biases and per-channel scales).

    Exact only when r0 starts a block and r1 ends one: else the block scales would need requantizing.
    """
    total = m.weight.shape[0]
    if r0 % block_rows or (r1 % block_rows and r1 != total):
        row = r0 if r0 % block_rows else r1
        raise UnsupportedCheckpoint(
            f"{m.weight.path.name}: fused module '{m.path}' has a shard boundary at row {row}, "
            f"not a multiple of the {block_rows}-row scale block: splitting its block scales would need requantizing, "
            "which fp8fix does not do silently; use --layout per-shard or --layout fused (they keep the fused weight)"
        )
    return r0 // block_rows, -(-r1 // block_rows)


def _rows_of(t: TensorInfo, segments: list[tuple[int, int]], name: str) -> OutputTensor:
    """A tensor made of row ranges of `t`, in order."""
    row_bytes = t.nbytes // t.shape[0]
    pieces: list[Piece] = [CopyRange(t.path, t.start + a * row_bytes, t.start + b * row_bytes) for a, b in segments]
    rows = sum(b - a for a, b in segments)
    return OutputTensor(name, t.dtype, (rows, *t.shape[1:]), pieces, t.name)


def _fuse_scales(
    m: FusedModule,
    fmt: FormatSpec,
    scales: dict[str, TensorInfo],
    kinds: dict[str, str],
    change: ModuleChange,
    outputs: dict[str, list[OutputTensor]],
) -> None:
    """Per-shard scale vectors become one scale: the largest; smaller shards are requantized."""
    for param, t in scales.items():
        if kinds[param] != "shard":
            continue
        values = check_scale_values(t)
        top = max(range(len(values)), key=lambda i: values[i])
        item = ITEM_SIZE[t.dtype]
        element = CopyRange(t.path, t.start + top * item, t.start + (top + 1) * item)
        outputs[t.name] = [OutputTensor(t.name, t.dtype, fmt.scalar_shape, [element], t.name)]
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
    if change.action == "keep" and outputs:
        change.action = "max-input-scale"
        change.reason = "per-shard input scales become their largest, as runtimes do for a fused module"
    elif change.action == "keep":
        change.reason = _keep_reason(change.scale)


def _plan_shard(
    name: str, metadata: dict[str, str], tensors: dict[str, TensorInfo], replacements: dict[str, list[OutputTensor]]
) -> OutputShard:
    out: list[OutputTensor] = []
    for t in tensors.values():
        out.extend(
            replacements.get(t.name)
            or [OutputTensor(t.name, t.dtype, t.shape, [CopyRange(t.path, t.start, t.end)], t.name)]
        )
    return OutputShard(name, {**metadata, "format": "pt"}, out)


def _check_unique_names(shards: list[OutputShard]) -> None:
    seen: dict[str, str] = {}
    for shard in shards:
        for t in shard.tensors:
            if t.name in seen:
                raise UnsupportedCheckpoint(
                    f"{shard.name}: the output would hold '{t.name}' twice (from '{t.source}'); "
                    "the checkpoint already has the per-shard names of a fused module"
                )
            seen[t.name] = shard.name

"""Stacked MoE experts (Llama-4, Qwen3-VL-MoE): one 3-D FP8 tensor per parameter, [experts, in, out].

`experts.gate_up_proj` holds gate and up side by side on the LAST dimension, so its
shards are columns, not rows. What fp8fix does with it, exactly or not at all:
- per-shard: a scale per tensor (`[]`, `[1]`) or per expert (`[E]`, `[E, 1]`, `[E, 1, 1]`)
  becomes `[E, n_shards]`, each expert's value repeated (the shape of vLLM's
  `w13_weight_scale`). Only scale bytes move; the weight is copied.
- fused: an `[E, n_shards]` scale whose entries agree within each expert becomes `[E]`.
  Unequal entries would mean requantizing strided columns: refused with the reason.
- per-channel scales (`[E, 1, out]`, or FBGEMM's `[E, out, 1]`) already cover each
  shard and are kept; so are the scales of unfused stacked parameters (`down_proj`).
- unfused: no runtime loads per-shard names for stacked experts: refused by the planner.
Block scales on stacked experts are refused: no published layout to check them against.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.checkpoint import Checkpoint
from fp8fix.dtypes import ITEM_SIZE, SCALE_DTYPES, is_fp8
from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.plan import CopyRange, ModuleChange, OutputTensor, Piece, RepeatRange
from fp8fix.registry.architectures import ArchitectureSpec
from fp8fix.registry.formats import FormatSpec
from fp8fix.safetensors_file import TensorInfo, read_values


@dataclass
class StackedExperts:
    """One stacked-experts FP8 tensor with its weight scale; `widths` (the shards' columns) when fused."""

    tensor: TensorInfo
    scale: TensorInfo
    kind: str  # tensor | expert | shard | channel
    experts: int
    param: str  # gate_up_proj, down_proj
    shards: list[str]
    widths: list[int]

    @property
    def fused(self) -> bool:
        return len(self.widths) > 1


def is_stacked_experts(t: TensorInfo, arch: ArchitectureSpec | None) -> bool:
    return len(t.shape) == 3 and arch is not None and arch.experts is not None and arch.experts.matches(t.name)


def find_stacked_experts(ckpt: Checkpoint, arch: ArchitectureSpec, fmt: FormatSpec) -> list[StackedExperts]:
    """Every FP8 stacked-experts tensor, checked against config.json, with the kind of its scale."""
    spec = arch.experts
    if spec is None:
        return []
    count = None
    found = []
    for t in ckpt.tensors.values():
        if not (is_fp8(t.dtype) and is_stacked_experts(t, arch)):
            continue
        if count is None:
            count = arch.size(spec.experts, f"the experts of {spec.module}", ckpt.config)
        param = t.name.rpartition(".")[2]
        shards = spec.fused.get(param, ())
        widths = [arch.size(s.rows, f"shard '{s.shard}' of {spec.module}.{param}", ckpt.config) for s in shards]
        if t.shape[0] != count or (widths and sum(widths) != t.shape[2]):
            expected = f"[{count}, in, {' + '.join(map(str, widths))}]" if widths else f"[{count}, in, out]"
            raise InvalidCheckpoint(
                f"{t.path.name}: stacked experts '{t.name}' are {list(t.shape)}, but config.json makes them "
                f"{expected}: the config does not match the weights"
            )
        scale = ckpt.scale_of(t, fmt.weight_scale_of(t.name))
        kind = experts_scale_kind(scale, t.shape, len(widths), block=fmt.block)
        ckpt.check_scales(scale, fmt.input_scale_of(t.name))
        found.append(StackedExperts(t, scale, kind, count, param, [s.shard for s in shards], widths))
    return found


def experts_scale_kind(scale: TensorInfo, shape: tuple[int, ...], n_shards: int, block: tuple[int, int] | None) -> str:
    """tensor, expert, shard ([E, n_shards], fused parameters only) or channel; else a clear error."""
    experts, _, out = shape
    if scale.dtype not in SCALE_DTYPES:
        raise UnsupportedCheckpoint(
            f"{scale.path.name}: scale '{scale.name}' is {scale.dtype}; fp8fix reads F32/BF16/F16/E8M0 scales"
        )
    if scale.numel == 1 and len(scale.shape) <= 1:
        return "tensor"
    if scale.shape in ((experts,), (experts, 1), (experts, 1, 1)):
        return "expert"
    if n_shards > 1 and scale.shape == (experts, n_shards):
        return "shard"
    if scale.shape in ((experts, 1, out), (experts, out, 1)):
        return "channel"
    if block:
        raise UnsupportedCheckpoint(
            f"{scale.path.name}: block scales '{scale.name}' {list(scale.shape)} on stacked experts are not "
            "supported yet (fp8fix knows no published layout for them to check against)"
        )
    per_shard = f", [{experts}, {n_shards}] per expert and shard" if n_shards > 1 else ""
    raise InvalidCheckpoint(
        f"{scale.path.name}: scale '{scale.name}' has shape {list(scale.shape)}, which fits no known convention for "
        f"stacked experts {list(shape)} ([] per tensor, [{experts}] per expert{per_shard}, "
        f"[{experts}, 1, {out}] per channel)"
    )


def plan_experts(x: StackedExperts, fmt: FormatSpec, layout: str) -> tuple[ModuleChange, dict[str, list[OutputTensor]]]:
    """The change to one fused stacked-experts tensor's scale under `layout` (per-shard or fused)."""
    n, s = len(x.widths), x.scale
    change = ModuleChange(
        module=x.tensor.name,
        kind=f"experts.{x.param}",
        quantized=True,
        scale=x.kind,
        action="keep",
        reason="",
        shards=x.shards,
        rows=x.widths,
    )
    item = ITEM_SIZE[s.dtype]
    pieces: list[Piece] = []
    if layout == "per-shard" and x.kind == "tensor":
        pieces = [RepeatRange(s.path, s.start, s.end, x.experts * n)]
        change.reason = f"one scale for {x.experts} experts x {n} shards; written as [{x.experts}, {n}] copies"
    elif layout == "per-shard" and x.kind == "expert":
        pieces = [RepeatRange(s.path, s.start + e * item, s.start + (e + 1) * item, n) for e in range(x.experts)]
        change.reason = f"one scale per expert for {n} shards; written as [{x.experts}, {n}], each expert's repeated"
    elif layout == "fused" and x.kind == "shard":
        values = read_values(s)
        for e in range(x.experts):
            row = values[e * n : (e + 1) * n]
            if len(set(row)) > 1:
                raise UnsupportedCheckpoint(
                    f"{s.path.name}: '{s.name}' gives expert {e} different shard scales ({', '.join(map(str, row))}); "
                    "merging them would requantize strided columns of the stacked experts, which fp8fix does not do; "
                    "keep --layout per-shard (runtimes take the per-expert max at load time)"
                )
        pieces = [CopyRange(s.path, s.start + e * n * item, s.start + (e * n + 1) * item) for e in range(x.experts)]
        change.reason = f"each expert's {n} shard scales are equal; one scale per expert, no weight byte changes"
    else:
        change.reason = {
            "shard": "already one scale per expert and shard",
            "channel": "per-channel scales already cover each shard's columns",
            "expert": "one scale per expert already serves its shards",
        }.get(x.kind, "one scale already serves every expert and shard")
        return change, {}
    change.action = "split-scale" if layout == "per-shard" else "merge-equal-scales"
    shape = (x.experts, n) if layout == "per-shard" else (x.experts,)
    return change, {s.name: [OutputTensor(s.name, s.dtype, shape, pieces, s.name)]}

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

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.safetensors_file import read_values
from fp8fix.model import Fp8Weight
from fp8fix.numerics.dtypes import ITEM_SIZE
from fp8fix.plan.pieces import CopyRange, ModuleChange, OutputTensor, Piece, RepeatRange
from fp8fix.vocab import Layout


def plan_experts(weight: Fp8Weight, layout: Layout) -> tuple[ModuleChange, dict[str, list[OutputTensor]]]:
    """The change to one fused stacked-experts tensor's scale under `layout` (per-shard or fused)."""
    x, s, kind = weight.experts, weight.scale, weight.scale_kind
    assert x is not None and s is not None and kind is not None, "planned only after require_convertible"
    n = len(x.widths)
    change = ModuleChange(
        module=weight.name,
        weight=weight.name,
        fused_module=f"experts.{x.param}",
        quantized=True,
        scale=kind,
        action="keep",
        reason="",
        shards=x.shards,
        rows=x.widths,
    )
    item = ITEM_SIZE[s.dtype]
    pieces: list[Piece] = []
    if layout == "per-shard" and kind == "tensor":
        pieces = [RepeatRange(s.path, s.start, s.end, x.count * n)]
        change.reason = f"one scale for {x.count} experts x {n} shards; written as [{x.count}, {n}] copies"
    elif layout == "per-shard" and kind == "expert":
        pieces = [RepeatRange(s.path, s.start + e * item, s.start + (e + 1) * item, n) for e in range(x.count)]
        change.reason = f"one scale per expert for {n} shards; written as [{x.count}, {n}], each expert's repeated"
    elif layout == "fused" and kind == "shard":
        values = read_values(s)
        for e in range(x.count):
            row = values[e * n : (e + 1) * n]
            if len(set(row)) > 1:
                raise UnsupportedCheckpoint(
                    f"{s.path.name}: '{s.name}' gives expert {e} different shard scales ({', '.join(map(str, row))}); "
                    "merging them would requantize strided columns of the stacked experts, which fp8fix does not do; "
                    "keep --layout per-shard (runtimes take the per-expert max at load time)"
                )
        pieces = [CopyRange(s.path, s.start + e * n * item, s.start + (e * n + 1) * item) for e in range(x.count)]
        change.reason = f"each expert's {n} shard scales are equal; one scale per expert, no weight byte changes"
    else:
        change.reason = {
            "shard": "already one scale per expert and shard",
            "channel": "per-channel scales already cover each shard's columns",
            "expert": "one scale per expert already serves its shards",
        }.get(kind, "one scale already serves every expert and shard")
        return change, {}
    change.action = "split-scale" if layout == "per-shard" else "merge-equal-scales"
    shape = (x.count, n) if layout == "per-shard" else (x.count,)
    return change, {s.name: [OutputTensor(s.name, s.dtype, shape, pieces, s.name)]}

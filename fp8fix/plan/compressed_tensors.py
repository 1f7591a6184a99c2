"""Writing an AutoFP8 (`quant_method: fp8`) checkpoint as compressed-tensors, byte for byte.

transformers 5.x reads `quant_method: fp8` through its fine-grained FP8 quantizer, which
drops per-tensor `weight_scale`, so an AutoFP8 checkpoint computes with raw codes there
(tests/loaders). The same weights and scales described as compressed-tensors
`float-quantized` load exactly in transformers (compressed-tensors decompresses them)
and in vLLM (its compressed-tensors FP8 scheme): measured in tests/loaders. Nothing is
recomputed: the FP8 codes and scale bytes are copied; per-tensor scales take
compressed-tensors' `[1]` shape; the legacy AutoFP8 names become the current ones
(`act_scale` -> `input_scale`; `kv_scale` -> `k_scale` and `v_scale`, the split vLLM's own
`maybe_remap_kv_scale_name` makes of it; AMD's `k_proj.output_scale` -> the attention's `k_scale`,
which vLLM's compressed-tensors config alone does not map); config.json's quantization_config is rewritten
as compressed-tensors writes it (llm-compressor's FP8 presets):
- one group targeting `Linear` with float 8-bit symmetric weights, `strategy` tensor or
  channel as the scales are, input activations static per tensor or dynamic per token as
  the source says (AutoFP8's `activation_scheme`, Quark's `input_tensors`; ModelOpt FP8 is static);
- `ignore` from AutoFP8's `ignored_layers`; `kv_cache_scheme` when there are kv-cache scales.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from fp8fix.model import CheckpointModel, ignore_linears
from fp8fix.plan.pieces import OutputShard, OutputTensor
from fp8fix.plan.scheme import Scheme, can_write, scheme_of
from fp8fix.registry.formats import COMPRESSED_TENSORS, compressed_tensors_names, quantization_config

__all__ = ["Scheme", "can_write", "scheme_of"]  # re-exported: the planner's one place for compressed-tensors

PER_TENSOR_SHAPE = (1,)


def strategy_of(shards: list[OutputShard], model: CheckpointModel) -> str | None:
    """tensor or channel, as every output weight scale is; None when they are not all one kind
    (a per-shard scale vector has no compressed-tensors form)."""
    scale_names = {w.scale.name for w in model.weights.values() if w.scale is not None}
    shapes = {t.shape for s in shards for t in s.tensors if t.source in scale_names}
    if all(len(shape) <= 1 and math.prod(shape) == 1 for shape in shapes):
        return "tensor"
    if all(len(shape) == 2 and shape[1] == 1 for shape in shapes):
        return "channel"
    return None


def rewrite_tensors(shards: list[OutputShard], model: CheckpointModel) -> None:
    """In place: per-tensor scales get the `[1]` shape, legacy names the current ones."""
    per_tensor = {s.name for w in model.weights.values() for s in (w.scale, w.input_scale) if s is not None}
    per_tensor |= {t.name for t in model.kv_cache_scales}
    for shard in shards:
        out: list[OutputTensor] = []
        for t in shard.tensors:
            if t.source in per_tensor and math.prod(t.shape) == 1 and t.shape != PER_TENSOR_SHAPE:
                t.shape, t.reshaped = PER_TENSOR_SHAPE, True
            names = compressed_tensors_names(t.name)
            if not names:
                out.append(t)
                continue
            out.extend(OutputTensor(name, t.dtype, t.shape, list(t.pieces), t.source) for name in names)
        shard.tensors = out


def compressed_tensors_config(config: dict[str, Any], scheme: Scheme) -> dict[str, Any]:
    """config.json with its quantization_config written as compressed-tensors (`scheme`)."""
    out = copy.deepcopy(config)
    float8 = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {
        "targets": ["Linear"],
        "weights": {**float8, "strategy": scheme.strategy, "dynamic": False},
        # static: one scale per tensor from the checkpoint; dynamic: per token at run time (llm-compressor's
        # FP8_DYNAMIC preset), which vLLM and compressed-tensors compute for dynamic FP8 activations
        "input_activations": {
            **float8,
            "strategy": "token" if scheme.dynamic_input else "tensor",
            "dynamic": scheme.dynamic_input,
        },
    }
    qc: dict[str, Any] = {
        "quant_method": COMPRESSED_TENSORS.name,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(scheme.ignore),
    }
    if scheme.kv_scales:
        qc["kv_cache_scheme"] = {**float8, "strategy": "tensor", "dynamic": False}
    out.pop("compression_config", None)
    out["quantization_config"] = qc
    return out


def linear_group_config(
    config: dict[str, Any], fmt: str, weights: dict[str, Any], activations: dict[str, Any], linears: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """config.json with its quantization config compressed-tensors' one group targeting `Linear` (`weights`,
    `activations`, format `fmt`), for a source of another format; every module of `linears` (OUTPUT's Linear
    modules without an FP8 weight) in `ignore`. And those ignored."""
    out = copy.deepcopy(config)
    out.pop("compression_config", None)
    out["quantization_config"] = {
        "quant_method": COMPRESSED_TENSORS.name,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": [],
    }
    return ignore_linears(out, linears)


def channel_strategy_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """config.json of a compressed-tensors checkpoint whose weight scales became per row: every
    config group with float 8-bit tensor-strategy weights says `strategy: channel`; and the groups changed."""
    out = copy.deepcopy(config)
    groups = (quantization_config(out) or {}).get("config_groups") or {}
    changed = []
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("type") == "float" and weights.get("strategy") == "tensor":
            weights["strategy"] = "channel"
            changed.append(str(name))
    return out, changed

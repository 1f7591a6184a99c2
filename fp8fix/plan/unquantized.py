"""`--to bf16` / `--to float16`: the whole checkpoint written as a plain, unquantized model.

For GPUs without FP8 (A100, A10, RTX 30xx, older ROCm): every FP8 weight of every format and
scale kind becomes its codes times its scale rounded once (`plan.dequantized`), and every FP4
module (NVFP4, MXFP4) its elements' values, under a plain Linear's `weight` name; weight, input
and kv-cache scales are dropped; `quantization_config` goes and `torch_dtype` says the output's
dtype, so every loader builds plain layers; ModelOpt's hf_quant_config.json is not copied.
Module names stay SOURCE's (a fused qkv_proj stays fused: BF16 has no scales to split).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from fp8fix.io.checkpoint import CONFIG
from fp8fix.model import CheckpointModel
from fp8fix.numerics.dequantize import UNQUANTIZED
from fp8fix.plan import planner
from fp8fix.plan.dequantized import plan_fp4_weights, plan_unquantized_weights
from fp8fix.plan.output import output_model
from fp8fix.plan.pieces import ConversionPlan, OutputShard, OutputTensor
from fp8fix.registry.architectures import unregistered_note
from fp8fix.registry.formats import MODELOPT_CONFIG
from fp8fix.verdicts import loader_verdicts

#: config.json keys that say how a checkpoint is quantized: gone from a plain model (`expert_dtype`: DeepSeek-V4's
#: routed experts fp4 / fp8; its inference/model.py builds them BF16 where it is absent, FP4 where it says fp4).
QUANTIZATION_KEYS = ("quantization_config", "compression_config", "expert_dtype")
#: Floating dtypes a loader casts to the model's dtype when it loads them into a plain layer.
FLOAT_DTYPES = ("BF16", "F16")
#: The config.json keys naming the weights' dtype (transformers < 5: torch_dtype; 5: dtype, reading both).
DTYPE_KEYS = ("torch_dtype", "dtype")


def plan_unquantized_model(model: CheckpointModel, to: str, tp: int | None = None) -> ConversionPlan:
    """Every FP8 weight of `model` in `to`'s dtype (`numerics.dequantize.UNQUANTIZED`), every scale
    dropped, the config a plain model's."""
    ckpt = model.checkpoint
    model.require_format()
    arch_name, _ = model.require_architecture()
    model.require_convertible()
    out_dtype, torch_dtype = UNQUANTIZED[to]
    written, replacements = plan_unquantized_weights(model, model.module_weights(), out_dtype)
    fp4_written, fp4_outputs = plan_fp4_weights(list(model.fp4.values()), out_dtype)
    written += fp4_written
    replacements.update(fp4_outputs)
    dropped: dict[str, list[OutputTensor]] = {t.name: [] for t in model.kv_cache_scales}
    replacements.update(dropped)
    shards = [planner.plan_shard(name, h.metadata, h.tensors, replacements) for name, h in ckpt.shards.items()]
    planner.check_pieces_inside_sources(shards, ckpt.tensors)
    config, edits = plain_config(ckpt.config, torch_dtype)
    plan = planner.whole_model_plan(
        model,
        arch_name,
        shards,
        {CONFIG: (config, edits)},
        dequantized=written,
        unquantized=out_dtype,
        dropped_files=[MODELOPT_CONFIG] if (ckpt.root / MODELOPT_CONFIG).is_file() else [],
    )
    if dropped:
        plan.notes.append(
            f"{len(dropped)} kv-cache scale(s) dropped: an unquantized model has no FP8 kv cache to scale "
            "(runtimes that quantize the kv cache themselves compute their own, or use 1.0)"
        )
    kept = kept_dtypes(shards, out_dtype)
    if kept:
        plan.notes.append(
            f"tensors that were not FP8 keep their dtype ({kept}): loaders building the {torch_dtype} model cast "
            f"them to {torch_dtype} at load, rounding once, as for any checkpoint"
        )
    if tp:
        plan.notes.append(
            f"--tp {tp}: nothing to pad: an unquantized model has no block scales, and runtimes split it at any "
            "size that divides its attention heads and MLP sizes"
        )
    if model.spec is None:
        plan.notes.append(unregistered_note(arch_name))
    plan.source_loaders = loader_verdicts(model)
    plan.loaders = loader_verdicts(output_model(plan, model))
    return plan


def plain_config(config: dict[str, Any], torch_dtype: str) -> tuple[dict[str, Any], list[str]]:
    """`config` without its quantization keys, its dtype keys `torch_dtype` (torch_dtype set where none
    is), and one edit line per change."""
    out = copy.deepcopy(config)
    edits = [f"{key}: removed (an unquantized model)" for key in QUANTIZATION_KEYS if out.pop(key, None) is not None]
    keys = [k for k in DTYPE_KEYS if k in out] or ["torch_dtype"]
    for key in keys:
        if out.get(key) != torch_dtype:
            edits.append(f"{key}: {out.get(key)!r} -> {torch_dtype!r}")
            out[key] = torch_dtype
    return out, edits


def kept_dtypes(shards: list[OutputShard], out_dtype: str) -> str:
    """The floating dtypes OUTPUT keeps besides `out_dtype`, with how many tensors each ("BF16: 5"), or ""."""
    counts = Counter(
        t.dtype for shard in shards for t in shard.tensors if t.dtype in FLOAT_DTYPES and t.dtype != out_dtype
    )
    return ", ".join(f"{dtype}: {n}" for dtype, n in sorted(counts.items()))

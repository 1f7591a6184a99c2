"""vLLM's weight-loading rules: 0.32 (`VLLM_RULES`), on ROCm (`ROCM_RULES`) and the era rows since 0.19
(`ERA_RULES`: what they do that 0.32 does not, then 0.32's where they do the same)."""

from __future__ import annotations

from dataclasses import replace

from fp8fix.registry.loader_rows import ERA_RELEASES, VLLM, VLLM_019, VLLM_021, VLLM_ROCM, measured_on
from fp8fix.registry.loader_rule import (
    DAMAGED_SCALE_TESTS,
    FNUZ_RULE,
    MIMO_FIXES,
    MIMO_LOADER_TEST,
    PACKED_REQUANTIZED,
    REAL_LOADER_TESTS,
    UNKNOWN_ARCHITECTURE_REASON,
    UNKNOWN_ARCHITECTURE_TEST,
    VLLM_SCALE_ASSERT,
    Rule,
)

#: vLLM >= 0.32, in priority order (the first rule that holds decides); `ROCM_RULES` and `ERA_RULES` copy them.
VLLM_RULES: tuple[Rule, ...] = (
    Rule(
        VLLM,
        "vllm_unknown_architecture",
        "fails",
        UNKNOWN_ARCHITECTURE_REASON,
        "vllm 0.32 model_executor/models/registry.py _ModelRegistry.inspect_model_cls, _raise_for_unsupported "
        "(names: fp8fix/registry/runtimes/vllm-architectures.json); " + UNKNOWN_ARCHITECTURE_TEST,
    ),
    Rule(
        VLLM,
        "odd_scales",
        "fails",
        "an FP8 weight scale of a shape its layer does not have (AssertionError or IndexError in the weight loader)",
        "vllm 0.32 model_executor/parameter.py PerTensorScaleParameter._load_into_shard_id, BlockQuantScaleParameter; "
        + DAMAGED_SCALE_TESTS,
    ),
    Rule(
        VLLM,
        "vllm_removed_architecture",
        "fails",
        "vLLM 0.25 removed {architecture} (0.24 still registers it; vLLM's message says supported until v0.23.0)",
        "vllm 0.32 model_executor/models/registry.py _PREVIOUSLY_SUPPORTED_MODELS",
    ),
    Rule(
        VLLM,
        "fbgemm",
        "fails",
        "fbgemm_fp8 is deprecated: refused unless --allow-deprecated-quantization",
        "vllm 0.32 config/model.py ModelConfig._verify_quantization (DEPRECATED_QUANTIZATION_METHODS)",
    ),
    Rule(
        VLLM,
        "quark_without_layer_type_config",
        "fails",
        "reads the Quark config's layer_type_quant_config, which this one lacks (AttributeError: 'NoneType' object "
        "has no attribute 'get')",
        "vllm 0.32 quantization/quark/quark.py QuarkConfig._find_matched_config; " + REAL_LOADER_TESTS,
    ),
    Rule(
        VLLM,
        "legacy_names",
        "fails",
        "no parameter named act_scale / kv_scale: the legacy AutoFP8 names are not loaded",
        "vLLM 0.32: no module or parameter named '...act_scale'; " + REAL_LOADER_TESTS,
    ),
    Rule(
        VLLM,
        "unfused_on_transformers_backend",
        "fails",
        "serves {architecture} through its Transformers backend, which has only the fused module names",
        "vllm 0.32 model_executor/models/registry.py _TRANSFORMERS_SUPPORTED_MODELS",
    ),
    Rule(
        VLLM,
        "fnuz_chunked",
        "not-judged",
        "e4m3fnuz weights in pre-sharded chunks: the regrouping at load is measured for e4m3fn only: not judged "
        "(convert --to e4m3fn for vLLM)",
        "vllm 0.32 model_executor/models/mimo_v2.py _shard_fp8_qkv_proj; " + MIMO_LOADER_TEST + " (e4m3fn)",
    ),
    Rule(
        VLLM,
        "chunked_fused",
        "loads",
        "vLLM 0.32 regroups the pre-sharded chunks at load, dequantizing and requantizing every block unless "
        "the tensor-parallel size equals the chunk count (releases before its fixes loaded wrong weights)",
        "vllm 0.32 model_executor/models/mimo_v2.py _shard_fp8_qkv_proj; " + MIMO_FIXES + "; " + MIMO_LOADER_TEST,
    ),
    Rule(
        VLLM,
        "refused_at_tp_1",
        "fails",
        "refuses a block-scaled module whose rows are not whole blocks (fp8fix inspect --tp 1 names it, with "
        "vLLM's message)",
        "vllm 0.32 quantization/utils/fp8_utils.py validate_fp8_block_shape_moe; layers/linear.py "
        "adjust_block_scale_shard; tests/loaders/test_tensor_parallel.py, test_tp_load.py",
    ),
    Rule(
        VLLM,
        "misaligned_block_shards",
        "loads-wrong",
        "packs q / k / v (gate / up) into one layer and puts each shard's block scales at whole-block offsets: "
        "after a shard whose rows are not whole blocks, rows get other blocks' scales (fp8fix inspect --tp 1)",
        "vllm 0.32 model_executor/layers/linear.py adjust_block_scale_shard; tests/loaders/test_tp_load.py",
    ),
    Rule(VLLM, "per_shard_fused", "fails", "asserts a fused-on-disk module's scale has one value", VLLM_SCALE_ASSERT),
    Rule(
        VLLM, "per_shard_input_scales", "fails", "asserts a fused module's input scale has one value", VLLM_SCALE_ASSERT
    ),
    Rule(
        VLLM,
        "channel_scales_under_fp8",
        "fails",
        "quant_method fp8 (AutoFP8) takes per-tensor or block weight scales, not per-channel ones",
        "vLLM 0.32 AssertionError, static or dynamic; " + REAL_LOADER_TESTS,
    ),
    Rule(
        VLLM,
        "missing_scales",
        "loads-wrong",
        "an FP8 weight has no scale: vLLM keeps the scale parameter's initial value (float32 min) and computes "
        "with infinite weights, without an error",
        "vllm 0.32 model_executor/layers/quantization/fp8.py Fp8LinearMethod.create_weights (scales start at "
        "float32 min); " + DAMAGED_SCALE_TESTS,
    ),
    FNUZ_RULE,
    Rule(
        VLLM,
        "packed_requantized",
        "rounded",
        PACKED_REQUANTIZED,
        "vllm 0.32 quantization/utils/w8a8_utils.py requantize_with_max_scale; " + REAL_LOADER_TESTS,
    ),
    Rule(
        VLLM,
        "packed_per_tensor",
        "loads",
        "packs q / k / v and gate / up into one layer; their per-tensor scales are equal, so nothing is requantized",
        "vllm 0.32 quantization/utils/w8a8_utils.py requantize_with_max_scale; " + REAL_LOADER_TESTS,
    ),
)

#: ModelOpt on ROCm: requantizes packed shards with different scales into e4m3fnuz without normalizing first.
ROCM_MODELOPT = Rule(
    VLLM_ROCM,
    "modelopt_requantized",
    "loads-wrong",
    "ModelOpt layers are not normalized to e4m3fnuz on ROCm, yet the packed shards whose scales differ are "
    "requantized through the platform's e4m3fnuz (largest 240): every code above 240 at the largest scale is "
    "clipped, the reverse-order bug (--layout channel keeps every weight)",
    "vllm 0.32 quantization/modelopt.py KFp8StaticTensor.process (requantize_with_max_scale without "
    "normalize_e4m3fn_to_e4m3fnuz), _custom_ops.scaled_fp8_quant (current_platform.fp8_dtype()); "
    + REAL_LOADER_TESTS
    + " (FP8FIX_VLLM_ROCM=1)",
)
#: Rules whose real-loader tests run the CUDA path only: on ROCm the same code, read, not run.
_CUDA_ONLY_TESTS = frozenset({"fnuz_chunked", "chunked_fused", "refused_at_tp_1", "misaligned_block_shards"})


def _on_rocm(rule: Rule) -> Rule:
    """A vLLM >= 0.32 rule as the ROCm row's: the same weight loading, measured with FP8FIX_VLLM_ROCM=1 where
    the rule's test runs it."""
    measured = rule.condition not in _CUDA_ONLY_TESTS
    note = " (FP8FIX_VLLM_ROCM=1)" if measured else "; on ROCm the same code: from source, not run"
    return replace(rule, loader=VLLM_ROCM, evidence=rule.evidence + note)


#: vLLM >= 0.32 on ROCm: vLLM's rules, ModelOpt's clipping before the e4m3fnuz rule.
ROCM_RULES: tuple[Rule, ...] = tuple(
    rocm
    for rule in VLLM_RULES
    for rocm in ((ROCM_MODELOPT, _on_rocm(rule)) if rule is FNUZ_RULE else (_on_rocm(rule),))
)

#: Rules of 0.32 whose tests run on 0.32 only (TP N, MiMo-V2's chunks): on the era releases, read, not run.
_ERA_UNRUN = frozenset({"refused_at_tp_1", "misaligned_block_shards"})


def _in_era(rule: Rule, era: str) -> Rule | None:
    """A vLLM 0.32 rule as an era row's, where the era's releases do the same (measured on both: the real-loader
    suite runs the era releases over the same checkpoints); None where they do not."""
    if rule.condition == "unfused_on_transformers_backend":
        return None  # GLM and GPT-NeoX have model classes of their own before 0.32: per-shard names load
    if rule.condition == "vllm_removed_architecture":
        return None  # still registered in these releases: ERA_FIRST says what they do
    if rule.condition in _ERA_UNRUN:
        note = f"; {measured_on(era)}: the same function, from source, not run"
    else:
        note = f"; {measured_on(era)}: the same ({REAL_LOADER_TESTS})"
    return replace(rule, loader=era, evidence=rule.evidence + note)


#: What the era releases do that 0.32 does not, before the rules they share with it.
ERA_FIRST: tuple[Rule, ...] = (
    Rule(
        VLLM_019,
        "vllm_added_after_020",
        "fails",
        "these releases have no model class for {architecture} (vLLM 0.21 added it)",
        "vllm 0.19-0.20 model_executor/models/registry.py _TEXT_GENERATION_MODELS (no MiMoV2ForCausalLM); from source, "
        "not run",
    ),
    Rule(
        VLLM_019,
        "block_scaled_qkv_fused",
        "fails",
        "splits a fused-on-disk qkv_proj's block scales at its weight's row offsets (RuntimeError: start (0) + "
        "length (...) exceeds dimension size (...)); 0.21 converts the offsets to blocks (--layout unfused loads)",
        "vllm 0.19-0.20 model_executor/layers/linear.py QKVParallelLinear._load_fused_module_from_checkpoint (no "
        "adjust_block_scale_shard, which 0.21 added); " + REAL_LOADER_TESTS + " (vLLM 0.19.0 and 0.20.2)",
    ),
    Rule(
        VLLM_021,
        "vllm_added_after_020",
        "not-judged",
        "{architecture}'s loading is measured on vLLM 0.32 only; its regrouping of pre-sharded chunks changed "
        "within 0.21 - 0.31: not judged",
        "vllm 0.21-0.31 model_executor/models/mimo_v2.py load_weights; " + MIMO_FIXES + "; from source, not run",
    ),
    *(
        Rule(
            era,
            "vllm_removed_architecture",
            "not-judged",
            why + "; its loading is not run here: not judged",
            "vllm 0.19-0.31 model_executor/models/registry.py _TEXT_GENERATION_MODELS (Baichuan's through 0.24); "
            "from source, not run",
        )
        for era, why in (
            (VLLM_019, "these releases register {architecture}"),
            (VLLM_021, "{architecture} is registered through 0.24 and removed in 0.25"),
        )
    ),
)
#: The era rows: their own rules first, then 0.32's where the era does the same.
ERA_RULES: tuple[Rule, ...] = (
    *ERA_FIRST,
    *(copied for era in ERA_RELEASES for rule in VLLM_RULES for copied in (_in_era(rule, era),) if copied is not None),
)

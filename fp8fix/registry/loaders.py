"""What each runtime's loader does with an FP8 checkpoint, as data: rules with their evidence.

`fp8fix.verdicts` works out a checkpoint's facts (from its headers and config only) and
takes, per loader, the first rule whose condition holds; no rule: it loads. Every rule
names its evidence: the loader's source (file and function, at the version named) or
the real-loader test that shows it (tests/loaders/, run against vLLM 0.32's CPU build and
transformers 5.24). The old vLLM rows come from the team's reference notes
(../shared/reference/fp8-checkpoints.md, section 2a).
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.vocab import Verdict

VLLM_LEGACY = "vLLM <= 0.5.0"
VLLM_OLD = "vLLM 0.5.1 - 0.19"
VLLM = "vLLM >= 0.20"
TRANSFORMERS = "transformers"
LOADERS = (VLLM_LEGACY, VLLM_OLD, VLLM, TRANSFORMERS)

REAL_LOADER_TESTS = "tests/loaders/test_real_loaders.py"
MIMO_LOADER_TEST = "tests/loaders/test_mimo_loader.py"
REFERENCE = "shared/reference/fp8-checkpoints.md 2a"
MIMO_FIXES = (
    "vLLM pull requests 42270 (the contiguous reading, nonsense output), 45200 and 57508 (chunk count "
    "and per-chunk scale tiling, merged June and September 2026)"
)
VLLM_SCALE_ASSERT = (
    "vllm 0.32 model_executor/parameter.py PerTensorScaleParameter._load_into_shard_id "
    "(assert loaded_weight.shape[0] == 1); " + REAL_LOADER_TESTS
)


@dataclass(frozen=True)
class Rule:
    """When `condition` (a `verdicts.Facts` field) holds, `loader` gives `verdict`, because `reason`."""

    loader: str
    condition: str
    verdict: Verdict
    reason: str  # may name {architecture}
    evidence: str


#: In priority order per loader: the first rule that holds decides.
RULES: tuple[Rule, ...] = (
    # every loader: nothing recovers a weight without its scale
    *(
        Rule(
            loader,
            "unusable_scales",
            "fails",
            "FP8 weights without a usable scale",
            "a weight cannot be dequantized without its scale",
        )
        for loader in LOADERS
    ),
    *(
        Rule(
            loader,
            "chunked_fused",
            "loads-wrong",
            "reads a pre-sharded fused qkv_proj as one contiguous [Q | K | V]: wrong rows and block scales, "
            "nonsense output",
            MIMO_FIXES,
        )
        for loader in (VLLM_LEGACY, VLLM_OLD)
    ),
    Rule(VLLM_LEGACY, "per_shard_fused", "loads", "expects one scale per shard on fused modules", REFERENCE),
    Rule(VLLM_LEGACY, "one_scale_fused", "fails", "shape mismatch: torch.Size([n]) vs torch.Size([])", REFERENCE),
    Rule(VLLM_OLD, "per_shard_fused", "fails", "asserts a fused-on-disk module carries one scale", REFERENCE),
    Rule(
        VLLM,
        "vllm_removed_architecture",
        "fails",
        "vLLM 0.23 removed {architecture}",
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
        TRANSFORMERS,
        "transformers_missing_architecture",
        "fails",
        "has no model for {architecture} (only the repository's own code, trust_remote_code, loads it)",
        "transformers 5.24 models/auto/configuration_auto.py (no mimo_v2 model type); " + MIMO_LOADER_TEST,
    ),
    Rule(
        TRANSFORMERS,
        "fbgemm",
        "needs-gpu",
        "its FBGEMM FP8 quantizer refuses to load without a GPU",
        "transformers 5.24 quantizers/quantizer_fbgemm_fp8.py validate_environment (requires a GPU or XPU)",
    ),
    Rule(
        TRANSFORMERS,
        "fp8_per_tensor",
        "loads-wrong",
        "quant_method fp8 goes to its fine-grained FP8 quantizer, which reads weight_scale_inv and drops "
        "weight_scale: every weight is its raw FP8 code",
        "transformers 5.24 quantizers/auto.py ('fp8' -> FineGrainedFP8HfQuantizer), quantizer_finegrained_fp8.py "
        "(serialized names weight, weight_scale_inv, activation_scale); " + REAL_LOADER_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "unfused_names",
        "loads-wrong",
        "its model has only the fused modules: they are random-initialised and the per-shard tensors dropped",
        REAL_LOADER_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "per_shard_fused",
        "fails",
        "cannot convert a fused module's per-shard scale vector (RuntimeError in its weight conversion)",
        REAL_LOADER_TESTS,
    ),
)

#: Why a loader takes a checkpoint when no rule stops it, by how its fused modules are stored.
LOADS_BECAUSE: dict[str, dict[str, str]] = {
    VLLM_LEGACY: {"unfused": "Llama-style q/k/v and gate/up names, one scalar scale each"},
    VLLM_OLD: {
        "unfused": "Llama-style names map onto the fused parameter's shards",
        "fused": "single scale detected, requantization skipped",
    },
    VLLM: {
        "unfused": "Llama-style names map onto the fused parameter's shards",
        "fused": "single scale copied into every shard slot",
        "channel": "per-channel scales load row for row into the fused parameter, no requantization",
    },
    TRANSFORMERS: {
        "fused": "one scale per module, fused names",
        "channel": "one scale per row, fused names",
    },
}

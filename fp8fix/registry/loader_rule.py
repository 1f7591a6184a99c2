"""A loader rule (`Rule`: when a fact holds of a checkpoint, what a loader row does and why, with its evidence),
the evidence the rules of several loaders cite, and the rules every vLLM-like row shares."""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.registry.loader_rows import VLLM
from fp8fix.vocab import Verdict

REAL_LOADER_TESTS = "tests/loaders/test_real_loaders.py"
#: vLLM and SGLang pack q / k / v (gate / up) into one layer with one scale: shards with different scales are
#: requantized to the largest at load, through float16 (measured: 0.502 - 0.516 fp8 step at most, issue 14).
PACKED_REQUANTIZED = (
    "packs q / k / v and gate / up into one layer and requantizes the shards whose per-tensor scales differ to "
    "their largest at load: each weight moves by up to half an fp8 step (0.52 measured); --layout channel keeps "
    "every one exactly"
)
MIMO_LOADER_TEST = "tests/loaders/test_mimo_loader.py"
#: vLLM <= 0.5.0 loaded a fused-on-disk module's scale like its weight: one tensor, shape asserted equal.
VLLM_050_LOADER = (
    "vllm 0.5.0 model_executor/layers/linear.py QKVParallelLinear.weight_loader and "
    "MergedColumnParallelLinear.weight_loader (no shard id: assert param_data.shape == loaded_weight.shape); "
    "from source, not run"
)
#: vLLM 0.5.1 - 0.18 took one scale per fused-on-disk module and checked it was one.
VLLM_051_LOADER = (
    "vllm 0.5.1-0.6 model_executor/layers/linear.py adjust_scalar_to_fused_array (assert loaded_weight.shape[0] "
    "== 1), quantization/utils/w8a8_utils.py requantize_with_max_scale (a last slot still at float32 min: "
    "fused on disk, not requantized); from source, not run"
)
BREADTH_TESTS = "tests/loaders/test_breadth_loaders.py"
DAMAGED_SCALE_TESTS = "tests/loaders/test_damaged_scales.py"
TRANSFORMERS_DEQUANTIZE = (
    "transformers 5.24 integrations/finegrained_fp8.py Fp8Dequantize._dequantize_one (block_m = rows // "
    "scale_rows), quantizers/quantizer_finegrained_fp8.py (dequantize=True without a GPU)"
)
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


FNUZ_RULE = Rule(
    VLLM,
    "fnuz_weights",
    "rounded",
    "vLLM creates e4m3fn weight parameters on every platform and casts e4m3fnuz codes into them, rounding each "
    "odd subnormal code (an odd multiple of 2^-10, below 2^-6) to an even one: up to half of e4m3fn's smallest "
    "step times the scale. On ROCm it then converts to e4m3fnuz itself (codes and doubled scales, in the right "
    "order): give it the e4m3fn checkpoint (convert --to e4m3fn)",
    "vllm 0.32 quantization/utils/fp8_utils.py create_fp8_weight_parameter (float8_e4m3fn), "
    "w8a8_utils.py normalize_e4m3fn_to_e4m3fnuz; " + REAL_LOADER_TESTS + " (the --to e4m3fnuz outputs, CUDA path "
    "and FP8FIX_VLLM_ROCM=1)",
)

#: An architecture name vLLM resolves to no model class: refused before any weight is read.
UNKNOWN_ARCHITECTURE_REASON = (
    "no model class named {architecture}: vLLM refuses to start (ValueError: Model architectures "
    "['{architecture}'] are not supported for now){nearest}; fix config.json's architectures"
)
UNKNOWN_ARCHITECTURE_TEST = "tests/loaders/test_config_refusals.py"

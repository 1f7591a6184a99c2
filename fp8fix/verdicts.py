"""Which loaders take a checkpoint, computed from what the checkpoint is (headers + config only).

One function for every command: `inspect` applies it to the checkpoint it reads,
`convert` to the checkpoint it writes (described from the plan's output headers, which
the writer writes byte for byte), so the two can never disagree. The knowledge itself is
data in `registry.loaders`; this module only works out the facts its rules ask about.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.fp4_modules import packed_nvfp4
from fp8fix.io.checkpoint import known_values
from fp8fix.model import CheckpointModel, Fp8Weight, ignore_linears
from fp8fix.numerics.dtypes import E4M3FN, E4M3FNUZ
from fp8fix.registry.formats import (
    GPT_OSS_MXFP4,
    LEGACY_RENAMES,
    MODELOPT_MIXED,
    MODELOPT_MXFP8,
    MODELOPT_NVFP4,
    modelopt_kv_cache,
    quantization_config,
)
from fp8fix.registry.kv_rules import KV_RULES
from fp8fix.registry.loader_rows import CALLS, LOADERS, WITH_PACKAGE
from fp8fix.registry.loaders import (
    DEFAULT_EVIDENCE,
    FP4_RULES,
    LOADS_BECAUSE,
    MX_RULES,
    PLAIN_MODEL,
    PLAIN_MODEL_RULES,
    RULES,
    UNQUANTIZED_EVIDENCE,
)
from fp8fix.registry.parallel import PACKED_SHARDS, packed_siblings
from fp8fix.registry.vllm_names import nearest_vllm_name, vllm_resolves
from fp8fix.vocab import KvVerdict, Verdict

#: Architectures vLLM 0.32 serves through its Transformers backend (fused module names only):
#: vllm/model_executor/models/registry.py _TRANSFORMERS_SUPPORTED_MODELS.
VLLM_TRANSFORMERS_BACKEND = frozenset({"GlmForCausalLM", "GPTNeoXForCausalLM"})
#: Architectures vLLM removed (ibid., _PREVIOUSLY_SUPPORTED_MODELS): Baichuan's, last registered in 0.24.
VLLM_REMOVED = frozenset({"BaichuanForCausalLM", "BaiChuanForCausalLM"})
#: Architectures vLLM 0.20 and earlier have no model class for (models/registry.py; 0.21 added MiMo-V2's).
VLLM_ADDED_AFTER_020 = frozenset({"MiMoV2ForCausalLM"})
#: Architectures vLLM registered in 0.10.1 (models/registry.py): gpt-oss. The oldest rows have no model class for it.
VLLM_ADDED_IN_010 = frozenset({"GptOssForCausalLM"})
#: DeepSeek-V4's architecture names: every loader has its own model class for it (vLLM from 0.20), none run here.
DEEPSEEK_V4_ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM"})
#: Architectures whose checkpoints load in transformers only through their repository's modeling code
#: (`auto_map`, trust_remote_code): ChatGLM2/3 and GLM-4's first releases (THUDM).
REMOTE_CODE = frozenset({"ChatGLMModel", "ChatGLMForConditionalGeneration"})
#: Architectures whose SGLang 0.5.23 loading the real-loader suite runs (its other model classes: not judged).
SGLANG_MEASURED = frozenset({"LlamaForCausalLM", "Phi3ForCausalLM", "GlmForCausalLM"})
#: ... of which SGLang serves through its Transformers backend (srt/models/transformers.py): GLM-4 (hf).
SGLANG_TRANSFORMERS_BACKEND = frozenset({"GlmForCausalLM"})
#: Architectures transformers 5.24 has no model for (models/auto: MiMo-V2.5's `mimo_v2` is absent, only
#: `mimo_v2_flash`); loading needs the repository's own code.
TRANSFORMERS_MISSING = frozenset({"MiMoV2ForCausalLM"})


#: What each fact means, for the table of rules in docs/loader-rules.md (scripts/loader_tables.py).
FACT_DESCRIPTIONS = {
    "unread_format": "a quantization format fp8fix does not read yet (ModelOpt's and Quark's MX and FP4, "
    "compressed-tensors schemes other than FP8, MXFP8, NVFP4 and MXFP4: the format line names it)",
    "fp4_modules": "FP4 modules (compressed-tensors NVFP4 or MXFP4), alone or beside FP8 ones",
    "fp4_unmeasured": "FP4 modules in a checkpoint unlike those run (see verdicts._fp4_unmeasured)",
    "mxfp4_modules": "MXFP4 modules (E2M1, an E8M0 scale per 32)",
    "nvfp4_global_scales_differ": "NVFP4 q / k / v or gate / up modules whose global scales differ",
    "nvfp4_global_scales_unread": "NVFP4 q / k / v or gate / up modules whose global scales were not read (headers "
    "only)",
    "mx_unmeasured": "compressed-tensors MXFP8 unlike the checkpoints run (a missing or misshapen scale, e4m3fnuz, "
    "kv-cache scales, unfused names, a targeted Linear without an MX weight)",
    "mx_blocks": "compressed-tensors MXFP8 (E8M0 scale per 32 elements of a row); only these rules and the "
    "architecture's apply",
    "missing_scales": "an FP8 weight without a scale tensor",
    "odd_scales": "an FP8 weight scale of a shape no convention fits (not per tensor, shard, row or block)",
    "per_shard_fused": "a fused module with one weight scale per shard",
    "one_scale_fused": "a fused module with one weight scale (or per-channel / block scales)",
    "chunked_fused": "a fused module pre-sharded in chunks, each with its own block grid (MiMo-V2.5)",
    "channel_fused": "every fused module with per-channel weight scales ([out, 1], one per row)",
    "per_shard_input_scales": "a fused module with one static input scale per shard",
    "unfused_names": "per-shard module names (q_proj, ...) where the model fuses them",
    "unfused_on_transformers_backend": "per-shard names, and an architecture vLLM serves through its "
    "Transformers backend (GLM, GPT-NeoX)",
    "vllm_removed_architecture": "an architecture vLLM removed (Baichuan)",
    "phi3_rope_factors": "a Phi-3 config (model_type phi3) whose rope_scaling short_factor / long_factor lists "
    "are not half its rotary dimension long (Phi3Config refuses it)",
    "vllm_unknown_architecture": "an architecture name vLLM resolves to no model class (not registered, no "
    "transformers class, no auto_map: a typo such as Phi3ForCasualLM)",
    "vllm_added_after_020": "an architecture vLLM registered after 0.20 (MiMo-V2.5)",
    "vllm_added_in_010": "an architecture vLLM registered in 0.10.1 (gpt-oss)",
    "deepseek_v4": "a DeepSeek-V4 model (DeepseekV4ForCausalLM), whose loaders are not run here",
    "gpt_oss_experts": "gpt-oss's MXFP4 experts (quant_method mxfp4: stacked *_blocks / *_scales)",
    "modelopt_mxfp8": "a ModelOpt MXFP8 checkpoint (quant_algo MXFP8: e4m3fn weights, E8M0 scales per 32)",
    "modelopt_mixed": "a ModelOpt MIXED_PRECISION checkpoint (FP8 and NVFP4 layers by quantized_layers)",
    "modelopt_mixed_scales_differ": "ModelOpt MIXED_PRECISION NVFP4 q / k / v or gate / up whose weight_scale_2 differ",
    "modelopt_nvfp4": "a ModelOpt NVFP4 checkpoint (quant_algo NVFP4: packed `weight`, `weight_scale_2`)",
    "modelopt_nvfp4_scales_differ": "ModelOpt NVFP4 q / k / v or gate / up modules whose weight_scale_2 differ",
    "block_scaled_qkv_fused": "a q / k / v module fused on disk (qkv_proj) with block scales",
    "transformers_missing_architecture": "an architecture transformers has no model for (MiMo-V2.5)",
    "fp8_per_tensor": "quant_method fp8 without weight_block_size (AutoFP8)",
    "channel_scales_under_fp8": "quant_method fp8 with per-channel weight scales",
    "legacy_names": "the legacy AutoFP8 names act_scale / kv_scale",
    "refused_at_tp_1": "a block-scaled module vLLM refuses at TP 1 (`inspect --tp 1` names it, with the message)",
    "misaligned_block_shards": "block scales, and a module vLLM packs with others (q / k / v, gate / up) whose "
    "scales its loader does not line up with the rows at TP 1 (`inspect --tp 1`: wrong-scales)",
    "fbgemm": "quant_method fbgemm_fp8",
    "fnuz_weights": "e4m3fnuz weights",
    "fnuz_chunked": "e4m3fnuz weights in a fused module pre-sharded in chunks (MiMo-V2.5)",
    "modelopt_requantized": "a ModelOpt checkpoint with modules vLLM packs (q / k / v, gate / up) whose per-tensor "
    "scales differ (or cannot be read: headers only)",
    "fnuz_compressed_tensors": "e4m3fnuz weights in a compressed-tensors checkpoint",
    "packed_per_tensor": "modules vLLM packs into one layer (q / k / v, gate / up), each with a per-tensor scale",
    "packed_requantized": "modules vLLM packs into one layer (q / k / v, gate / up) whose per-tensor scales differ "
    "(or cannot be read: headers only)",
    "unfused_names_compressed_tensors": "per-shard module names where the model fuses them, in a "
    "compressed-tensors checkpoint",
    "block_scales": "block-scaled FP8 weights",
    "block_scales_inv": "block-scaled FP8 weights whose scales are named weight_scale_inv (quant_method fp8)",
    "block_not_whole": "block-scaled FP8 weights a layer of which is not whole blocks at TP 1 (inspect --tp 1)",
    "weight_only_blocks": "compressed-tensors block FP8 weights with no input_activations (weight-only, W8A16)",
    "weight_only_blocks_unfused": "weight-only compressed-tensors block FP8 (above) without a block-scaled fused "
    "qkv_proj",
    "remote_code_architecture": "an architecture only its repository's own code loads (ChatGLM)",
    "modelopt": "a ModelOpt checkpoint (hf_quant_config.json)",
    "block_grid_indivisible": "block FP8 (quant_method fp8), a weight whose shape its scale grid does not divide "
    "(not whole blocks)",
    "block_grid_misread": "block FP8 (quant_method fp8), a weight that is not whole blocks but whose shape its "
    "scale grid divides (q of 192 rows: 96 per grid row)",
    "quark": "quant_method quark",
    "quark_without_layer_type_config": "a Quark config without layer_type_quant_config",
    "unquantized": "no FP8 tensor and no quantization config: a plain (BF16 / F16) model",
    "kv_scales": "kv-cache scales (k_scale / v_scale, or the format's names)",
    "sglang_unmeasured_architecture": "an architecture whose SGLang model class the suite does not run (not Llama, "
    "Phi-3 or GLM)",
    "sglang_transformers_backend": "an architecture SGLang serves through its Transformers backend (GLM)",
    "unquantized_packed_shards": "a compressed-tensors or Quark checkpoint with FP8 weights whose q / k / v (gate / "
    "up), apart on disk, are plain BF16 / F16 modules (left unquantized, `--dequantize`)",
    "kv_cache_declared": "kv-cache scales, and a quantization config that declares an FP8 kv cache "
    "(compressed-tensors kv_cache_scheme, ModelOpt kv_cache_quant_algo)",
    "kv_scales_under_fp8": "kv-cache scales under quant_method fp8 (AutoFP8, AMD's exports)",
    "kv_cache_scheme": "kv-cache scales, and a compressed-tensors config with kv_cache_scheme",
    "targets_unquantized_linears": "a compressed-tensors config whose targets take a Linear module that holds no "
    "FP8 weight (lm_head not in `ignore`)",
}


@dataclass(frozen=True)
class Facts:
    """What the loaders' rules ask about a checkpoint."""

    architecture: str
    missing_scales: bool  # an FP8 weight with no scale tensor
    odd_scales: bool  # a weight scale of no known shape
    per_shard_fused: bool  # a fused linear module with one weight scale per shard
    one_scale_fused: bool  # a fused linear module with a single (or per-channel / block) weight scale
    chunked_fused: bool  # a fused module stored in pre-sharded chunks with a block grid per chunk
    channel_fused: bool  # every fused FP8 module with per-channel weight scales (one per row)
    per_shard_input_scales: bool  # a fused module's static input scale with one value per shard
    unfused_names: bool  # per-shard module names where the registry knows a fused module
    unfused_on_transformers_backend: bool
    vllm_removed_architecture: bool
    transformers_missing_architecture: bool
    fp8_per_tensor: bool  # quant_method fp8 without weight_block_size (AutoFP8)
    channel_scales_under_fp8: bool
    legacy_names: bool  # act_scale / kv_scale
    fbgemm: bool
    refused_at_tp_1: bool = False  # `inspect --tp 1` reports a module vLLM refuses (parallel.py)
    misaligned_block_shards: bool = False  # `inspect --tp 1` reports a packed layer's scales shifted (wrong-scales)
    targets_unquantized_linears: bool = False  # compressed-tensors targets a Linear without FP8 weights
    modelopt: bool = False
    fnuz_weights: bool = False
    fnuz_chunked: bool = False  # e4m3fnuz weights and chunked_fused
    modelopt_requantized: bool = False  # ModelOpt, packed modules whose scales differ: vLLM requantizes at load
    fnuz_compressed_tensors: bool = False
    packed_per_tensor: bool = False  # q / k / v or gate / up apart, each with one scale: vLLM packs them
    packed_requantized: bool = False  # ... and their scales differ: vLLM requantizes them to the largest
    unfused_names_compressed_tensors: bool = False
    block_scales: bool = False
    block_scales_inv: bool = False  # ... named weight_scale_inv (quant_method fp8: DeepSeek-V3 / Qwen3)
    block_not_whole: bool = False  # ... and a layer of them not whole blocks at TP 1 (vLLM refuses or misreads it)
    weight_only_blocks: bool = False  # compressed-tensors block weights, a config group without input_activations
    weight_only_blocks_unfused: bool = False  # ... and no block-scaled fused qkv_proj (0.19 - 0.20 refuse those)
    remote_code_architecture: bool = False
    block_grid_indivisible: bool = False  # block FP8: a weight whose shape the scale grid does not divide
    block_grid_misread: bool = False  # block FP8: rows / grid rows (or columns) is not the block
    vllm_added_after_020: bool = False
    vllm_added_in_010: bool = False  # ... registered in 0.10.1: gpt-oss
    deepseek_v4: bool = False  # DeepSeek-V4 (`DEEPSEEK_V4_ARCHITECTURES`): `registry.loaders.DEEPSEEK_V4_RULES`
    gpt_oss_experts: bool = False  # gpt-oss's MXFP4 experts (`registry.formats.GPT_OSS_MXFP4`)
    modelopt_nvfp4: bool = False  # ModelOpt NVFP4 (`registry.formats.MODELOPT_NVFP4`)
    modelopt_mixed: bool = False  # ModelOpt MIXED_PRECISION (`registry.formats.MODELOPT_MIXED`)
    modelopt_mixed_scales_differ: bool = False  # ... whose packed NVFP4 modules' weight_scale_2 differ
    modelopt_mxfp8: bool = False  # ModelOpt MXFP8 (`registry.formats.MODELOPT_MXFP8`): judged by MX_RULES
    modelopt_nvfp4_scales_differ: bool = False  # ... packed modules whose weight_scale_2 differ
    block_scaled_qkv_fused: bool = False  # a fused-on-disk q / k / v module with block scales
    quark: bool = False
    quark_without_layer_type_config: bool = False
    unquantized: bool = False  # no FP8 tensor, no quantization_config: a plain model (`convert --to bf16`)
    kv_scales: bool = False  # kv-cache scales (model.kv_cache_scales)
    sglang_unmeasured_architecture: bool = False
    sglang_transformers_backend: bool = False
    unquantized_packed_shards: bool = False  # compressed-tensors / Quark: plain q / k / v beside FP8 weights
    kv_cache_declared: bool = False  # ... and the config declares an FP8 kv cache vLLM reads
    kv_scales_under_fp8: bool = False  # ... under quant_method fp8, which declares none vLLM reads
    kv_cache_scheme: bool = False  # ... declared by compressed-tensors' kv_cache_scheme
    vllm_unknown_architecture: bool = False  # vLLM resolves config.json's name to no model class
    unread_format: bool = False  # a quantization format fp8fix does not read yet (format_error: unsupported)
    fp4_modules: bool = False  # FP4 modules (NVFP4 / MXFP4, `model.fp4`): judged by `registry.loaders.FP4_RULES`
    fp4_unmeasured: bool = False  # ... of a kind the real loaders were not run on (see `_fp4_unmeasured`)
    mxfp4_modules: bool = False  # ... MXFP4 among them
    nvfp4_global_scales_differ: bool = False  # NVFP4 modules vLLM / SGLang pack into one layer, global scales unequal
    nvfp4_global_scales_unread: bool = False  # ... whose global scales were not read (headers only)
    mx_blocks: bool = False  # an MX checkpoint (compressed-tensors MXFP8): judged by `registry.loaders.MX_RULES` only
    mx_unmeasured: bool = False  # ... of a kind the real loaders were not run on (see `_mx_unmeasured`)
    phi3_rope_factors: bool = False  # a Phi-3 config whose LongRoPE factor lists do not fit (Phi3Config refuses)
    rope: str = ""  # what is wrong with them, for the reason
    nearest_architecture: str = ""  # the vLLM name closest to an unknown one, for the reason

    @property
    def layout(self) -> str:
        if self.unfused_names:
            return "unfused"
        if self.channel_fused:
            return "channel"
        return "fused" if self.one_scale_fused or self.per_shard_fused else ""


@dataclass(frozen=True)
class KvCacheVerdict:
    """What a loader's call does with the checkpoint's kv-cache scales (`registry.loaders.KV_RULES`)."""

    verdict: KvVerdict
    reason: str
    evidence: str


@dataclass(frozen=True)
class LoaderVerdict:
    verdict: Verdict
    reason: str
    evidence: str  # the loader source or real-loader test behind it, or the notes it is cited from
    kv_cache: KvCacheVerdict | None = None  # None: the checkpoint has no kv-cache scales
    #: A package users may install that changes this row (`registry.loaders.WITH_PACKAGE`), and the row with it
    #: installed: both outcomes, each measured; "" / None where no package changes it.
    package: str = ""
    installed: LoaderVerdict | None = None

    @property
    def loads(self) -> bool:
        return self.verdict == "loads"


@dataclass(frozen=True)
class Rounding:
    """What a scan of a checkpoint's e4m3fnuz weights found (`inspect --scan-data`): how many of their codes a
    loader holding e4m3fn parameters rounds (the odd codes below 2^-6, which e4m3fn has no code for), of how
    many, and the largest absolute error that makes: half an e4m3fn step times the largest scale of a tensor
    holding one (None: no such code, or its scales unread)."""

    codes: int
    weights: int
    max_error: float | None

    def to_json(self) -> dict[str, object]:
        return {"rounded_codes": self.codes, "fnuz_weights": self.weights, "max_abs_error": self.max_error}


def scanned(verdicts: dict[str, LoaderVerdict], rounding: Rounding | None) -> dict[str, LoaderVerdict]:
    """The rows with what a scan counted: a `rounded` row (an e4m3fnuz checkpoint in e4m3fn parameters) that
    rounds no code loads exactly; one that does says how many codes and how far. Without a scan: as they are."""
    if rounding is None:
        return verdicts
    return {loader: _scanned_row(v, rounding) for loader, v in verdicts.items()}


def _scanned_row(v: LoaderVerdict, rounding: Rounding) -> LoaderVerdict:
    if v.installed is not None:
        v = replace(v, installed=_scanned_row(v.installed, rounding))
    if v.verdict != "rounded":
        return v
    if rounding.codes == 0:
        said = f"; scanned: none of its {rounding.weights:,} e4m3fnuz weights is such a code, every value is kept"
        return replace(v, verdict="loads", reason=v.reason + said)
    error = "" if rounding.max_error is None else f", at most {rounding.max_error:.3g} absolute"
    said = f"; scanned: {rounding.codes:,} of {rounding.weights:,} weights round, by half an e4m3fn step{error}"
    return replace(v, reason=v.reason + said)


def verdicts_json(verdicts: dict[str, LoaderVerdict]) -> dict[str, dict[str, object]]:
    """The verdicts as JSON: `loads` (kept from schema 1), `verdict`, `reason`, `evidence`, the row's
    `call` (the call it models), `measured` (the real loader runs in the test suite) and `how` (where),
    `kv_cache_scales`: what that call does with the checkpoint's kv-cache scales (null: it has none), and
    `with_package`: where an optional package changes the row, the package and the row with it installed (the
    same fields; null otherwise)."""
    return {loader: _verdict_json(loader, v) for loader, v in verdicts.items()}


def _verdict_json(loader: str, v: LoaderVerdict) -> dict[str, object]:
    installed = None
    if v.installed is not None:
        row = WITH_PACKAGE_ROWS[v.package]
        installed = {"package": v.package, "row": row, **_verdict_json(row, v.installed)}
    return {
        "loads": v.loads,
        "verdict": v.verdict,
        "reason": v.reason,
        "evidence": v.evidence,
        "call": CALLS[loader].call,
        "measured": CALLS[loader].measured,
        "how": CALLS[loader].how,
        "kv_cache_scales": None
        if v.kv_cache is None
        else {"verdict": v.kv_cache.verdict, "reason": v.kv_cache.reason, "evidence": v.kv_cache.evidence},
        "with_package": installed,
    }


#: The row each optional package's outcome is, by package.
WITH_PACKAGE_ROWS = {package: row for package, row in WITH_PACKAGE.values()}


def verdict_line(loader: str, verdict: str, reason: str) -> str:
    """One loader row of the text output; a row no real loader measured says so."""
    mark = "" if CALLS[loader].measured else " [from source, not run]"
    return f"  {verdict:<11}  {loader}: {reason}{mark}"


def package_line(package: str, verdict: str, reason: str) -> str:
    """A row's other outcome, under it: what the loader does with an optional package installed."""
    return f"  {'':<11}    with {package} installed: {verdict}: {reason}"


def kv_cache_line(kv: dict[str, str]) -> str | None:
    """What each row's call does with the kv-cache scales (loader -> used / ignored / not-judged), in one line;
    None without kv-cache scales."""
    if not kv:
        return None
    groups = {v: [name for name, got in kv.items() if got == v] for v in ("used", "ignored", "not-judged")}
    said = "; ".join(f"{v.replace('-', ' ')}: {', '.join(names)}" for v, names in groups.items() if names)
    return f"  kv-cache scales: {said}"


def calls_line() -> str:
    """The calls the measured rows model, in a few words (`--json`: each row's full call and how it is known)."""
    rows: dict[str, list[str]] = {}  # rows that make the same call, named once
    for name in LOADERS:  # the rows shown (an optional package's row says its call in --json)
        call = CALLS[name]
        if call.measured:
            rows.setdefault(call.short, []).append(name)
    calls = "; ".join(f"{', '.join(names)}: {short}" for short, names in rows.items())
    return f"  as called: {calls} (--json: each row's call, non-default arguments that matter)"


def facts_of(model: CheckpointModel) -> Facts:
    """The facts the loader rules read, derived once per description (`--target` judges the source for
    every candidate)."""
    facts = model.once("facts", _derive_facts)
    assert isinstance(facts, Facts)
    return facts


def _derive_facts(model: CheckpointModel) -> Facts:
    weights = [w for w in model.weights.values() if w.is_module_weight]
    fused = [w for w in weights if w.fused is not None]
    unfused_suffixes = tuple(
        s.unfused for spec in (model.spec.fused_modules if model.spec else ()) for s in spec.shards if s.unfused
    )
    unquantized = not model.weights and not model.fp4 and quantization_config(model.checkpoint.config) is None
    plain = model.plain_linears()  # one pass over every tensor name, for three facts (and for planning)
    modules = plain if unquantized else [w.module for w in weights]
    unfused = not model.fused and bool(unfused_suffixes) and any(m.endswith(unfused_suffixes) for m in modules)
    fmt = None if unquantized else model.format  # a ModelOpt side file beside a plain config is not read
    fnuz = any(w.tensor.dtype == E4M3FNUZ for w in weights)
    chunked = any(w.fused is not None and w.fused.spec.block_grid == "per-group" for w in fused)
    modelopt = fmt is not None and fmt.name == "modelopt"
    kv_declared = bool(model.kv_cache_scales) and _declares_kv_cache(model)  # may read hf_quant_config.json
    fp8 = model.is_autofp8
    architecture = model.architecture or ""
    at_tp_1 = _at_tp_1(model)
    unknown = bool(architecture) and not vllm_resolves(architecture, model.checkpoint.config)
    rope = rope_misfit(model.checkpoint.config)
    mx = fmt is not None and fmt.mx
    targeted = bool(ignore_linears(model.checkpoint.config, plain)[1])  # Linears the config targets, no FP8 weight
    block_qkv_fused = any(
        w.scale_kind == "block" and {s.shard for s in w.fused.spec.shards} == {"q", "k", "v"}
        for w in fused
        if w.fused is not None
    )
    weight_only = (
        fmt is not None
        and fmt.name == "compressed-tensors"
        and fmt.block is not None
        and _weight_only_group(model.checkpoint.config)
    )
    global_scales = _nvfp4_global_scales(model)
    requantized = packed_scales_differ(model)  # vLLM requantizes packed shards at load (ModelOpt's on ROCm: clips)
    return Facts(
        architecture=architecture,
        missing_scales=any(w.scale is None for w in weights),
        odd_scales=any(w.scale is not None and w.scale_kind is None for w in weights),
        per_shard_fused=any(w.scale_kind == "shard" for w in fused),
        one_scale_fused=any(w.scale_kind in ("tensor", "channel", "block") for w in fused),
        chunked_fused=chunked,
        channel_fused=bool(fused) and all(w.scale_kind == "channel" for w in fused),
        per_shard_input_scales=any(
            w.input_scale is not None and w.n_shards > 1 and w.input_scale.shape == (w.n_shards,) for w in fused
        ),
        unfused_names=unfused,
        unfused_on_transformers_backend=unfused and architecture in VLLM_TRANSFORMERS_BACKEND,
        vllm_removed_architecture=architecture in VLLM_REMOVED,
        vllm_unknown_architecture=unknown,
        nearest_architecture=_nearest(architecture) if unknown else "",
        phi3_rope_factors=bool(rope),
        rope=rope,
        unread_format=isinstance(model.format_error, UnsupportedCheckpoint) and not unquantized,
        fp4_modules=bool(model.fp4),
        fp4_unmeasured=bool(model.fp4) and _fp4_unmeasured(model, weights, unfused or targeted),
        mxfp4_modules=any(w.scheme == "mxfp4" for w in model.fp4.values()),
        nvfp4_global_scales_differ="differ" in global_scales,
        nvfp4_global_scales_unread="unread" in global_scales,
        mx_blocks=mx,
        mx_unmeasured=mx and _mx_unmeasured(model, weights, unfused or targeted),
        vllm_added_after_020=architecture in VLLM_ADDED_AFTER_020,
        vllm_added_in_010=architecture in VLLM_ADDED_IN_010,
        deepseek_v4=architecture in DEEPSEEK_V4_ARCHITECTURES,
        gpt_oss_experts=bool(model.fp4) and fmt is not None and fmt.name == GPT_OSS_MXFP4.name,
        modelopt_nvfp4=bool(model.fp4) and fmt == MODELOPT_NVFP4,
        modelopt_mixed=fmt is not None and fmt.label == MODELOPT_MIXED.label,
        modelopt_mixed_scales_differ=fmt is not None
        and fmt.label == MODELOPT_MIXED.label
        and "differ" in global_scales,
        modelopt_mxfp8=fmt == MODELOPT_MXFP8,
        modelopt_nvfp4_scales_differ=bool(model.fp4) and fmt == MODELOPT_NVFP4 and "differ" in global_scales,
        block_scaled_qkv_fused=block_qkv_fused,
        transformers_missing_architecture=architecture in TRANSFORMERS_MISSING,
        fp8_per_tensor=fp8,
        channel_scales_under_fp8=fp8 and any(w.scale_kind == "channel" for w in weights),
        legacy_names=any(name.endswith(tuple(LEGACY_RENAMES)) for name in model.checkpoint.tensors),
        fbgemm=fmt is not None and fmt.name == "fbgemm_fp8",
        modelopt=modelopt,
        modelopt_requantized=modelopt and requantized,
        unfused_names_compressed_tensors=unfused and fmt is not None and fmt.name == "compressed-tensors",
        packed_per_tensor=bool(packed_groups(model)),
        packed_requantized=requantized,
        fnuz_weights=fnuz,
        fnuz_chunked=fnuz and chunked,
        fnuz_compressed_tensors=fnuz and fmt is not None and fmt.name == "compressed-tensors",
        block_scales=any(w.scale_kind == "block" for w in weights),
        block_not_whole=bool(at_tp_1),
        weight_only_blocks=weight_only,
        weight_only_blocks_unfused=weight_only and not block_qkv_fused,
        block_scales_inv=fmt is not None
        and fmt.weight_scale == "weight_scale_inv"
        and any(w.scale_kind == "block" for w in weights),
        remote_code_architecture=architecture in REMOTE_CODE,
        quark=fmt is not None and fmt.name == "quark",
        quark_without_layer_type_config=fmt is not None
        and fmt.name == "quark"
        and not isinstance((quantization_config(model.checkpoint.config) or {}).get("layer_type_quant_config"), dict),
        refused_at_tp_1="refuses" in at_tp_1,
        misaligned_block_shards="wrong-scales" in at_tp_1,
        **_transformers_block_reading(model),
        unquantized=unquantized,
        targets_unquantized_linears=targeted,
        kv_scales=bool(model.kv_cache_scales),
        sglang_unmeasured_architecture=architecture not in SGLANG_MEASURED,
        sglang_transformers_backend=architecture in SGLANG_TRANSFORMERS_BACKEND,
        unquantized_packed_shards=bool(weights)
        and fmt is not None
        and fmt.name in ("compressed-tensors", "quark")
        and any(m.rpartition(".")[2] in group for m in plain for group in PACKED_SHARDS),
        kv_cache_declared=kv_declared,
        kv_scales_under_fp8=bool(model.kv_cache_scales) and fmt is not None and fmt.name == "fp8",
        kv_cache_scheme=kv_declared and fmt is not None and fmt.name == "compressed-tensors",
    )


def _mx_unmeasured(model: CheckpointModel, weights: list[Fp8Weight], unlike: bool) -> bool:
    """An MX checkpoint unlike those the real loaders were run on (tests/loaders/test_mx_formats.py: every
    projection MX with its scale, lm_head in `ignore`): a missing or misshapen scale, e4m3fnuz codes, kv-cache
    scales, or (`unlike`) unfused names of fused modules or a Linear the config targets that holds no MX weight."""
    return (
        unlike
        or bool(model.kv_cache_scales)
        or any(w.scale is None or w.scale_kind is None or w.tensor.dtype != E4M3FN for w in weights)
    )


def _fp4_unmeasured(model: CheckpointModel, weights: list[Fp8Weight], unlike: bool) -> bool:
    """FP4 modules in a checkpoint unlike those the real loaders were run on (tests/loaders/test_fp4_loads.py:
    NVFP4, MXFP4 or both, beside FP8_DYNAMIC modules or none, lm_head in `ignore`): an FP4 module that cannot be
    read, kv-cache scales, MXFP8 or block-FP8 groups, FP8 weights that are not e4m3fn with a scale per row (or are
    fused on disk), a packed q / k / v or gate / up of mixed schemes, or (`unlike`) unfused names of fused modules
    or a Linear the config targets without a weight."""
    fmt = model.format
    schemes = {w.module: w.scheme for w in model.fp4.values()} | {w.module: "fp8" for w in weights}
    mixed_packs = any(len({schemes.get(m) for m in packed_siblings(module)}) > 1 for module in schemes)
    return (
        unlike
        or mixed_packs
        or bool(model.kv_cache_scales)
        or fmt is None
        or fmt.mx
        or fmt.block is not None
        or any(w.problem is not None for w in model.fp4.values())
        or any(w.scale_kind != "channel" or w.fused is not None or w.tensor.dtype != E4M3FN for w in weights)
    )


def _nvfp4_global_scales(model: CheckpointModel) -> set[str]:
    """Of the NVFP4 modules vLLM and SGLang pack into one layer (q / k / v, gate / up: `PACKED_SHARDS`), whether the
    global scales of some layer "differ", or are "unread" (headers only)."""
    layers = packed_nvfp4(model.checkpoint, model.fp4)
    found = {"differ"} if any(p.differ for p in layers) else set()
    return found | ({"unread"} if any(p.multipliers is None for p in layers) else set())


def _weight_only_group(config: dict[str, Any]) -> bool:
    """A compressed-tensors config group that quantizes weights and declares no input activations."""
    groups = (quantization_config(config) or {}).get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and isinstance(g.get("weights"), dict) and not g.get("input_activations")
        for g in groups.values()
    )


def rope_misfit(config: dict[str, Any]) -> str:
    """What Phi3Config refuses in a Phi-3 config's LongRoPE factors (transformers models/phi3/configuration_phi3.py
    validate_rope: each of short_factor / long_factor, when given, must be a list of (rotary dimension // 2)
    numbers, the rotary dimension hidden_size // num_attention_heads x partial_rotary_factor), or ""."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if config.get("model_type") != "phi3" or not isinstance(rope, dict):
        return ""
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return ""
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if not isinstance(partial, (int, float)) or isinstance(partial, bool):
        return ""
    rotary = hidden // heads * partial
    if not math.isfinite(rotary):  # NaN, Infinity or an overflowing factor: no length fits; not this refusal
        return ""
    want = int(rotary) // 2
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != want):
            size = f"{len(value)} values" if isinstance(value, list) else f"a {type(value).__name__}"
            return f"{key} has {size} where its rotary dimension needs {want}"
    return ""


def _nearest(architecture: str) -> str:
    """The reason's hint for an architecture vLLM refuses: the nearest name it registers, where one is close."""
    near = nearest_vllm_name(architecture)
    return f"; the nearest name vLLM registers: {near}" if near else ""


def _declares_kv_cache(model: CheckpointModel) -> bool:
    """The quantization config declares an FP8 kv cache that vLLM's default call reads: compressed-tensors'
    `kv_cache_scheme`, ModelOpt's `kv_cache_quant_algo` (hf_quant_config.json's `quantization`)."""
    fmt = model.format
    if fmt is None:
        return False
    if fmt.name == "compressed-tensors":
        return isinstance((quantization_config(model.checkpoint.config) or {}).get("kv_cache_scheme"), dict)
    if fmt.name == "modelopt":
        return modelopt_kv_cache(model.checkpoint.config, model.checkpoint.root)
    return False


def packed_groups(model: CheckpointModel) -> list[list[Fp8Weight]]:
    """Modules vLLM packs into one layer (q / k / v, gate / up, `registry.parallel.PACKED_SHARDS`; routed
    experts excepted: the fused-MoE layer keeps a scale per expert), each an FP8 weight with one scale."""
    weights = {w.module: w for w in model.module_weights() if w.fused is None and not w.stacked}
    groups = []
    for module in weights:
        parent, _, leaf = module.rpartition(".")
        group = next((g for g in PACKED_SHARDS if g[0] == leaf), None)
        if group is None or ".experts." in module:
            continue
        members = [weights.get(f"{parent}.{shard}") for shard in group]
        if all(m is not None and m.scale_kind == "tensor" for m in members):
            groups.append([m for m in members if m is not None])
    return groups


def packed_scales_differ(model: CheckpointModel) -> bool:
    """Modules vLLM packs into one layer whose per-tensor scales differ, so it requantizes them at load
    (`requantize_with_max_scale`). Scales that cannot be read (headers only) count as differing: exporters
    quantize q, k and v each on its own."""
    for group in packed_groups(model):
        values = [known_values(model.checkpoint, w.scale) if w.scale else None for w in group]
        if any(v is None for v in values) or len({tuple(v) for v in values if v is not None}) > 1:
            return True
    return False


def _transformers_block_reading(model: CheckpointModel) -> dict[str, bool]:
    """How transformers 5.24 dequantizes block-FP8 weights on CPU (its FineGrainedFP8 quantizer sets
    dequantize=True without a GPU): `Fp8Dequantize._dequantize_one` takes the block as the weight's shape
    over the scale grid's, refusing shapes the grid does not divide. A weight that is not whole blocks (q of
    192 rows, a 576-row kv_a_proj) so refuses or is read with a block of another size."""
    fmt = model.format
    indivisible = misread = False
    if fmt is not None and fmt.block is not None and fmt.name == "fp8":
        for w in model.module_weights():
            if w.scale_kind != "block" or w.scale is None or len(w.tensor.shape) != 2 or len(w.scale.shape) != 2:
                continue
            (rows, cols), (grid_rows, grid_cols) = w.tensor.shape, w.scale.shape
            if rows % grid_rows or cols % grid_cols:
                indivisible = True
            elif (rows // grid_rows, cols // grid_cols) != fmt.block:
                misread = True
    return {"block_grid_indivisible": indivisible, "block_grid_misread": misread}


def _at_tp_1(model: CheckpointModel) -> set[str]:
    """What `inspect --tp 1` reports of block-scaled modules (behaviours): a loader verdict is one at TP 1."""
    from fp8fix.parallel import shares_at

    return {s.behaviour for s in shares_at(model, 1)}


def loader_verdicts(model: CheckpointModel) -> dict[str, LoaderVerdict]:
    """Per loader: the first rule of `registry.loaders.RULES` that holds, else it loads; where that rule says
    an optional package is missing (`WITH_PACKAGE`), also the row with the package installed."""
    facts = facts_of(model)
    verdicts: dict[str, LoaderVerdict] = {}
    for loader in LOADERS:
        verdict, condition = _row_verdict(loader, facts)
        if (loader, condition) in WITH_PACKAGE:
            package, row = WITH_PACKAGE[(loader, condition)]
            verdict = replace(verdict, package=package, installed=_row_verdict(row, facts)[0])
        verdicts[loader] = verdict
    return verdicts


def _row_verdict(loader: str, facts: Facts) -> tuple[LoaderVerdict, str]:
    """`loader`'s verdict, and the condition of the rule that decided it ("" where none did)."""
    rules = [r for r in RULES if r.loader == loader and (not facts.unquantized or r.condition in PLAIN_MODEL_RULES)]
    if facts.mx_blocks:  # the model's rules, then the MX format's: the FP8 rules are about other scales
        rules = [r for r in rules if r.condition in PLAIN_MODEL_RULES] + [r for r in MX_RULES if r.loader == loader]
    if facts.fp4_modules:  # the model's rules, then the FP4 ones: the FP8 rules are about FP8 modules only
        rules = [r for r in rules if r.condition in PLAIN_MODEL_RULES] + [r for r in FP4_RULES if r.loader == loader]
    rule = next((r for r in rules if getattr(facts, r.condition)), None)
    if rule is not None:
        names = {"architecture": facts.architecture, "nearest": facts.nearest_architecture, "rope": facts.rope}
        reason = rule.reason.format(**names)
        verdict = LoaderVerdict(rule.verdict, reason, rule.evidence)
    elif facts.unquantized:
        verdict = LoaderVerdict("loads", PLAIN_MODEL, UNQUANTIZED_EVIDENCE[loader])
    elif not facts.layout:
        verdict = LoaderVerdict("loads", "no fused modules", DEFAULT_EVIDENCE[loader])
    elif facts.layout not in LOADS_BECAUSE[loader]:
        # no rule and no measurement says what it does with this layout: not a guess either way
        reason = f"no rule or measurement covers the {facts.layout} layout: not judged"
        verdict = LoaderVerdict("not-judged", reason, DEFAULT_EVIDENCE[loader])
    else:
        verdict = LoaderVerdict("loads", LOADS_BECAUSE[loader][facts.layout], DEFAULT_EVIDENCE[loader])
    if facts.kv_scales:
        verdict = replace(verdict, kv_cache=kv_cache_verdict(facts, loader, verdict))
    return verdict, rule.condition if rule is not None else ""


def kv_cache_verdict(facts: Facts, loader: str, load: LoaderVerdict) -> KvCacheVerdict:
    """The first kv-cache rule of `loader` that holds; none: not judged (no real load measured it). A
    checkpoint that does not load (or whose load is not judged) has no kv-cache verdict either."""
    if load.verdict in ("fails", "not-judged"):
        return KvCacheVerdict("not-judged", f"the checkpoint's load {load.verdict}: not judged", load.evidence)
    rule = next((r for r in KV_RULES if r.loader == loader and getattr(facts, r.condition)), None)
    if rule is None:
        how = "this row is not run" if not CALLS[loader].measured else "no real load here measured this format's"
        return KvCacheVerdict("not-judged", f"{how}: not judged", DEFAULT_EVIDENCE[loader])
    return KvCacheVerdict(rule.verdict, rule.reason, rule.evidence)

"""FP8 checkpoint formats: how to recognise each from its config and what it names how.

A format decides the tensor names of its scales, the scale shape convention (`[]` or
`[1]` for one scale per tensor, a block grid), and which config lists name modules
(and in which match grammar) that must follow a rename. Formats fp8fix cannot
convert yet are recognised too, so the user gets "not supported yet, format X"
instead of a guess.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.io.checkpoint import MODELOPT_CONFIG, read_json, side_config
from fp8fix.vocab import Grammar

__all__ = ["MODELOPT_CONFIG"]  # io/checkpoint.py names the file (it must check it is inside SOURCE)


@dataclass(frozen=True)
class NameList:
    """A config list of module names: where it is and how its entries match a module name.

    grammar: `exact`, `exact-or-re` (exact, or a `re:` pattern matched from the start),
    `transformers` (a regex matched from the start up to a module boundary, or a plain suffix:
    `modules_to_not_convert`), `fnmatch` (shell wildcards), `quark-layer` (a key of Quark's
    `layer_quant_config`: fnmatch where it holds `*`, else the module name as a part of it), each
    as the loader that reads the list matches it (`evidence`).
    `keyed`: the names are the keys of a dict of per-module settings (Quark's `layer_quant_config`),
    which fp8fix does not rewrite: a rename its keys name is refused, and verify checks their meaning.
    """

    path: str  # dotted path inside the quantization config; '*' = every key
    grammar: Grammar
    file: str = "config.json"  # or hf_quant_config.json (ModelOpt)
    evidence: str = ""  # the loader code that matches entries so
    # A list of modules left unquantized, where `--tp-bf16` and `--dequantize` name the modules they write in BF16:
    # "always" (created when absent), "if-set" (only a non-empty list: a loader reads it only then), "" not one.
    unquantized: str = ""
    keyed: bool = False


@dataclass(frozen=True)
class FormatSpec:
    name: str  # quant_method as written in the config
    label: str  # what people call it
    scalar_shape: tuple[int, ...]  # shape of a per-tensor scale written by this format
    name_lists: tuple[NameList, ...]
    weight_scale: str = "weight_scale"
    input_scale: str = "input_scale"
    block: tuple[int, int] | None = None  # block scales: rows x columns per scale
    #: OCP MX blocks (`block` 1 x 32): every weight scale is an E8M0 byte, 2^(b - 127), stored as U8 or F8_E8M0
    mx: bool = False
    #: The FP4 schemes its config declares beside (or instead of) FP8 ones (`FP4_FORMATS` values): modules of
    #: packed E2M1 weights (`model.Fp4Weight`)
    fp4: frozenset[str] = frozenset()
    #: A per-module map of schemes (ModelOpt MIXED_PRECISION's `quantized_layers`: module -> "fp8" or "nvfp4"); a
    #: module it does not name is left unquantized by the loader
    layers: tuple[tuple[str, str], ...] = ()

    def weight_scale_of(self, weight: str) -> str:
        """The scale tensor of FP8 weight `weight`: a sibling of `x.weight` (`x.weight_scale`), or, for a
        stacked-experts parameter without `.weight` (`experts.gate_up_proj`), the name with a suffix
        (`experts.gate_up_proj_scale`, as transformers' FBGEMM and FineGrainedFP8 experts name it)."""
        return _scale_name(weight, self.weight_scale)

    def input_scale_of(self, weight: str) -> str:
        return _scale_name(weight, self.input_scale)


def _scale_name(weight: str, param: str) -> str:
    if weight.endswith(".weight"):
        return weight[: -len("weight")] + param
    return f"{weight}_{param.removeprefix('weight_')}"


#: How the loaders match each list's entries against module names (vLLM 0.32's sources, as installed
#: for tests/loaders; transformers 5.24). AMD's `quant_method: fp8` exports put globs such as "*gate" in
#: `ignored_layers`: vLLM compares them exactly, so they name nothing, and fp8fix reads them so too.
_VLLM_FP8_EXACT = (
    "vllm 0.32 quantization/fp8.py Fp8Config (ignored_layers_match_mode exact), quant_utils.is_layer_skipped"
)
_TRANSFORMERS_MATCH = (
    "transformers 5.24 quantizers/quantizers_utils.py should_convert_module "
    "(a regex from the start up to a module boundary, or a suffix)"
)
_EXACT_OR_RE = (
    "vllm 0.32 quantization/{} should_ignore_layer -> config_utils.is_equal_or_regex_match "
    "(exact, or re.match after 're:'; no fnmatch)"
)
_QUARK_LAYER = (
    "vllm 0.32 quantization/quark/quark.py get_layer_quant_config_from_name (a key with '*': fnmatch, "
    "else `layer_name in key`)"
)
_MODELOPT_FNMATCH = "vllm 0.32 quantization/modelopt.py is_layer_excluded (exact, then fnmatch wildcards)"

_VLLM_FP8_LISTS = "vllm 0.32 quantization/fp8.py Fp8Config.from_config (modules_to_not_convert if no ignored_layers)"
AUTOFP8 = FormatSpec(
    name="fp8",
    label="AutoFP8 / vLLM fp8 (per-tensor)",
    scalar_shape=(),
    name_lists=(
        NameList("ignored_layers", "exact", evidence=f"{_VLLM_FP8_EXACT}; {_VLLM_FP8_LISTS}", unquantized="if-set"),
        NameList(
            "modules_to_not_convert",
            "transformers",
            evidence=f"{_TRANSFORMERS_MATCH}; {_VLLM_FP8_LISTS}",
            unquantized="always",
        ),
    ),
)
#: AutoFP8's first releases: `act_scale` for the input scale, one `kv_scale` per attention.
AUTOFP8_LEGACY = replace(AUTOFP8, label="AutoFP8 (legacy act_scale names)", input_scale="act_scale")
#: Legacy AutoFP8 tensor suffixes and today's names for them (`kv_scale` is both kv scales: vLLM's
#: `maybe_remap_kv_scale_name` loads it as k_scale and duplicates it to v_scale).
LEGACY_RENAMES = {".act_scale": (".input_scale",), ".kv_scale": (".k_scale", ".v_scale")}
#: What a checkpoint written as compressed-tensors renames: the legacy names, and AMD's kv-cache scales on
#: the projections (`self_attn.k_proj.output_scale`), which vLLM 0.32 maps for quant_method fp8 and quark
#: (Fp8Config / QuarkConfig.get_cache_scale_mapper) but not for compressed-tensors, whose kv-cache scales are
#: the attention's own `self_attn.k_scale` / `v_scale` / `q_scale` (QuantizationConfig.get_cache_scale_mapper).
COMPRESSED_TENSORS_RENAMES = {
    **LEGACY_RENAMES,
    ".weight_scale_inv": (".weight_scale",),  # block FP8's scale name (`quant_method: fp8`), compressed-tensors'
    ".k_proj.output_scale": (".k_scale",),
    ".v_proj.output_scale": (".v_scale",),
    ".q_proj.output_scale": (".q_scale",),
}


def compressed_tensors_names(name: str) -> tuple[str, ...]:
    """The names tensor `name` takes in a checkpoint written as compressed-tensors; () where it keeps its own."""
    suffix = next((s for s in COMPRESSED_TENSORS_RENAMES if name.endswith(s)), None)
    return () if suffix is None else tuple(name[: -len(suffix)] + new for new in COMPRESSED_TENSORS_RENAMES[suffix])


#: vLLM reads `ignored_layers` when it is non-empty, else `modules_to_not_convert`; transformers reads only
#: `modules_to_not_convert`. So a module left unquantized goes in `modules_to_not_convert` always, and in
#: `ignored_layers` too where that list is set.
BLOCK_FP8 = FormatSpec(
    name="fp8",
    label="block FP8 (DeepSeek-V3 / Qwen3 / FineGrainedFP8)",
    scalar_shape=(),
    name_lists=(
        NameList(
            "modules_to_not_convert",
            "transformers",
            evidence=f"{_TRANSFORMERS_MATCH}; {_VLLM_FP8_LISTS}",
            unquantized="always",
        ),
        NameList("ignored_layers", "exact", evidence=f"{_VLLM_FP8_EXACT}; {_VLLM_FP8_LISTS}", unquantized="if-set"),
    ),
    weight_scale="weight_scale_inv",
)
COMPRESSED_TENSORS = FormatSpec(
    name="compressed-tensors",
    label="compressed-tensors float-quantized",
    scalar_shape=(1,),
    name_lists=(
        NameList(
            "ignore", "exact-or-re", evidence=_EXACT_OR_RE.format("compressed_tensors/utils.py"), unquantized="always"
        ),
        NameList("config_groups.*.targets", "exact-or-re", evidence=_EXACT_OR_RE.format("compressed_tensors/utils.py")),
    ),
)
#: compressed-tensors MXFP8 (`format: mxfp8-quantized`, compressed-tensors 0.20 QuantizationScheme MXFP8 preset):
#: e4m3fn weights, one E8M0 scale byte per 32 elements along the input dimension (`weight_scale` [out, in / 32],
#: U8: `scale_dtype: torch.uint8`), activations quantized at run time in groups of 32 (no input scale).
MXFP8_COMPRESSED_TENSORS = replace(
    COMPRESSED_TENSORS, label="compressed-tensors MXFP8 (mxfp8-quantized)", block=(1, 32), mx=True
)
QUARK = FormatSpec(
    name="quark",
    label="AMD Quark FP8",
    scalar_shape=(),
    name_lists=(
        NameList("exclude", "exact-or-re", evidence=_EXACT_OR_RE.format("quark/utils.py"), unquantized="always"),
        NameList("layer_quant_config", "quark-layer", evidence=_QUARK_LAYER, keyed=True),
    ),
)
MODELOPT = FormatSpec(
    name="modelopt",
    label="NVIDIA ModelOpt FP8",
    scalar_shape=(),
    name_lists=(
        NameList("quantization.exclude_modules", "fnmatch", MODELOPT_CONFIG, _MODELOPT_FNMATCH),
        NameList("ignore", "fnmatch", evidence=_MODELOPT_FNMATCH),
        NameList("exclude_modules", "fnmatch", evidence=_MODELOPT_FNMATCH),
    ),
)
#: ModelOpt's NVFP4 (`quant_algo: NVFP4`): every quantized Linear packed E2M1 in `weight` U8 [out, in / 2], an
#: F8_E4M3 `weight_scale` per 16 and an F32 `weight_scale_2` that multiplies them (vLLM 0.32 modelopt.py
#: ModelOptNvFp4Config's weight parameters; `fp4_modules.modelopt_nvfp4`).
MODELOPT_NVFP4 = replace(MODELOPT, label="NVIDIA ModelOpt NVFP4", fp4=frozenset({"nvfp4"}))
#: ModelOpt's MXFP8 (`quant_algo: MXFP8`): e4m3fn `weight` [out, in] and an E8M0 `weight_scale` U8 [out, in / 32]
#: (vLLM 0.32 modelopt.py ModelOptMxFp8Config: "e4m3 weights with per-32-block e8m0 scales"), activations dynamic.
MODELOPT_MXFP8 = replace(MODELOPT, label="NVIDIA ModelOpt MXFP8", block=(1, 32), mx=True)
#: DeepSeek-V4 (`model_type: deepseek_v4`, quant_method fp8, 128 x 128 blocks, `scale_fmt: ue8m0`): block FP8 whose
#: scales are `<module>.scale` (F8_E8M0 where the experts are FP4, F32 where they are FP8), and routed experts
#: `ffn.experts.E.w{1,2,3}.weight` packed E2M1 (I8, two a byte) with an E8M0 `.scale` per 32 where `expert_dtype`
#: is fp4 (vLLM 0.21 models/deepseek_v4.py _make_deepseek_v4_weights_mapper; DeepSeek's inference/model.py).
DEEPSEEK_V4 = replace(
    BLOCK_FP8, label="DeepSeek-V4 (block FP8, `.scale` tensors; MXFP4 routed experts)", weight_scale="scale"
)


def is_deepseek_v4(fmt: FormatSpec | None) -> bool:
    """`fmt` is DeepSeek-V4's (its block size and expert format as its config says)."""
    return fmt is not None and fmt.label == DEEPSEEK_V4.label


FBGEMM = FormatSpec(
    name="fbgemm_fp8",
    label="FBGEMM FP8 (per-row)",
    scalar_shape=(),
    name_lists=(NameList("modules_to_not_convert", "transformers", evidence=_TRANSFORMERS_MATCH),),
)
#: gpt-oss's MXFP4 (OpenAI's release; `quant_method: mxfp4`): the routed experts of every layer as stacked E2M1
#: blocks with E8M0 scales (`fp4_modules.GPT_OSS_BLOCKS`), everything else BF16. transformers reads
#: `modules_to_not_convert`; vLLM 0.32's Mxfp4Config.from_config ignores it (quantizes only MoE layers).
GPT_OSS_MXFP4 = FormatSpec(
    name="mxfp4",
    label="gpt-oss MXFP4 (experts)",
    scalar_shape=(),
    name_lists=(NameList("modules_to_not_convert", "transformers", evidence=_TRANSFORMERS_MATCH),),
    fp4=frozenset({"mxfp4"}),
)


def _not_yet(label: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(
        f"config.json: {label} checkpoints are not supported yet; fp8fix converts AutoFP8, block FP8, "
        "compressed-tensors (tensor/channel/block, MXFP8), Quark, ModelOpt and FBGEMM FP8 checkpoints, and writes "
        "compressed-tensors NVFP4 / MXFP4, ModelOpt MXFP8 / NVFP4 and gpt-oss MXFP4 unquantized (--to bf16)"
    )


#: Elements per MX scale (OCP MX v1.0: 32 for every element type), as compressed-tensors' `group_size` says it.
MX_GROUP = 32
#: compressed-tensors formats of FP8 groups, and of FP4 groups (CompressionFormat) -> the FP4 scheme's name.
FP8_FORMATS = ("float-quantized", "naive-quantized", "mxfp8-quantized")
FP4_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
#: A checkpoint whose config groups say their own formats.
MIXED_PRECISION = "mixed-precision"
#: Each FP4 scheme's weight strategy and elements per scale (compressed-tensors quant_scheme.py NVFP4, MXFP4).
FP4_SCHEMES = {"nvfp4": ("tensor_group", 16), "mxfp4": ("group", MX_GROUP)}

#: transformers' module boundary after a matched prefix: a dot before or after, or the end of the name.
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


#: Longest name-list entry read: module names are a few hundred characters; a longer entry is no name.
MAX_ENTRY_CHARS = 10_000
#: How long one regex entry may take to match one module name. The loaders match these lists with
#: Python's `re`, which backtracks without limit; fp8fix matches them with the `regex` module, the
#: same syntax and semantics as `re` (which re2 is not: it has no look-around, and transformers'
#: boundary below is one) but with a timeout, and refuses an entry that takes longer.
MATCH_SECONDS = 0.1


def matches(entry: str, name: str, grammar: Grammar) -> bool:
    """Whether a name-list `entry` names module `name`, as the loader reading the list decides
    (`registry.formats.NameList.evidence`). A pattern that takes longer than MATCH_SECONDS (catastrophic
    backtracking: the loader would hang on it) raises InvalidCheckpoint naming it."""
    if grammar == "exact":
        return entry == name
    if grammar == "exact-or-re":
        return entry == name or (entry.startswith("re:") and _match(entry[3:], entry, name))
    if grammar == "transformers":  # transformers 5.24 quantizers_utils.should_convert_module
        return _match(rf"(?:{entry}){_BOUNDARY}", entry, name) or name.endswith(entry)
    if grammar == "fnmatch":
        return fnmatch.fnmatchcase(name, entry)
    if grammar == "quark-layer":
        return fnmatch.fnmatchcase(name, entry) if "*" in entry else name in entry
    raise ValueError(f"unknown name-list grammar {grammar!r}")


#: A name-list entry that is a plain dotted name (`model.layers.0.mlp`, `lm_head`): as a regex it has no
#: alternation, repetition or group, so Python's `re` matches it in linear time (no timeout needed).
_PLAIN = re.compile(r"[\w\-]+(?:\.[\w\-]+)*")
#: Plain entries compiled into one alternation at most this many at a time (a list of 10^5 names: 100 patterns).
_ALTERNATIVES = 1000


def name_matcher(entries: list[str], grammar: Grammar) -> Callable[[str], bool]:
    """Whether any of `entries` names a module (`matches`), as one test per module name: plain entries (`_PLAIN`)
    at once (a set, a suffix tuple, one alternation compiled with `re`), any other entry one by one with `matches`.
    For many names against many entries (100k FP4 modules, a list of hundreds): `matches` costs microseconds a pair."""
    exact: set[str] = set()
    from_start: list[str] = []  # regexes matched from the start of the name (`re:` entries, transformers')
    suffixes: list[str] = []
    slow: list[str] = []
    for entry in entries:
        pattern = entry[3:] if grammar == "exact-or-re" and entry.startswith("re:") else None
        text = entry if pattern is None else pattern
        if grammar == "quark-layer" or not _PLAIN.fullmatch(text) or len(text) > MAX_ENTRY_CHARS:
            slow.append(entry)
        elif grammar == "transformers":
            from_start.append(text)
            suffixes.append(text)
        elif pattern is not None:
            from_start.append(pattern)
        else:  # exact, exact-or-re's exact names, fnmatch without a wildcard
            exact.add(text)
    boundary = _BOUNDARY if grammar == "transformers" else ""
    chunks = [from_start[i : i + _ALTERNATIVES] for i in range(0, len(from_start), _ALTERNATIVES)]
    combined = [re.compile(f"(?:{'|'.join(chunk)}){boundary}") for chunk in chunks]
    ends = tuple(suffixes)

    def named(name: str) -> bool:
        return (
            name in exact
            or any(pattern.match(name) is not None for pattern in combined)
            or (bool(ends) and name.endswith(ends))
            or any(matches(entry, name, grammar) for entry in slow)
        )

    return named


def _match(pattern: str, entry: str, name: str) -> bool:
    """`re.match(pattern, name)` with a time bound (MATCH_SECONDS); `regex.error` for an invalid pattern."""
    if len(entry) > MAX_ENTRY_CHARS:
        raise InvalidCheckpoint(f"config.json: a name-list entry of {len(entry)} characters is not a module name")
    try:
        return _compiled(pattern).match(name, timeout=MATCH_SECONDS) is not None
    except TimeoutError:
        raise InvalidCheckpoint(
            f"config.json: the name-list entry {entry!r:.80} takes more than {MATCH_SECONDS} s to match "
            f"'{name}' (catastrophic backtracking: a loader's Python re would hang on it); simplify the pattern"
        ) from None


@lru_cache(maxsize=4096)
def _compiled(pattern: str) -> Any:
    """A name-list pattern compiled once: a list is matched against every module (10^5 of them in a large MoE),
    and `regex`'s own cache holds far fewer patterns than a long list has."""
    import regex

    return regex.compile(pattern)


def pattern_error(pattern: str) -> str | None:
    """Why `pattern` is not a regular expression the loaders' Python `re` compiles, or None."""
    import regex

    if len(pattern) > MAX_ENTRY_CHARS:
        return f"{len(pattern)} characters long"
    try:
        re.compile(pattern)
        regex.compile(pattern)
    except (re.error, regex.error) as e:
        return str(e)
    return None


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    qc = config.get("quantization_config") or config.get("compression_config")
    return qc if isinstance(qc, dict) else None


def detect_format(config: dict[str, Any], root: Path, tensor_names: set[str] | None = None) -> FormatSpec:
    """The format of the checkpoint in `root`, or an error naming the unsupported one (or a malformed name list)."""
    spec = _detect(config, root, tensor_names)
    _check_name_lists(quantization_config(config) or {}, spec)
    return spec


def locations(node: Any, parts: list[str], where: str) -> list[tuple[str, dict[str, Any], str]]:
    """(where, holder, key) for every value the dotted-path `parts` reaches in `node`; '*' matches every key."""
    if not isinstance(node, dict) or not parts:
        return []
    head, rest = parts[0], parts[1:]
    keys = list(node) if head == "*" else [head] if head in node else []
    found = []
    for key in keys:
        if rest:
            found += locations(node[key], rest, f"{where}.{key}")
        else:
            found.append((f"{where}.{key}", node, key))
    return found


def _check_name_lists(qc: dict[str, Any], spec: FormatSpec) -> None:
    """Every module-name list of quantization_config is absent, null or a list of names (regexes that compile)."""
    for name_list in spec.name_lists:
        if name_list.file != "config.json":
            continue
        for where, holder, key in locations(qc, name_list.path.split("."), "quantization_config"):
            value = holder[key]
            if value is None:
                continue
            if name_list.keyed:
                if not isinstance(value, dict):
                    shown = f"{value!r:.60}"
                    raise InvalidCheckpoint(f"config.json: {where} must map module names to settings, not {shown}")
                value = list(value)
            if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
                raise InvalidCheckpoint(f"config.json: {where} must be a list of module names, not {value!r:.60}")
            for entry in value:
                pattern = entry[3:] if name_list.grammar == "exact-or-re" and entry.startswith("re:") else None
                pattern = entry if name_list.grammar == "transformers" else pattern
                problem = pattern_error(pattern) if pattern is not None else None
                if problem:
                    raise InvalidCheckpoint(
                        f"config.json: {where} entry {entry!r:.60} is not a valid regular expression ({problem})"
                    )


def _detect(config: dict[str, Any], root: Path, tensor_names: set[str] | None) -> FormatSpec:
    qc = quantization_config(config)
    modelopt = root / MODELOPT_CONFIG
    if modelopt.exists() and (qc is None or qc.get("quant_method") in (None, "modelopt")):
        return _modelopt(modelopt)
    if qc is None:
        raise InvalidCheckpoint(
            "config.json: has no quantization_config; fp8fix needs it to know how the FP8 weights were exported"
        )
    method = qc.get("quant_method")
    if method == "fp8" and _deepseek_v4(config):
        return _deepseek_v4_format(config, qc)
    if method == "fp8":
        if qc.get("weight_block_size"):
            return replace(BLOCK_FP8, block=_block(qc["weight_block_size"], "weight_block_size"))
        if tensor_names and any(n.endswith(".act_scale") for n in tensor_names):
            return AUTOFP8_LEGACY
        return AUTOFP8
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "quark":
        return _quark(qc)
    if method == "modelopt":
        return _modelopt_algo({"quant_algo": "FP8", **qc}, "ModelOpt")
    if method == "fbgemm_fp8":
        return FBGEMM
    if method == GPT_OSS_MXFP4.name:
        return GPT_OSS_MXFP4
    raise UnsupportedCheckpoint(f"config.json: quant_method {method!r} is not an FP8 format fp8fix knows")


def _deepseek_v4(config: dict[str, Any]) -> bool:
    """DeepSeek-V4's own layout (`model_type: deepseek_v4`, `expert_dtype`: vLLM 0.32 models/deepseek_v4.py keys its
    experts' format off it): `layers.N.attn.wq_a.weight` F8_E4M3 with its block scales as `.scale` F8_E8M0 (not
    `weight_scale_inv`), routed experts `ffn.experts.E.w1.weight` packed FP4 (I8, two E2M1 a byte) with an E8M0
    `.scale` per 32. Read as block FP8 it would be judged wrongly (every FP8 weight "without a scale")."""
    model_type = config.get("model_type")
    return "expert_dtype" in config or (isinstance(model_type, str) and model_type.startswith("deepseek_v4"))


def _deepseek_v4_format(config: dict[str, Any], qc: dict[str, Any]) -> FormatSpec:
    """DeepSeek-V4's block FP8 (`.scale` tensors) with its routed experts as `expert_dtype` says: fp4 (MXFP4, read
    as FP4 modules) or fp8 (block FP8 like the rest); absent, fp4, as vLLM 0.21 models/deepseek_v4.py defaults it."""
    expert_dtype = config.get("expert_dtype", "fp4")
    if expert_dtype not in ("fp4", "fp8") or not qc.get("weight_block_size"):
        said = f"expert_dtype {str(expert_dtype)!r:.20}, weight_block_size {qc.get('weight_block_size')!r:.20}"
        raise _not_yet(f"DeepSeek-V4 ({said})")
    block = _block(qc["weight_block_size"], "weight_block_size")
    return replace(DEEPSEEK_V4, block=block, fp4=frozenset({"mxfp4"}) if expert_dtype == "fp4" else frozenset())


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """A JSON object of quantization_config (absent: empty); any other type is an error naming it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidCheckpoint(f"config.json: {where} must be an object, not {type(value).__name__} {value!r:.60}")
    return value


def _block(value: Any, where: str) -> tuple[int, int]:
    """[128, 128] or "128x128"."""
    if isinstance(value, str) and re.fullmatch(r"\d{1,9}[x,]\d{1,9}", value):
        value = [int(v) for v in re.split(r"[x,]", value)]
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise InvalidCheckpoint(f"config.json: {where} {value!r:.60} is not a [rows, columns] block size")
    return value[0], value[1]


def _compressed_tensors(qc: dict[str, Any]) -> FormatSpec:
    """One FP8 scheme (float-quantized tensor / channel / block, or MXFP8) in every FP8 group, beside FP4 groups
    (`FP4_FORMATS`) where the config says `format: mixed-precision` or an FP4 format; anything else refused."""
    fmt = qc.get("format")
    if fmt not in (*FP8_FORMATS, *FP4_FORMATS, MIXED_PRECISION):
        raise _not_yet(f"compressed-tensors format {fmt!r:.60}")
    fp8: dict[str, dict[str, dict[str, Any]]] = {}  # by kind: float (tensor / channel / block) or MX
    fp4: set[str] = set()
    formats: set[str] = set()
    for name, group in _groups(qc).items():
        group = _mapping(group, f"config_groups.{name}")
        group_format = group.get("format") or fmt
        formats.add(str(group_format))
        if group_format in FP4_FORMATS:
            fp4.add(_fp4_group(name, group, group_format))
        elif group_format in FP8_FORMATS:
            fp8.setdefault("mx" if group_format == "mxfp8-quantized" else "float", {})[name] = group
        else:
            raise _not_yet(f"compressed-tensors group {name!s:.40} of format {group_format!r:.60}")
    if len(fp8) > 1:
        raise _not_yet("compressed-tensors with both MXFP8 and float-quantized FP8 groups")
    kind, groups = next(iter(fp8.items()), ("float", {}))
    spec = _mxfp8(groups) if kind == "mx" else _float_quantized(groups)
    if not fp4:
        return spec
    label = f"compressed-tensors {fmt}" + (f" ({' + '.join(sorted(formats))})" if fmt == MIXED_PRECISION else "")
    return replace(spec, label=label, fp4=frozenset(fp4))


def _float_quantized(groups: dict[str, dict[str, Any]]) -> FormatSpec:
    """FP8 groups of `float-quantized` / `naive-quantized`: tensor, channel or block weights, one block size."""
    blocks = set()
    for name, group in groups.items():
        weights = _mapping(group.get("weights"), f"config_groups.{name}.weights")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _not_yet(
                f"compressed-tensors group {name} with {weights.get('num_bits')}-bit {weights.get('type')} weights"
            )
        strategy = weights.get("strategy")
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), f"group {name} block_structure"))
        elif strategy not in ("tensor", "channel"):
            raise _not_yet(f"compressed-tensors weight strategy {strategy!r} (group {name})")
    if len(blocks) > 1:
        raise _not_yet(f"compressed-tensors with several block sizes {sorted(blocks)}")
    return replace(COMPRESSED_TENSORS, block=blocks.pop()) if blocks else COMPRESSED_TENSORS


def _fp4_group(name: str, group: dict[str, Any], group_format: str) -> str:
    """The FP4 scheme of a group in `group_format` ("nvfp4" or "mxfp4"), its weights checked against
    compressed-tensors' presets (quant_scheme.py NVFP4 / MXFP4): 4-bit float, symmetric, NVFP4 `tensor_group`
    in groups of 16 (an E4M3 scale each, and a global scale), MXFP4 `group` in groups of 32 (E8M0 bytes as
    torch.uint8)."""
    scheme = FP4_FORMATS[group_format]
    weights = _mapping(group.get("weights"), f"config_groups.{name}.weights")
    keys = ("type", "num_bits", "strategy", "group_size", "symmetric")
    said = tuple(weights.get(k) for k in keys)
    expected = ("float", 4, *FP4_SCHEMES[scheme], True)
    if said != expected:
        shown = ", ".join(f"{k}={v!r:.20}" for k, v in zip(keys, said, strict=True))
        raise _not_yet(f"compressed-tensors {group_format} group {name!s:.40} with weights {shown}")
    return scheme


def _groups(qc: dict[str, Any]) -> dict[str, Any]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise InvalidCheckpoint("config.json: compressed-tensors quantization_config has no config_groups")
    return groups


def _mxfp8(groups: dict[str, dict[str, Any]]) -> FormatSpec:
    """MXFP8 groups (`format: mxfp8-quantized`): weights float 8-bit in groups of 32 (compressed-tensors'
    MXFP8 preset: `strategy: group`, `group_size: 32`, E8M0 scales as `torch.uint8`), symmetric."""
    for name, group in groups.items():
        weights = _mapping(group.get("weights"), f"config_groups.{name}.weights")
        keys = ("type", "num_bits", "strategy", "group_size")
        scheme = tuple(weights.get(k) for k in keys)
        if scheme != ("float", 8, "group", MX_GROUP):
            shown = ", ".join(f"{k}={v!r:.20}" for k, v in zip(keys, scheme, strict=True))
            raise _not_yet(f"compressed-tensors mxfp8-quantized group {name:.40} with weights {shown}")
        # what vLLM 0.32 takes for MXFP8 (CompressedTensorsConfig._is_mxfp8): symmetric, E8M0 bytes as torch.uint8
        if weights.get("symmetric") is not True or weights.get("scale_dtype") != "torch.uint8":
            said = f"symmetric={weights.get('symmetric')!r:.20}, scale_dtype={weights.get('scale_dtype')!r:.40}"
            raise _not_yet(f"compressed-tensors MXFP8 group {name:.40} with {said}")
    return MXFP8_COMPRESSED_TENSORS


def _quark(qc: dict[str, Any]) -> FormatSpec:
    weight = _mapping(_mapping(qc.get("global_quant_config"), "global_quant_config").get("weight"), "weight")
    if weight.get("dtype") != "fp8_e4m3":
        raise _not_yet(f"AMD Quark {weight.get('dtype')}")
    if weight.get("qscheme") not in ("per_tensor", "per_channel"):
        raise _not_yet(f"AMD Quark qscheme {weight.get('qscheme')!r}")
    return QUARK


def modelopt_kv_cache(config: dict[str, Any], root: Path) -> bool:
    """A ModelOpt checkpoint declares an FP8 kv cache (`kv_cache_quant_algo` or `kv_cache_scheme`, in
    config.json's quantization_config or hf_quant_config.json's `quantization`, where vLLM 0.32 looks:
    utils/torch_utils.py get_kv_cache_quant_algo_string)."""
    qc = quantization_config(config) or {}
    if qc.get("kv_cache_quant_algo") or qc.get("kv_cache_scheme"):
        return True
    try:
        data = side_config(root)
    except InvalidCheckpoint:
        return False
    inner = data.get("quantization") if isinstance(data, dict) else None
    return isinstance(inner, dict) and bool(inner.get("kv_cache_quant_algo") or inner.get("kv_cache_scheme"))


def _modelopt(path: Path) -> FormatSpec:
    data = read_json(path)
    quantization = data.get("quantization") if isinstance(data, dict) else None
    return _modelopt_algo(quantization if isinstance(quantization, dict) else {}, "NVIDIA ModelOpt")


#: ModelOpt MIXED_PRECISION's per-layer algorithms fp8fix reads (vLLM 0.32 modelopt.py ModelOptMixedPrecisionConfig
#: resolves each to its FP8 or NVFP4 config; W4A16_NVFP4 packs its weights as NVFP4 does).
MODELOPT_LAYER_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4"}
#: ModelOpt's mixed precision: per-tensor FP8 modules and NVFP4 ones, each named in `quantized_layers`.
MODELOPT_MIXED = replace(MODELOPT, label="NVIDIA ModelOpt MIXED_PRECISION (FP8 + NVFP4)", fp4=frozenset({"nvfp4"}))


def _modelopt_algo(section: dict[str, Any], label: str) -> FormatSpec:
    """ModelOpt's FP8, NVFP4 in groups of 16 (its only group size), MXFP8, or MIXED_PRECISION of FP8 and NVFP4
    layers; any other algorithm is not read yet."""
    algo, group_size = section.get("quant_algo"), section.get("group_size")
    if algo == "NVFP4" and group_size in (None, FP4_SCHEMES["nvfp4"][1]):
        return MODELOPT_NVFP4
    if algo == "MXFP8":
        return MODELOPT_MXFP8
    if algo == "MIXED_PRECISION":
        return _modelopt_mixed(section.get("quantized_layers"), label)
    if algo != "FP8":
        said = algo if isinstance(algo, str) else repr(algo)
        raise _not_yet(f"{label} {said:.40}" + (f" (group_size {group_size!r:.20})" if algo == "NVFP4" else ""))
    return MODELOPT


#: Most entries of `quantized_layers` read (a module each: DeepSeek-V3 has ~60k linear modules).
MAX_QUANTIZED_LAYERS = 1_000_000


def _modelopt_mixed(layers: Any, label: str) -> FormatSpec:
    """MIXED_PRECISION whose `quantized_layers` maps module names to FP8 or NVFP4 (group 16) recipes."""
    if not isinstance(layers, dict) or not layers:
        raise InvalidCheckpoint(
            f"{label} MIXED_PRECISION needs `quantized_layers`, a map of module names to their quant_algo "
            f"(vLLM refuses it without one), not {str(layers)[:40] if layers is not None else 'none'}"
        )
    if len(layers) > MAX_QUANTIZED_LAYERS:
        raise InvalidCheckpoint(
            f"{label} MIXED_PRECISION: `quantized_layers` has {len(layers):,} entries, more modules than a model has "
            f"(fp8fix reads at most {MAX_QUANTIZED_LAYERS:,})"
        )
    found = []
    for module, recipe in layers.items():
        algo = recipe.get("quant_algo") if isinstance(recipe, dict) else None
        scheme = MODELOPT_LAYER_ALGOS.get(str(algo).upper()) if isinstance(algo, str) else None
        group = recipe.get("group_size", 16) if isinstance(recipe, dict) else None
        if scheme is None or (scheme == "nvfp4" and group != FP4_SCHEMES["nvfp4"][1]):
            raise _not_yet(f"{label} MIXED_PRECISION with a {str(algo)[:30]} layer ({module[:80]}: {recipe!r:.60})")
        found.append((str(module), scheme))
    return replace(MODELOPT_MIXED, layers=tuple(found))

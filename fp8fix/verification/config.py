"""config.json (and a format's side config) checked by what it means for OUTPUT's tensors.

verify does not ask convert's config code what config.json should be (a bug there would
repeat itself here): it reads both configs itself and checks what a loader takes from them.

- The sizes config.json gives the model's layers match OUTPUT's tensors wherever SOURCE's do (`sizes`).
- Every key outside `quantization_config` is SOURCE's, but the sizes `--tp` padding changed
  (`padding.padded_sizes`, which only counts a size a padded weight reads) and the keys the
  registry entry sets for an unfused layout.
- Kept format: `quantization_config` is SOURCE's but its name lists, and each name list
  names, by the loader's own matching (`registry.formats.matches`), exactly OUTPUT's
  modules whose SOURCE module it named, plus the modules written in BF16 where the list is
  one of modules left unquantized. Text may differ (renamed entries); meaning may not.
- compressed-tensors: what its config groups say is read against OUTPUT's tensors: float
  8-bit weights with the strategy OUTPUT's weight scales have (one value: tensor; one per
  row: channel), static input activations exactly where OUTPUT has input scales, a
  kv-cache scheme exactly where it has kv-cache scales, and an `ignore` that names every
  Linear module without FP8 weights, and of those with, exactly the ones SOURCE's lists
  skipped (read with the source loader's matching).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from fp8fix.errors import some
from fp8fix.io.checkpoint import CONFIG, Checkpoint, read_json
from fp8fix.io.safetensors_file import read_values
from fp8fix.model import KV_SCALE_SUFFIXES, ignore_linears, unquantized_linears
from fp8fix.numerics.dtypes import is_fp8
from fp8fix.registry.formats import COMPRESSED_TENSORS, NameList, locations, matches
from fp8fix.registry.formats import quantization_config as quantization_of
from fp8fix.verification.block_mx import check_mx_config
from fp8fix.verification.context import VerifyContext, plain_output, side_configs_dropped
from fp8fix.verification.fp4 import unquantized_name
from fp8fix.verification.mx_blocks import check_reblocked_config
from fp8fix.verification.sizes import check_sizes

_NAME_LIST = "<a name list, compared by meaning>"
_STRATEGY = "<the weights' strategy, read off OUTPUT's scales>"


def check_config(
    ctx: VerifyContext, renames: dict[str, list[str]], sizes: dict[str, int], unquantized: list[str]
) -> list[str]:
    """Report every way OUTPUT's config files differ from what SOURCE's mean for OUTPUT's tensors; return
    the side config files (ModelOpt's) that OUTPUT holds rewritten, so they are not taken for copies."""
    if plain_output(ctx):
        _plain_config(ctx)
        return []
    src, out = ctx.src.config, ctx.out.config
    _model_keys(ctx, renames, sizes)
    for line in check_sizes(ctx.out, ctx.src):
        ctx.report.problem(line)
    source_qc, output_qc = quantization_of(src) or {}, quantization_of(out) or {}
    kept = source_qc.get("quant_method") == output_qc.get("quant_method")
    if output_qc.get("quant_method") == COMPRESSED_TENSORS.name:
        _compressed_tensors(ctx, output_qc, not kept, renames)
    elif not kept:
        ctx.report.problem(
            f"config.json: quant_method {output_qc.get('quant_method')!r:.40} is neither SOURCE's "
            f"{source_qc.get('quant_method')!r:.40} nor compressed-tensors"
        )
    if ctx.reblocked:  # `--blocks 128x128` (verification/mx_blocks.py)
        check_reblocked_config(ctx, source_qc, output_qc)
    elif ctx.block_mx:  # `--blocks mx` (verification/block_mx.py)
        check_mx_config(ctx, source_qc, output_qc)
    elif kept:
        lists = [n for n in ctx.fmt.name_lists if n.file == CONFIG]
        _same_but_names(ctx, CONFIG, "quantization_config", source_qc, output_qc, lists, renames, unquantized)
    return [] if side_configs_dropped(ctx) else _side_configs(ctx, renames, kept)


#: The torch dtype name config.json gives weights of each unquantized safetensors dtype.
TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16"}
#: What a plain model says no more: how it was quantized (DeepSeek-V4's `expert_dtype`: how its experts are).
PLAIN_DROPS = ("quantization_config", "compression_config", "expert_dtype")
#: config.json keys naming the model's dtype (transformers < 5: torch_dtype; 5 reads dtype too).
DTYPE_KEYS = ("torch_dtype", "dtype")


def _plain_config(ctx: VerifyContext) -> None:
    """A plain OUTPUT (`--to bf16`): SOURCE's config without its quantization config, its dtype keys (or
    torch_dtype, where SOURCE has none) naming the one dtype every FP8 weight and FP4 module of SOURCE is
    written in."""
    report = ctx.report
    dtypes = {ctx.out.tensors[n].dtype for n in ctx.dequantized}
    dtypes |= {ctx.out.tensors[unquantized_name(w)].dtype for w in ctx.fp4.values()}
    missing = [w.name for w in ctx.model.module_weights() if w.name not in ctx.dequantized]
    missing += [w.packed.name for w in ctx.model.fp4.values() if w.packed.name not in ctx.fp4]
    if missing:
        report.problem(f"'{missing[0]}': a weight of SOURCE that the plain OUTPUT does not hold unquantized")
    if len(dtypes) != 1:
        report.problem(f"OUTPUT's unquantized weights are {sorted(dtypes) or 'none'}, not one dtype")
        return
    torch_dtype = TORCH_DTYPES[dtypes.pop()]
    src, out = ctx.src.config, ctx.out.config
    keys = [k for k in DTYPE_KEYS if k in src] or ["torch_dtype"]
    expected = {k: v for k, v in src.items() if k not in PLAIN_DROPS}
    expected.update({k: torch_dtype for k in keys})
    for key in sorted(set(expected) | set(out)):
        if out.get(key, _ABSENT) != expected.get(key, _ABSENT):
            shown = "absent" if key not in out else f"{out[key]!r:.60}"
            want = "absent" if key not in expected else f"{expected[key]!r:.60}"
            report.problem(f"config.json: {key} is {shown}; a plain model of SOURCE's has {want}")


_ABSENT = object()


def _model_keys(ctx: VerifyContext, renames: dict[str, list[str]], sizes: dict[str, int]) -> None:
    src, out = ctx.src.config, ctx.out.config
    layout = (ctx.model.spec.unfused_config if ctx.model.spec else {}) if renames else {}
    missing = object()
    for key in sorted((set(src) | set(out)) - {"quantization_config", "compression_config"}):
        if key in sizes:
            expected = sizes[key]
        elif key in layout and key in src:
            expected = layout[key]
        else:
            expected = src.get(key, missing)
        got = out.get(key, missing)
        if got != expected:
            shown = "absent" if got is missing else f"{got!r:.60}"
            want = "absent" if expected is missing else f"{expected!r:.60}"
            ctx.report.problem(f"config.json: differs from SOURCE's: {key} is {shown}; expected {want}")


def _modules(ckpt: Checkpoint) -> list[str]:
    """The modules a name list can name: those with a matrix weight, and stacked experts ([E, ...] tensors of
    an `experts` module, Llama-4 style: the stack and each expert `experts.{e}.NAME` in it, which an entry may
    name to take one expert's FP8 codes for BF16)."""
    modules, experts = [], 0
    for name, t in ckpt.tensors.items():
        if name.endswith(".weight") and len(t.shape) >= 2:
            modules.append(name.removesuffix(".weight"))
        elif len(t.shape) >= 3 and ".experts." in name and is_fp8(t.dtype):
            stack, leaf = name.rsplit(".experts.", 1)
            count = max(0, min(t.shape[0], MAX_EXPERTS, MAX_EXPERT_NAMES - experts))
            modules += [name, *(f"{stack}.experts.{e}.{leaf}" for e in range(count))]
            experts += count
    return modules


def _shard_names(ctx: VerifyContext, modules: list[str]) -> list[str]:
    """The per-shard names of OUTPUT's fused modules (Phi-3's q_proj / k_proj / v_proj of a qkv_proj): lists
    name a fused module by its shards too, as vLLM matches them."""
    present = set(modules)
    return [
        f.spec.unfused_path(f.path, shard)
        for f in ctx.model.fused.values()
        if f.path in present
        for shard in f.spec.shards
        if shard.unfused
    ]


#: Experts per stacked tensor named one by one, and in all (bounds for a hostile header's first dimensions:
#: Llama-4 Maverick has 128 experts x 48 layers x 2 stacks).
MAX_EXPERTS = 4096
MAX_EXPERT_NAMES = 1_000_000


def _strays(entries: Any, source_entries: Any, modules: list[str], grammar: Any) -> list[str]:
    """Entries of OUTPUT's list that name no module of OUTPUT and are not SOURCE's own (kept as they were): a
    list entry no rule of a conversion writes."""
    kept = set(_texts(source_entries))
    return [e for e in _texts(entries) if e not in kept and not any(matches(e, m, grammar) for m in modules)]


def _named(entries: Any, modules: list[str], grammar: Any) -> set[str]:
    found: set[str] = set()
    for entry in _texts(entries):  # entry by entry: each pattern compiled once, however long the list
        found.update(m for m in modules if m not in found and matches(entry, m, grammar))
    return found


def _texts(entries: Any) -> list[str]:
    """A name list's names: a list's strings, or a dict's keys (Quark's `layer_quant_config`)."""
    return [e for e in entries if isinstance(e, str)] if isinstance(entries, list | dict) else []


def _same_but_names(
    ctx: VerifyContext,
    file: str,
    label: str,
    source: dict[str, Any],
    output: dict[str, Any],
    lists: list[NameList],
    renames: dict[str, list[str]],
    unquantized: list[str],
) -> None:
    """`output` must be `source` with only its name lists (and a compressed-tensors weight strategy, which
    `_compressed_tensors` reads off the scales) different, and every name list must mean the same."""
    blank_source, blank_output = copy.deepcopy(source), copy.deepcopy(output)
    origin = {shard: fused for fused, shards in renames.items() for shard in shards}
    out_modules = _modules(ctx.out)
    nameable = out_modules + _shard_names(ctx, out_modules)
    bf16 = set(unquantized)
    # compressed-tensors outputs also name every Linear without FP8 weights (checked in _compressed_tensors)
    may_add = set(unquantized_linears(ctx.out.tensors)) if ctx.fmt.name == COMPRESSED_TENSORS.name else set()
    for name_list in lists:
        path = name_list.path.split(".")
        where = {w for w, _, _ in locations(source, path, label)} | {w for w, _, _ in locations(output, path, label)}
        for spot in sorted(where):
            keys = spot[len(label) + 1 :].split(".")
            src_entries, out_entries = _at(source, keys), _at(output, keys)
            named = _named(src_entries, [origin.get(m, m) for m in out_modules], name_list.grammar)
            expected = {m for m in out_modules if origin.get(m, m) in named}
            if name_list.unquantized and (name_list.unquantized != "if-set" or src_entries):
                expected |= bf16
            got = _named(out_entries, out_modules, name_list.grammar)
            strays = _strays(out_entries, src_entries, nameable, name_list.grammar)
            if strays:
                ctx.report.problem(
                    f"{file}: {spot}: names {some(strays, quoted=True)}, which is no module of OUTPUT and not in "
                    "SOURCE's list"
                )
            if (got ^ expected) - may_add:
                more, fewer = sorted(got - expected), sorted(expected - got)
                ctx.report.problem(
                    f"{file}: {spot}: names other modules than SOURCE's list means for OUTPUT"
                    + (f"; also {', '.join(more[:3])}" if more else "")
                    + (f"; not {', '.join(fewer[:3])}" if fewer else "")
                )
            if not name_list.keyed:  # a keyed list's settings are SOURCE's, under SOURCE's keys (convert keeps them)
                _blank(blank_source, keys, _NAME_LIST)
                _blank(blank_output, keys, _NAME_LIST)
    for blank in (blank_source, blank_output):
        for group in (
            (blank.get("config_groups") or {}).values() if isinstance(blank.get("config_groups"), dict) else ()
        ):
            if isinstance(group, dict) and isinstance(group.get("weights"), dict) and "strategy" in group["weights"]:
                group["weights"]["strategy"] = _STRATEGY
    said = blank_output.get("scale_fmt") if file == CONFIG else None
    if said == "ue8m0" and blank_source.get("scale_fmt") != said:  # `--scales ue8m0`: true of every block scale?
        blank_output.pop("scale_fmt")
        if not _block_scales_powers_of_two(ctx):
            ctx.report.problem(f"{file}: {label}.scale_fmt is 'ue8m0', but a block scale is not a power of two")
    if blank_source != blank_output:
        ctx.report.problem(f"{file}: {label} differs from SOURCE's beyond its module name lists")


def _block_scales_powers_of_two(ctx: VerifyContext) -> bool:
    """Every block scale of OUTPUT's FP8 weights is a power of two."""
    for w in ctx.model.module_weights():
        if w.scale_kind != "block" or w.scale is None or w.scale.name not in ctx.out.tensors:
            continue
        values = read_values(ctx.out.tensors[w.scale.name], ctx.files)
        if any(not (v > 0 and math.frexp(v)[0] == 0.5) for v in values):
            return False
    return True


def _at(node: Any, keys: list[str]) -> Any:
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _blank(node: Any, keys: list[str], value: str) -> None:
    """Set the value at `keys` (an absent list is blanked too: absent and present-but-renamed compare alike)."""
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node[keys[-1]] = value


def _compressed_tensors(ctx: VerifyContext, qc: dict[str, Any], converted: bool, renames: dict[str, list[str]]) -> None:
    """A compressed-tensors config read against OUTPUT's tensors (see the module's docstring)."""
    out, report = ctx.out, ctx.report
    origin = {shard: fused for fused, shards in renames.items() for shard in shards}
    groups = qc.get("config_groups")
    groups = [g for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    scales = [t for n, t in out.tensors.items() if n.endswith(".weight_scale")]
    strategy = None
    if scales and all(math.prod(t.shape) == 1 for t in scales):
        strategy = "tensor"
    elif scales and all(len(t.shape) == 2 and t.shape[1] == 1 for t in scales):
        strategy = "channel"
    for group in groups:
        weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
        said = weights.get("strategy")
        if said in ("tensor", "channel") and strategy is not None and said != strategy:
            report.problem(f"config.json: a config group says {said} weight scales; OUTPUT's are {strategy}")
    if converted and not ctx.block_mx:  # MXFP8 OUTPUT: its groups are checked by block_mx.check_mx_config
        inputs = any(n.endswith(".input_scale") for n in out.tensors)
        kv = any(n.endswith(KV_SCALE_SUFFIXES) for n in out.tensors)
        shape_ok = qc.get("format") == "float-quantized" and len(groups) == 1 and groups[0].get("targets") == ["Linear"]
        weights = groups[0].get("weights") if groups else None
        activations = groups[0].get("input_activations") if groups else None
        float8 = {"num_bits": 8, "type": "float"}
        if not shape_ok or not isinstance(weights, dict) or any(weights.get(k) != v for k, v in float8.items()):
            report.problem("config.json: not one float-quantized group of 8-bit float weights targeting Linear")
        if not isinstance(activations, dict) or activations.get("dynamic") is not (not inputs):
            report.problem(
                "config.json: input activations must be "
                + ("static: OUTPUT holds input scales" if inputs else "dynamic: OUTPUT holds no input scales")
            )
        if ("kv_cache_scheme" in qc and qc["kv_cache_scheme"] is not None) != kv:
            report.problem(f"config.json: kv_cache_scheme {'missing beside' if kv else 'without'} kv-cache scales")
    linears = unquantized_linears(out.tensors)
    _, targeted = ignore_linears(out.config, linears)
    if targeted:  # what the config would quantize without a scale
        report.problem(
            f"config.json: quantization_config targets {len(targeted)} Linear module(s) OUTPUT holds no FP8 weight "
            f"for ({', '.join(targeted[:3])}): compressed-tensors would quantize them; they belong in `ignore`"
        )
    if converted:
        fp8 = [n.removesuffix(".weight") for n, t in out.tensors.items() if n.endswith(".weight") and is_fp8(t.dtype)]
        got, expected = _named(qc.get("ignore"), fp8, "exact-or-re"), _source_skipped(ctx, fp8, origin)
        if got != expected:
            more, fewer = sorted(got - expected), sorted(expected - got)
            report.problem(
                "config.json: `ignore` does not skip the FP8 modules SOURCE's lists skip"
                + (f"; also {', '.join(more[:3])}" if more else "")
                + (f"; not {', '.join(fewer[:3])}" if fewer else "")
            )


def _source_skipped(ctx: VerifyContext, modules: list[str], origin: dict[str, str]) -> set[str]:
    """Those of OUTPUT's `modules` whose SOURCE module a name list of SOURCE's format names, as the
    source's loader matches it (its config.json lists, and side files such as ModelOpt's)."""
    found: set[str] = set()
    for name_list in (n for n in ctx.fmt.name_lists if not n.keyed):  # a keyed list's modules are quantized
        path = ctx.src.root / name_list.file
        if name_list.file == CONFIG:
            holder: Any = quantization_of(ctx.src.config) or {}
        else:
            holder = read_json(path) if path.is_file() else {}
        for _, node, key in locations(holder, name_list.path.split("."), ""):
            named = _named(node[key], [origin.get(m, m) for m in modules], name_list.grammar)
            found |= {m for m in modules if origin.get(m, m) in named}
    return found


def _side_configs(ctx: VerifyContext, renames: dict[str, list[str]], kept: bool) -> list[str]:
    """Side config files with name lists (ModelOpt's hf_quant_config.json): SOURCE's, or with the format kept
    and modules renamed, SOURCE's with lists that mean the same for OUTPUT. The files found rewritten."""
    rewritten = []
    for file in sorted({n.file for n in ctx.fmt.name_lists if n.file != CONFIG}):
        if not (ctx.src.root / file).is_file():
            continue
        if not (ctx.out.root / file).is_file():
            ctx.report.problem(f"{file}: missing from OUTPUT")
            continue
        source, output = read_json(ctx.src.root / file), read_json(ctx.out.root / file)
        if source == output:
            continue
        rewritten.append(file)
        if not (kept and renames and isinstance(source, dict) and isinstance(output, dict)):
            ctx.report.problem(f"{file}: not SOURCE's")
            continue
        lists = [n for n in ctx.fmt.name_lists if n.file == file]
        _same_but_names(ctx, file, file, source, output, lists, renames, [])
    return rewritten

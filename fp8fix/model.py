"""One description of a checkpoint, computed once from its headers, config.json and the registry.

convert, inspect and verify all need the same facts: which architecture and format
this is, every FP8 weight with its scale, input scale and the kind of its scale,
the fused modules and stacked experts, the kv-cache scales. `describe_checkpoint`
works them out once; the commands take the result and none re-derives them.

The description is lenient: a weight that convert would refuse (no scale, a scale of
no known shape, experts the config does not size) is described with its `problem`,
so inspect can report it and verify can still map it; convert calls
`require_convertible`, which raises the first problem. Only headers and config are
read here, never tensor data, so a checkpoint known from the Hub's header API works too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from fp8fix.errors import Fp8fixError, InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.fp4_modules import Fp4Weight, fp4_weights
from fp8fix.io.checkpoint import Checkpoint, check_scales
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.io.source_files import SourceFiles
from fp8fix.numerics.dtypes import E8M0, FP8_DTYPES, FP8_WEIGHT_DTYPES, INPUT_SCALE_DTYPES, SCALE_DTYPES, is_fp8
from fp8fix.numerics.mx import MX_BLOCK
from fp8fix.registry.architectures import ArchitectureSpec, FusedModuleSpec, Registry, SizeMemo, architecture_name
from fp8fix.registry.formats import (
    AUTOFP8,
    AUTOFP8_LEGACY,
    MODELOPT_NVFP4,
    FormatSpec,
    detect_format,
    matches,
    pattern_error,
    quantization_config,
)
from fp8fix.vocab import ScaleKind

Block = tuple[int, int] | None

#: Calibration scales of the kv cache and attention, in e4m3fn units whatever the weights' encoding
#: (AMD's exports add the attention probabilities' `prob_output_scale`).
KV_SCALE_SUFFIXES = (
    ".k_scale",
    ".v_scale",
    ".q_scale",
    ".prob_scale",
    ".prob_output_scale",
    ".kv_scale",
    ".output_scale",
)
#: Block FP8's scale name, recognised even when the format itself is not.
BLOCK_SCALE = "weight_scale_inv"
#: Last path components of embedding modules: 2-D weights that are not `nn.Linear` layers (so
#: compressed-tensors' `Linear` target does not take them), as transformers' models name them.
EMBEDDINGS = frozenset(
    {
        "embed_tokens",
        "embed_in",
        "embed_positions",
        "embedding",
        "embeddings",
        "position_embeddings",
        "tok_embeddings",
        "word_embeddings",
        "wpe",
        "wte",
    }
)


@dataclass(frozen=True)
class FusedModule:
    """A fused module found in the checkpoint, with its tensors by parameter name."""

    path: str
    spec: FusedModuleSpec
    rows: list[int]  # rows of each shard in total
    params: dict[str, TensorInfo]
    segments: list[tuple[int, int, int]]  # (shard, first row, end row) in storage order

    def shard_segments(self, shard: int) -> list[tuple[int, int]]:
        return [(a, b) for i, a, b in self.segments if i == shard]

    def shard_of_rows(self) -> list[int]:
        """The shard each row belongs to, in storage order."""
        return [shard for shard, a, b in self.segments for _ in range(b - a)]

    @property
    def group_rows(self) -> int:
        """Rows of one group ([q; k; v] once): all rows for a contiguous module."""
        return sum(b - a for _, a, b in self.segments[: len(self.rows)])

    def block_grid(self, block: Block) -> tuple[int, int] | None:
        """The shape of the module's block-scale grid: one grid over the weight, or with `block_grid:
        per-group` one of ceil(group rows / block) rows per group (pre-sharded chunks)."""
        if block is None:
            return None
        shape = self.weight.shape
        if self.spec.block_grid != "per-group":
            return block_grid(shape, block)
        groups = shape[0] // self.group_rows
        return groups * -(-self.group_rows // block[0]), -(-shape[1] // block[1])

    def scale_row(self, row: int, block_rows: int) -> int:
        """The block-scale row holding weight row `row` (see `block_grid`)."""
        if self.spec.block_grid != "per-group":
            return row // block_rows
        group, within = divmod(row, self.group_rows)
        return group * -(-self.group_rows // block_rows) + within // block_rows

    def next_block_start(self, row: int, block_rows: int) -> int:
        """The first row after `row` that lies in another block-scale row."""
        if self.spec.block_grid != "per-group":
            return (row // block_rows + 1) * block_rows
        group_start = row - row % self.group_rows
        return min(group_start + ((row - group_start) // block_rows + 1) * block_rows, group_start + self.group_rows)

    @property
    def weight(self) -> TensorInfo:
        return self.params["weight"]


@dataclass(frozen=True)
class StackedExperts:
    """A stacked-experts FP8 tensor [experts, in, out] checked against config.json; `widths` are its
    shards' columns when the parameter is fused (gate_up_proj)."""

    count: int
    param: str  # gate_up_proj, down_proj
    shards: list[str]
    widths: list[int]

    @property
    def fused(self) -> bool:
        return len(self.widths) > 1


@dataclass(frozen=True)
class Fp8Weight:
    """One FP8 tensor and everything that says how to read it."""

    tensor: TensorInfo
    module: str  # `x` for `x.weight`; the tensor's own name for stacked experts
    scale: TensorInfo | None
    scale_kind: ScaleKind | None  # None: no scale, or one of no known shape (see `problem`)
    input_scale: TensorInfo | None
    fused: FusedModule | None
    stacked: bool  # stacked experts the registry describes
    experts: StackedExperts | None  # their sizes, when config.json gives them
    unknown_experts: bool  # a 3-D experts tensor the registry does not describe
    n_shards: int  # shards sharing the weight (fused modules, fused experts), else 1
    problem: Fp8fixError | None  # why convert refuses this weight, None when it does not

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def is_module_weight(self) -> bool:
        """A linear module's `.weight` or stacked experts: what the module tables list."""
        return self.tensor.name.endswith(".weight") or self.stacked

    def per_block(self, block: Block) -> bool:
        """Scaled per `block`: a grid of scales, or one scale where the whole weight is one block (a grid of one,
        which reads as a per-tensor scale)."""
        if self.scale_kind == "block":
            return True
        one_block = block is not None and len(self.tensor.shape) == 2 and block_grid(self.tensor.shape, block) == (1, 1)
        return one_block and self.scale_kind == "tensor" and self.fused is None and not self.stacked


@dataclass(frozen=True)
class CheckpointModel:
    checkpoint: Checkpoint
    registry: Registry
    architecture: str | None  # config.json's architectures[0]
    spec: ArchitectureSpec | None  # its registry entry, None when unknown
    format: FormatSpec | None  # None when not recognised (see format_error)
    format_error: Fp8fixError | None
    fused: dict[str, FusedModule]  # by module path
    weights: dict[str, Fp8Weight]  # every FP8 tensor, in checkpoint order
    kv_cache_scales: list[TensorInfo]
    fp4: dict[str, Fp4Weight]  # FP4 modules (compressed-tensors NVFP4 / MXFP4) by module, in checkpoint order
    # set once require_convertible has passed: --target plans several candidates from one description,
    # and reading every scale again for each (tens of thousands of block grids) is wasted work
    _convertible: list[bool] = field(default_factory=list, repr=False, compare=False)
    #: what modules above this one derive from the description alone (the loader facts), kept so that
    #: planning several candidates does not derive it again for each: O(tensors) each time
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def once(self, key: str, work: Callable[[CheckpointModel], Any]) -> Any:
        """`work(self)`, worked out once per description and kept in `derived` under `key` (None included)."""
        if key not in self.derived:
            self.derived[key] = work(self)
        return self.derived[key]

    @property
    def is_autofp8(self) -> bool:
        """`quant_method: fp8` without block scales (AutoFP8, legacy names included)."""
        return self.format in (AUTOFP8, AUTOFP8_LEGACY)

    def require_format(self) -> FormatSpec:
        if self.format is None:
            assert self.format_error is not None
            raise self.format_error
        return self.format

    def require_architecture(self) -> tuple[str, ArchitectureSpec]:
        """The registry entry (or, for an unregistered architecture whose FP8 weights look unfused, one
        with no fused modules); refused where an FP8 weight looks fused and no entry describes it."""
        return self._architecture

    @cached_property
    def _architecture(self) -> tuple[str, ArchitectureSpec]:
        """Looked up once (every candidate layout asks); a refusal is not cached, it raises each time."""
        linear = [w.module for w in self.module_weights() if not w.stacked]
        return self.registry.lookup(self.checkpoint.config, linear)

    def module_weights(self) -> list[Fp8Weight]:
        """FP8 weights of an encoding fp8fix converts, as modules (linear `.weight`s and stacked experts)."""
        return list(self._module_weights)

    @cached_property
    def _module_weights(self) -> tuple[Fp8Weight, ...]:
        return tuple(w for w in self.weights.values() if w.is_module_weight and w.tensor.dtype in FP8_WEIGHT_DTYPES)

    def plain_linears(self) -> list[str]:
        """`unquantized_linears` of this checkpoint, a copy of a list worked out once: `--target` plans every
        candidate with it (a pass over every tensor name each)."""
        return list(self._plain_linears)

    @cached_property
    def _plain_linears(self) -> tuple[str, ...]:
        return tuple(unquantized_linears(self.checkpoint.tensors))

    def fused_experts(self) -> list[Fp8Weight]:
        return [w for w in self.weights.values() if w.experts is not None and w.experts.fused]

    def require_convertible(self) -> None:
        """Raise the first reason convert cannot convert this checkpoint faithfully (the linear weights
        first, then stacked experts); read each scale (where the data is here) to refuse values no
        weight can be recovered from."""
        if self._convertible:
            return
        fp4_problem = next((w.problem for w in self.fp4.values() if w.problem is not None), None)
        if fp4_problem is not None:
            raise fp4_problem
        if self.format == MODELOPT_NVFP4 and self.weights:  # (ModelOpt says a mix in MIXED_PRECISION, not read yet)
            w = next(iter(self.weights.values()))
            raise InvalidCheckpoint(
                f"{w.tensor.path.name}: '{w.name}' is an FP8 ({w.tensor.dtype}) tensor, but the ModelOpt config "
                "declares NVFP4 (quant_algo NVFP4), whose weights are packed FP4 (U8): the config does not match the "
                "weights"
            )
        if self.format is not None and self.format.layers:
            _check_layer_map(self.format.layers, self.weights, self.fp4)
        if not self.weights and not self.fp4:
            ckpt = self.checkpoint
            raise InvalidCheckpoint(
                f"{ckpt.root.name}: no FP8 tensor in {len(ckpt.shards)} safetensors file(s); not an FP8 checkpoint"
            )
        if self.checkpoint.has_data:  # NVFP4's global scales (one value each; the group scales are read as written)
            with SourceFiles() as files:
                check_scales([w.global_scale for w in self.fp4.values() if w.global_scale is not None], files)
        ordered = sorted(self.weights.values(), key=lambda w: w.stacked)
        if not ordered:  # FP4 modules only
            self._convertible.append(True)
            return
        first = next((i for i, w in enumerate(ordered) if w.problem is not None), len(ordered))
        if self.checkpoint.has_data:  # Hub headers: no values; the weights before the first problem, first
            with SourceFiles() as files:
                check_scales([s for w in ordered[:first] for s in (w.scale, w.input_scale) if s is not None], files)
        if first < len(ordered):
            raise ordered[first].problem  # type: ignore[misc]
        self._convertible.append(True)


def _check_layer_map(
    layers: tuple[tuple[str, str], ...], weights: dict[str, Fp8Weight], fp4: dict[str, Fp4Weight]
) -> None:
    """Each FP8 module and FP4 module is named in a per-module map (ModelOpt MIXED_PRECISION's `quantized_layers`)
    with its own scheme: a module the map names otherwise, or not at all, is built by the loader as the map says
    (vLLM 0.32 modelopt.py ModelOptMixedPrecisionConfig: unnamed layers unquantized), not as its tensors are."""
    said = dict(layers)
    held = [(w.module, "fp8", w.tensor.path.name) for w in weights.values() if w.is_module_weight]
    held += [(w.module, w.scheme or "fp4", w.packed.path.name) for w in fp4.values()]
    for module, scheme, file in held:
        if said.get(module) != scheme:
            named = f"names it {said[module].upper()}" if module in said else "does not name it"
            raise InvalidCheckpoint(
                f"{file}: '{module}' holds {scheme.upper()} weights, but the ModelOpt config's quantized_layers "
                f"{named}: the config does not match the weights"
            )


def unquantized_linears(tensors: dict[str, TensorInfo]) -> list[str]:
    """Linear modules holding no FP8 weight: every 2-D plain-float `.weight` that is not an embedding
    (lm_head, MoE routers, modules an exporter skipped), and `lm_head` where there is no FP8 one (a tied
    head is a Linear of the model too). A compressed-tensors group that targets `Linear` quantizes each
    one its `ignore` does not name: transformers then computes with a weight that has no scale (issue 24)."""
    found = [
        name.removesuffix(".weight")
        for name, t in tensors.items()
        if name.endswith(".weight")
        and len(t.shape) == 2
        and t.dtype in INPUT_SCALE_DTYPES  # the plain float dtypes
        and name.removesuffix(".weight").rpartition(".")[2] not in EMBEDDINGS
    ]
    head = tensors.get("lm_head.weight")
    return list(dict.fromkeys([*found, *([] if head is not None and is_fp8(head.dtype) else ["lm_head"])]))


def ignore_linears(config: dict[str, Any], linears: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A compressed-tensors `config` with every module of `linears` that a config group targets (the
    class `Linear`, or an entry naming it) and no `ignore` entry names added to `ignore`; and those added.
    Other formats are returned as they are: their loaders quantize only the modules with FP8 weights."""
    qc = quantization_config(config)
    if qc is None or qc.get("quant_method") != "compressed-tensors":
        return config, []
    groups = qc.get("config_groups")
    targets = [
        t
        for group in (groups.values() if isinstance(groups, dict) else ())
        if isinstance(group, dict) and isinstance(group.get("targets"), list)
        for t in group["targets"]
        if isinstance(t, str)
    ]
    ignore = qc.get("ignore")
    ignore = [e for e in ignore if isinstance(e, str)] if isinstance(ignore, list) else []
    added = [
        m
        for m in linears
        if ("Linear" in targets or any(_names(t, m) for t in targets)) and not any(_names(e, m) for e in ignore)
    ]
    if not added:
        return config, []
    out = copy.deepcopy(config)
    out_qc = quantization_config(out)
    assert out_qc is not None
    out_qc["ignore"] = [*(out_qc.get("ignore") or []), *added]
    return out, added


def _names(entry: str, module: str) -> bool:
    """compressed-tensors' exact-or-`re:` matching; an entry that is no valid pattern names nothing."""
    if entry.startswith("re:") and pattern_error(entry[3:]):
        return False
    return matches(entry, module, "exact-or-re")


def describe_checkpoint(ckpt: Checkpoint, registry: Registry) -> CheckpointModel:
    """Every fact about `ckpt` the commands share; raises only where nothing can be described
    (a fused module whose rows disagree with config.json)."""
    try:
        fmt: FormatSpec | None = detect_format(ckpt.config, ckpt.root, set(ckpt.tensors))
        format_error = None
    except Fp8fixError as e:
        fmt, format_error = None, e
    name = architecture_name(ckpt.config)
    spec = registry.get(name)
    fp4 = {w.module: w for w in fp4_weights(ckpt, fmt)}
    # FP8 fused modules: an FP4 one (ModelOpt packs it in its own `weight`) is the FP4 rules'
    fused = {m.path: m for m in _find_fused_modules(ckpt, spec) if m.path not in fp4} if spec else {}
    fp4_tensors = {t.name for w in fp4.values() for t in w.tensors}
    describe = _WeightReader(ckpt, registry, spec, fmt, fused)
    weights = {
        t.name: describe(t) for t in ckpt.tensors.values() if t.dtype in FP8_DTYPES and t.name not in fp4_tensors
    }
    kv = [t for t in ckpt.tensors.values() if t.name.endswith(KV_SCALE_SUFFIXES)]
    return CheckpointModel(ckpt, registry, name, spec, fmt, format_error, fused, weights, kv, fp4)


def _find_fused_modules(ckpt: Checkpoint, arch: ArchitectureSpec) -> list[FusedModule]:
    leaves = tuple(spec.module.rpartition(".")[2] for spec in arch.fused_modules)
    by_module: dict[str, dict[str, TensorInfo]] = {}
    for t in ckpt.tensors.values():
        module, _, param = t.name.rpartition(".")
        if module.endswith(leaves):  # (a cheap first look: fused_spec_for decides below)
            by_module.setdefault(module, {})[param] = t
    found = []
    memo = SizeMemo()  # one config.json: each spec sized once (per value of the path variables it reads)
    for path, params in by_module.items():
        spec = arch.fused_spec_for(path)
        if spec is None or "weight" not in params:
            continue
        weight = params["weight"]
        stored = (f"{weight.path.name}: '{weight.name}'", weight.shape[0] if weight.shape else 0)
        rows, segments = arch.row_layout(spec, ckpt.config, path, stored, memo)
        bias = params.get("bias")
        if bias is not None and list(bias.shape) != [weight.shape[0]]:
            raise InvalidCheckpoint(
                f"{bias.path.name}: fused bias '{bias.name}' has shape {list(bias.shape)}, but its weight has "
                f"{weight.shape[0]} rows: a bias needs one value per row; the checkpoint is inconsistent"
            )
        found.append(FusedModule(path, spec, rows, params, segments))
    return found


class _WeightReader:
    """Describes FP8 tensors one by one (experts' count from config.json is worked out once)."""

    def __init__(
        self,
        ckpt: Checkpoint,
        registry: Registry,
        spec: ArchitectureSpec | None,
        fmt: FormatSpec | None,
        fused: dict[str, FusedModule],
    ) -> None:
        self.ckpt, self.registry, self.spec, self.fmt, self.fused = ckpt, registry, spec, fmt, fused
        self.names = fmt or AUTOFP8
        self.block = fmt.block if fmt else None
        self._count: int | None = None

    def __call__(self, t: TensorInfo) -> Fp8Weight:
        spec = self.spec
        stacked = len(t.shape) == 3 and spec is not None and spec.experts is not None and spec.experts.matches(t.name)
        unknown_experts = len(t.shape) == 3 and "experts" in t.name and not stacked
        module = t.name if stacked else t.name.rsplit(".", 1)[0]
        fused = None if stacked else self.fused.get(module)
        experts_shards = (
            spec.experts.fused.get(module.rpartition(".")[2], ()) if stacked and spec and spec.experts else ()
        )
        n_shards = len(fused.rows) if fused else max(len(experts_shards), 1)
        scale = self.ckpt.tensors.get(self.names.weight_scale_of(t.name))
        if scale is not None and self.fmt is not None and self.fmt.mx:
            scale = mx_scale(scale)
        input_scale = self.ckpt.tensors.get(self.names.input_scale_of(t.name))
        block_scale = self.ckpt.tensors.get(f"{module}.{BLOCK_SCALE}") if self.fmt is None else None
        kind: ScaleKind | None = None
        problems: list[Fp8fixError] = []
        if t.dtype not in FP8_WEIGHT_DTYPES:
            problems.append(
                UnsupportedCheckpoint(f"{t.path.name}: tensor '{t.name}' is {t.dtype}; fp8fix handles e4m3 weights")
            )
        shape_problem = self._shape_problem(t, stacked, unknown_experts)
        problems += [shape_problem] if shape_problem else []
        try:
            experts = self._experts(t) if stacked else None
        except Fp8fixError as e:
            experts = None
            problems.append(e)
        try:
            if scale is None and block_scale is not None:
                scale, kind = block_scale, "block"  # inspect's best reading of an unrecognised format
            elif scale is None:
                problems.append(
                    InvalidCheckpoint(
                        f"{t.path.name}: FP8 weight '{t.name}' has no scale '{self.names.weight_scale_of(t.name)}' "
                        "in any shard; its values cannot be recovered (incomplete export?)"
                    )
                )
            elif stacked:
                kind = experts_scale_kind(scale, t.shape, n_shards, self.block)
            elif self.fmt is not None and self.fmt.mx:
                kind = mx_scale_kind(scale, t)
            elif len(t.shape) >= 2:
                grid = fused.block_grid(self.block) if fused else None
                kind = scale_kind(scale, t.shape, n_shards if fused else None, True, self.block, grid)
        except Fp8fixError as e:
            problems.append(e)
        if input_scale is not None and input_scale.dtype not in INPUT_SCALE_DTYPES:
            problems.append(
                InvalidCheckpoint(
                    f"{input_scale.path.name}: input scale '{input_scale.name}' is {input_scale.dtype}; an activation "
                    f"scale is a float ({', '.join(INPUT_SCALE_DTYPES)}): the checkpoint is corrupt or mislabelled"
                )
            )
        problem = problems[0] if problems else None
        return Fp8Weight(
            t, module, scale, kind, input_scale, fused, stacked, experts, unknown_experts, n_shards, problem
        )

    def _shape_problem(self, t: TensorInfo, stacked: bool, unknown_experts: bool) -> Fp8fixError | None:
        if unknown_experts:
            return UnsupportedCheckpoint(
                f"{t.path.name}: tensor '{t.name}' {list(t.shape)} holds stacked MoE experts, which fp8fix knows "
                f"for {', '.join(self.registry.with_experts())}; describe this architecture's experts in an "
                "--arch-file entry (see docs/architectures.md)"
            )
        if not stacked and (not t.name.endswith(".weight") or len(t.shape) != 2):
            return UnsupportedCheckpoint(
                f"{t.path.name}: tensor '{t.name}' is FP8 but not a 2-D linear weight {t.shape}; not supported yet"
            )
        return None

    def _experts(self, t: TensorInfo) -> StackedExperts:
        """The sizes config.json gives stacked experts `t`, which must match its shape."""
        arch, config = self.spec, self.ckpt.config
        assert arch is not None and arch.experts is not None
        spec = arch.experts
        if self._count is None:
            self._count = arch.size(spec.count, f"the experts of {spec.module}", config)
        param = t.name.rpartition(".")[2]
        shards = spec.fused.get(param, ())
        widths = [arch.size(s.size, f"shard '{s.shard}' of {spec.module}.{param}", config) for s in shards]
        if t.shape[0] != self._count or (widths and sum(widths) != t.shape[2]):
            expected = f"[{self._count}, in, {' + '.join(map(str, widths))}]" if widths else f"[{self._count}, in, out]"
            raise InvalidCheckpoint(
                f"{t.path.name}: stacked experts '{t.name}' are {list(t.shape)}, but config.json makes them "
                f"{expected}: the config does not match the weights"
            )
        return StackedExperts(self._count, param, [s.shard for s in shards], widths)


def scale_kind(
    scale: TensorInfo,
    weight_shape: tuple[int, ...],
    n_shards: int | None,
    allow_channel: bool,
    block: Block = None,
    grid: tuple[int, int] | None = None,
) -> ScaleKind:
    """tensor (one value), shard (one per fused shard), channel (one per row) or block (one per
    rows x columns block; `grid` is the block grid's shape where it is not one grid over the weight,
    see `FusedModule.block_grid`); else an error."""
    rows = weight_shape[0]
    _check_scale_dtype(scale)
    grid = grid or (block_grid(weight_shape, block) if block else None)
    if scale.numel == 1 and len(scale.shape) <= 2:
        return "tensor"
    if block and allow_channel and scale.shape == grid:
        return "block"
    if n_shards and scale.shape == (n_shards,):
        return "shard"
    if allow_channel and scale.shape in ((rows, 1), (rows,)):
        return "channel"
    grid_text = f", {list(grid)} per {block[0]}x{block[1]} block" if block and grid else ""
    raise InvalidCheckpoint(
        f"{scale.path.name}: scale '{scale.name}' has shape {list(scale.shape)}, which fits no known convention "
        f"for a weight of {rows} rows ([] or [1] per tensor, [{rows}, 1] per channel{grid_text}"
        + (f", [{n_shards}] per fused shard)" if n_shards else ")")
    )


def experts_scale_kind(scale: TensorInfo, shape: tuple[int, ...], n_shards: int, block: Block) -> ScaleKind:
    """tensor, expert, shard ([E, n_shards], fused parameters only) or channel; else a clear error."""
    experts, _, out = shape
    _check_scale_dtype(scale)
    if scale.numel == 1 and len(scale.shape) <= 1:
        return "tensor"
    if scale.shape in ((experts,), (experts, 1), (experts, 1, 1)):
        return "expert"
    if n_shards > 1 and scale.shape == (experts, n_shards):
        return "shard"
    if scale.shape in ((experts, 1, out), (experts, out, 1)):
        return "channel"
    if block:
        raise UnsupportedCheckpoint(
            f"{scale.path.name}: block scales '{scale.name}' {list(scale.shape)} on stacked experts are not "
            "supported yet (fp8fix knows no published layout for them to check against)"
        )
    per_shard = f", [{experts}, {n_shards}] per expert and shard" if n_shards > 1 else ""
    raise InvalidCheckpoint(
        f"{scale.path.name}: scale '{scale.name}' has shape {list(scale.shape)}, which fits no known convention for "
        f"stacked experts {list(shape)} ([] per tensor, [{experts}] per expert{per_shard}, "
        f"[{experts}, 1, {out}] per channel)"
    )


def mx_scale(scale: TensorInfo) -> TensorInfo:
    """An MX weight scale as what its bytes are: E8M0 exponents (compressed-tensors stores them as U8)."""
    return replace(scale, dtype=E8M0) if scale.dtype == "U8" else scale


def mx_scale_kind(scale: TensorInfo, weight: TensorInfo) -> ScaleKind:
    """`block` for an MX weight [out, in] whose scale is E8M0 [out, in / 32] (in a multiple of 32: an MX block
    is never partial, OCP MX v1.0 section 5); else a clear error naming what was expected."""
    where = f"{scale.path.name}: MX scale '{scale.name}'"
    if scale.dtype != E8M0:
        raise InvalidCheckpoint(f"{where} is {scale.dtype}; an MX scale is one E8M0 byte per block (U8 or F8_E8M0)")
    if len(weight.shape) != 2 or weight.shape[1] % MX_BLOCK:
        raise UnsupportedCheckpoint(
            f"{weight.path.name}: MX weight '{weight.name}' {list(weight.shape)} is not whole blocks of {MX_BLOCK} "
            "along its input dimension; fp8fix reads MX weights without padding"
        )
    rows, cols = weight.shape
    if scale.shape != (rows, cols // MX_BLOCK):
        raise InvalidCheckpoint(
            f"{where} has shape {list(scale.shape)}; its weight '{weight.name}' {list(weight.shape)} has one scale "
            f"per {MX_BLOCK} elements of a row: [{rows}, {cols // MX_BLOCK}]"
        )
    return "block"


def _check_scale_dtype(scale: TensorInfo) -> None:
    if scale.dtype not in SCALE_DTYPES:
        raise UnsupportedCheckpoint(
            f"{scale.path.name}: scale '{scale.name}' is {scale.dtype}; fp8fix reads F32/BF16/F16/E8M0 scales"
        )


def block_grid(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-weight_shape[0] // block[0]), -(-weight_shape[1] // block[1])

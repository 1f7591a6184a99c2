"""The architecture registry: which modules each model family stores fused, and how to split them.

One JSON file per family in `architectures/` (the folder beside this module) is the
single place to teach fp8fix a model: its `config.architectures[0]` names, each fused
module's shards in row order, the row count of each shard as an expression over
config.json, and, where runtimes know them, the per-shard module names.

Entries are validated when they are loaded, built-in or `--arch-file` alike (the way
mergekit parses its JSON architectures into typed models): an unknown key, a value
of the wrong type or an expression that cannot be evaluated is an error naming the
file and the key, not a silent default later. The registry is a value passed to
whoever needs it, never a module global that one command changes for the next.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint, RegistryEntryError, UnsupportedCheckpoint
from fp8fix.io.json_text import MAX_FILE_BYTES, JsonRefused, parse_json
from fp8fix.io.source_tree import read_regular
from fp8fix.registry.entry_schema import parse_entry
from fp8fix.registry.expressions import ExpressionError, Sample, config_lookup, evaluate
from fp8fix.vocab import Layout


@dataclass(frozen=True)
class ShardSpec:
    shard: str  # logical name: q, k, v, gate, up
    size: str  # expression over config.json: rows (fused modules) or columns (stacked experts)
    unfused: str | None = None  # module suffix replacing the fused one in the unfused layout


@dataclass(frozen=True)
class FusedModuleSpec:
    module: str  # suffix of the module path, e.g. "self_attn.qkv_proj"
    shards: tuple[ShardSpec, ...]
    groups: str | None = None  # rows repeat per group (attention head / kv group): shard rows are per group
    #: "whole": one block-scale grid over the weight; "per-group": each group (a pre-sharded chunk) has its
    #: own grid of ceil(group rows / block) rows, so a block never spans two groups (MiMo-V2.5-Pro)
    block_grid: str = "whole"

    @property
    def can_unfuse(self) -> bool:
        return all(s.unfused for s in self.shards)

    def matches(self, module_path: str) -> bool:
        return module_path == self.module or module_path.endswith("." + self.module)

    def unfused_path(self, module_path: str, shard: ShardSpec) -> str:
        assert shard.unfused is not None
        return module_path[: len(module_path) - len(self.module)] + shard.unfused


@dataclass(frozen=True)
class ExpertsSpec:
    """MoE experts stored stacked, one 3-D tensor per parameter: [experts, in, out] (Llama-4,
    Qwen3-VL-MoE). `fused` names the parameters that hold several shards side by side on the
    LAST dimension (gate_up_proj: [gate | up]), each shard's width an expression over config.json."""

    module: str  # suffix of the experts module path, e.g. "feed_forward.experts"
    count: str  # expression: number of experts
    fused: dict[str, tuple[ShardSpec, ...]]  # parameter -> shards (ShardSpec.size: columns)

    def matches(self, tensor_name: str) -> bool:
        module = tensor_name.rpartition(".")[0]
        return module == self.module or module.endswith("." + self.module)


@dataclass(frozen=True)
class ArchitectureSpec:
    architectures: tuple[str, ...]
    fused_modules: tuple[FusedModuleSpec, ...]
    defaults: dict[str, str]
    source: str  # the file the entry came from, for messages
    experts: ExpertsSpec | None = None
    unfused_config: dict[str, Any] = field(default_factory=dict)  # config.json keys the unfused layout sets

    def fused_spec_for(self, module_path: str) -> FusedModuleSpec | None:
        return next((spec for spec in self.fused_modules if spec.matches(module_path)), None)

    @property
    def default_layout(self) -> Layout:
        """unfused where the runtimes know per-shard names for every fused module, else per-shard."""
        return "unfused" if self.fused_modules and all(m.can_unfuse for m in self.fused_modules) else "per-shard"

    def size(
        self,
        expression: str,
        what: str,
        config: dict[str, Any],
        variables: dict[str, Any] | None = None,
        read: set[str] | None = None,
    ) -> int:
        """A positive integer computed from config.json (and a module's `variables`), or a clear error
        naming `what` it sizes; the names of the `variables` it needed are added to `read`."""
        lookup = config_lookup(config, self.defaults, variables=variables)
        try:
            value = evaluate(expression, lookup)
            if read is not None:
                read |= lookup.variables_read
        except ExpressionError as e:
            raise InvalidCheckpoint(f"config.json: cannot size {what}: {e}") from e
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidCheckpoint(f"config.json: {what} gets {value!r} from '{expression}'")
        return value

    def row_layout(
        self,
        spec: FusedModuleSpec,
        config: dict[str, Any],
        module_path: str = "",
        stored: tuple[str, int] | None = None,
        memo: SizeMemo | None = None,
    ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Rows of each shard in total, and the (shard, first row, end row) segments in storage order.

        Contiguous modules store [q; k; v]; grouped ones (GPT-NeoX, Falcon, InternLM2, MiMo-V2.5's
        pre-sharded chunks) store [q; k; v] once per group, so each shard's rows are a segment in every
        group. Expressions may read the module's `layer` and `mtp` (see `module_variables`): MiMo's
        sliding-window and MTP layers have other head counts than its full-attention layers.
        With `stored` (the weight, as `file: 'name'` for messages, and its rows), totals that disagree stop
        before any segment is built: a config saying 10^9 heads must not make a billion segments first.
        `memo`: one for every module of one config.json, so each spec is sized once (`SizeMemo`).
        """
        where = f"{spec.module} of '{module_path}'" if module_path else spec.module
        variables = module_variables(module_path)
        per_group, groups = (memo or SizeMemo()).shard_sizes(self, spec, config, where, variables)
        totals = [rows * groups for rows in per_group]
        if stored is not None and sum(totals) != stored[1]:
            raise InvalidCheckpoint(
                f"{stored[0]} has {stored[1]} rows, but config.json makes its shards "
                f"{' + '.join(f'{s.shard} {r}' for s, r in zip(spec.shards, totals, strict=True))} = {sum(totals)}: "
                "the config does not match the weights"
            )
        segments, position = [], 0
        for _ in range(groups):
            for shard, rows in enumerate(per_group):
                segments.append((shard, position, position + rows))
                position += rows
        return totals, segments


def parse_architecture(data: Any, source: str) -> ArchitectureSpec:
    """Build a spec from one registry entry (the JSON format of `architectures/*.json`), validated."""
    entry = parse_entry(data, source)
    experts = entry.get("experts")
    spec = ArchitectureSpec(
        architectures=tuple(entry["architectures"]),
        fused_modules=tuple(
            FusedModuleSpec(
                module=m["module"],
                shards=tuple(ShardSpec(s["shard"], s["rows"], s.get("unfused")) for s in m["shards"]),
                groups=m.get("groups"),
                block_grid=m.get("block_grid", "whole"),
            )
            for m in entry.get("fused_modules", [])
        ),
        defaults=dict(entry.get("defaults", {})),
        source=source,
        unfused_config=dict(entry.get("unfused_config", {})),
        experts=None
        if experts is None
        else ExpertsSpec(
            module=experts["module"],
            count=experts["count"],
            fused={
                param: tuple(ShardSpec(s["shard"], s["columns"]) for s in shards)
                for param, shards in experts.get("fused", {}).items()
            },
        ),
    )
    _check_expressions(spec)
    return spec


#: Every config name an expression reads is taken as this when an entry is checked on load.
SAMPLE_VALUE = Sample(64)

_LAYER = re.compile(r"(?:^|\.)layers\.([0-9]+)(?:\.|$)")
#: A layer number has a few digits; int() refuses past 4,300 and nothing sensible has more than this.
MAX_LAYER_DIGITS = 18


class SizeMemo:
    """The shard sizes of the fused modules of one config.json, each module spec's worked out once per value
    of the path variables its expressions read (none, for most: a 7,500-layer checkpoint's 15,000 fused
    modules were sized 15,000 times per description; `layer` and `mtp` where an entry reads them).

    Keyed by the variables an evaluation read and their values: an evaluation reads them in an order that
    only their values decide (a branch, `a if layer < 3 else b`, is taken on a value read before), so one
    with the same values for the same names takes the same path to the same sizes."""

    def __init__(self) -> None:
        self._sizes: dict[tuple[int, tuple[str, ...], tuple[Any, ...]], tuple[list[int], int]] = {}
        self._reads: dict[int, list[tuple[str, ...]]] = {}

    def shard_sizes(
        self,
        arch: ArchitectureSpec,
        spec: FusedModuleSpec,
        config: dict[str, Any],
        where: str,
        variables: dict[str, Any],
    ) -> tuple[list[int], int]:
        """Each shard's rows per group, and the groups (1 where the spec has none)."""
        for names in self._reads.get(id(spec), ()):
            found = self._sizes.get((id(spec), names, tuple(variables[n] for n in names)))
            if found is not None:
                return list(found[0]), found[1]
        read: set[str] = set()
        per_group = [arch.size(s.size, f"shard '{s.shard}' of {where}", config, variables, read) for s in spec.shards]
        groups = arch.size(spec.groups, f"the groups of {where}", config, variables, read) if spec.groups else 1
        names = tuple(sorted(read))
        reads = self._reads.setdefault(id(spec), [])
        if names not in reads:
            reads.append(names)
        self._sizes[(id(spec), names, tuple(variables[n] for n in names))] = (list(per_group), groups)
        return per_group, groups


def module_variables(module_path: str) -> dict[str, int]:
    """What a module's path tells its expressions: `layer`, the index after its last `layers.` (0 when
    none), and `mtp`, 1 for a multi-token-prediction layer under an `mtp.` module (MiMo's
    `model.mtp.layers.N`), else 0."""
    found = _LAYER.findall(module_path)
    if found and len(found[-1]) > MAX_LAYER_DIGITS:
        raise InvalidCheckpoint(f"'{module_path[:80]}': a layer index of {len(found[-1])} digits is no layer number")
    return {"layer": int(found[-1]) if found else 0, "mtp": int(".mtp." in f".{module_path}.")}


def _check_expressions(spec: ArchitectureSpec) -> None:
    """Evaluate every expression against a sample config (each name SAMPLE_VALUE, defaults applied),
    so a malformed, cyclic or dividing-by-zero expression is refused when the entry is loaded."""

    def sample(name: str) -> Any:
        return SAMPLE_VALUE

    lookup = config_lookup({}, spec.defaults, missing=sample, variables={"layer": Sample(0), "mtp": Sample(0)})
    expressions: list[tuple[str, str]] = [(f"defaults.{k}", v) for k, v in spec.defaults.items()]
    for m in spec.fused_modules:
        expressions += [(f"rows of shard {s.shard} of {m.module}", s.size) for s in m.shards]
        expressions += [(f"groups of {m.module}", m.groups)] if m.groups else []
        if m.block_grid not in ("whole", "per-group") or (m.block_grid == "per-group" and not m.groups):
            raise RegistryEntryError(
                f"{spec.source}: block_grid of {m.module} is '{m.block_grid}': 'whole', or 'per-group' with groups"
            )
    if spec.experts:
        x = spec.experts
        expressions.append((f"count of {x.module}", x.count))
        expressions += [(f"columns of shard {s.shard} of {p}", s.size) for p, ss in x.fused.items() for s in ss]
    for where, text in expressions:
        try:
            value = evaluate(text, lookup)
        except ExpressionError as e:
            raise RegistryEntryError(f"{spec.source}: {where}: {e}") from e
        if not where.startswith("defaults.") and (not isinstance(value, int) or isinstance(value, bool)):
            raise RegistryEntryError(f"{spec.source}: {where}: '{text}' is not a whole number ({value!r})")


@cache
def _builtin_entries() -> dict[str, ArchitectureSpec]:
    entries: dict[str, ArchitectureSpec] = {}
    folder = Path(__file__).parent / "architectures"  # importlib.resources would cost 5 ms of start-up
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".json"):
            spec = parse_architecture(parse_json(entry.read_text(encoding="utf-8")), entry.name)
            entries.update(dict.fromkeys(spec.architectures, spec))
    return entries


def read_arch_file(path: Path) -> ArchitectureSpec:
    """A user's registry entry (the format of `architectures/*.json`), validated."""
    try:
        data = parse_json(read_regular(path, MAX_FILE_BYTES))
    except OSError as e:
        raise RegistryEntryError(f"{path}: cannot read the architecture file: {e.strerror or e}") from e
    except InvalidCheckpoint as e:  # a FIFO, a device, a file too large
        raise RegistryEntryError(f"{path}: {str(e).partition(': ')[2]}") from None
    except JsonRefused as e:
        raise RegistryEntryError(f"{path}: invalid JSON: {e}") from None
    return parse_architecture(data, str(path))


def architecture_name(config: dict[str, Any]) -> str | None:
    """config.json's `architectures[0]`, the model class the registry is keyed by; None if absent."""
    names = config.get("architectures")
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


#: Module names that hold several projections in one tensor, across families: the on-disk names of the
#: registry's fused modules and of the modules vLLM's models pack (`packed_modules_mapping`) or load
#: fused (Qwen2-VL's visual `attn.qkv`, Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`, DeepSeek's
#: `fused_qkv_a_proj_with_mqa`). An FP8 weight named so must be described by a registry entry.
FUSED_LOOKING_NAMES = frozenset(
    {
        "qkv_proj",
        "gate_up_proj",
        "query_key_value",
        "W_pack",
        "Wqkv",
        "wqkv",
        "c_attn",
        "dense_h_to_4h",
        "qkv",
        "w13",
        "in_proj_qkvz",
        "in_proj_ba",
        "fused_qkv_a_proj_with_mqa",
    }
)


def looks_fused(module_path: str) -> bool:
    """True when the module's own name (its last component) is one of `FUSED_LOOKING_NAMES`."""
    return module_path.rpartition(".")[2] in FUSED_LOOKING_NAMES


def unregistered(name: str) -> ArchitectureSpec:
    """The entry of an architecture without one whose FP8 weights look unfused: nothing to split, the
    other conversions (`--to`, format repairs, verify) apply."""
    return ArchitectureSpec((name,), (), {}, "no registry entry")


def unregistered_note(name: str) -> str:
    """What convert and inspect say of an architecture converted without a registry entry."""
    return (
        f"architecture {name} has no registry entry; none of its FP8 weights looks fused (qkv_proj, "
        "gate_up_proj, ...), so every module is converted as it is stored"
    )


@dataclass(frozen=True)
class Registry:
    """Architecture name -> entry: the built-in entries, overridden by any `--arch-file` entries."""

    entries: Mapping[str, ArchitectureSpec] = field(default_factory=dict)

    @classmethod
    def builtin(cls) -> Registry:
        return cls(_builtin_entries())

    def extended(self, specs: Iterable[ArchitectureSpec]) -> Registry:
        """A registry whose entries for each of `specs`' architectures are those specs."""
        entries = dict(self.entries)
        for spec in specs:
            entries.update(dict.fromkeys(spec.architectures, spec))
        return Registry(entries)

    def with_arch_files(self, paths: Iterable[Path]) -> Registry:
        return self.extended(read_arch_file(p) for p in paths)

    def get(self, name: str | None) -> ArchitectureSpec | None:
        return self.entries.get(name) if name else None

    def with_experts(self) -> list[str]:
        return sorted(name for name, spec in self.entries.items() if spec.experts)

    def lookup(self, config: dict[str, Any], fp8_modules: Iterable[str] = ()) -> tuple[str, ArchitectureSpec]:
        """The entry for config.json's `architectures[0]`; for an architecture without one, an entry
        with no fused modules (`unregistered`). Either way a clear error when one of the FP8 linear
        `fp8_modules` looks fused (`looks_fused`) but the entry does not describe it: where its shards
        lie is what an entry says, and guessing it would convert the checkpoint wrongly."""
        name = architecture_name(config)
        if name is None:
            raise InvalidCheckpoint("config.json: has no 'architectures' list naming the model class")
        spec = self.get(name)
        fused = next((m for m in fp8_modules if looks_fused(m) and (spec is None or not spec.fused_spec_for(m))), None)
        if fused is not None:
            entry = "is not in fp8fix's registry" if spec is None else f"has an entry ({spec.source}) without it"
            raise UnsupportedCheckpoint(
                f"config.json: architecture {name} {entry}, and its FP8 weight '{fused}.weight' looks fused "
                f"(several projections in one tensor), so fp8fix cannot tell where its shards lie; known: "
                f"{', '.join(sorted(self.entries))}. Describe it in a JSON file (the format of "
                "fp8fix/registry/architectures/*.json) and pass --arch-file"
            )
        return name, spec or unregistered(name)

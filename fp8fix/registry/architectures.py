"""The architecture registry: which modules each model family stores fused, and how to split them.

One JSON file per family in `architectures/` (the folder beside this module) is the
single place to teach fp8fix a model: its `config.architectures[0]` names, each fused
module's shards in row order, the row count of each shard as an expression over
config.json, and, where runtimes know them, the per-shard module names.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint
from fp8fix.registry.expressions import ExpressionError, evaluate


@dataclass(frozen=True)
class ShardSpec:
    shard: str  # logical name: q, k, v, gate, up
    rows: str  # expression over config.json
    unfused: str | None  # module suffix replacing the fused one in the unfused layout


@dataclass(frozen=True)
class FusedModuleSpec:
    module: str  # suffix of the module path, e.g. "self_attn.qkv_proj"
    shards: tuple[ShardSpec, ...]
    groups: str | None = None  # rows repeat per group (attention head / kv group): shard rows are per group

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
    experts: str  # expression: number of experts
    fused: dict[str, tuple[ShardSpec, ...]]  # parameter -> shards (ShardSpec.rows holds the width)

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

    def fused_spec_for(self, module_path: str) -> FusedModuleSpec | None:
        return next((spec for spec in self.fused_modules if spec.matches(module_path)), None)

    def size(self, expression: str, what: str, config: dict[str, Any]) -> int:
        """A positive integer computed from config.json, or a clear error naming `what` it sizes."""
        try:
            value = evaluate(expression, _config_lookup(config, self.defaults))
        except ExpressionError as e:
            raise InvalidCheckpoint(f"config.json: cannot size {what}: {e}") from e
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidCheckpoint(f"config.json: {what} gets {value!r} from '{expression}'")
        return value

    def shard_rows(self, spec: FusedModuleSpec, config: dict[str, Any]) -> list[int]:
        """Rows of each shard of `spec`, computed from config.json."""
        return [self.size(s.rows, f"shard '{s.shard}' of {spec.module}", config) for s in spec.shards]

    def row_layout(self, spec: FusedModuleSpec, config: dict[str, Any]) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Rows of each shard in total, and the (shard, first row, end row) segments in storage order.

        Contiguous modules store [q; k; v]; grouped ones (GPT-NeoX, Falcon, InternLM2) store
        [q; k; v] once per group, so each shard's rows are a segment in every group.
        """
        per_group = self.shard_rows(spec, config)
        groups = self.size(spec.groups, f"the groups of {spec.module}", config) if spec.groups else 1
        segments, position = [], 0
        for _ in range(groups):
            for shard, rows in enumerate(per_group):
                segments.append((shard, position, position + rows))
                position += rows
        return [rows * groups for rows in per_group], segments


def parse_architecture(data: dict[str, Any], source: str) -> ArchitectureSpec:
    """Build a spec from one registry entry (the JSON format of `architectures/*.json`)."""
    try:
        fused = tuple(
            FusedModuleSpec(
                module=m["module"],
                shards=tuple(ShardSpec(s["shard"], s["rows"], s.get("unfused")) for s in m["shards"]),
                groups=m.get("groups"),
            )
            for m in data.get("fused_modules", [])
        )
        experts = data.get("experts")
        if experts is not None:
            experts = ExpertsSpec(
                module=experts["module"],
                experts=experts["count"],
                fused={
                    param: tuple(ShardSpec(s["shard"], s["columns"], None) for s in shards)
                    for param, shards in experts.get("fused", {}).items()
                },
            )
        return ArchitectureSpec(tuple(data["architectures"]), fused, dict(data.get("defaults", {})), source, experts)
    except (KeyError, TypeError) as e:
        raise UnsupportedCheckpoint(f"{source}: malformed architecture entry ({e!r})") from e


@cache
def builtin_architectures() -> dict[str, ArchitectureSpec]:
    """Every built-in entry, by architecture name."""
    registry: dict[str, ArchitectureSpec] = {}
    folder = resources.files("fp8fix.registry") / "architectures"
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".json"):
            spec = parse_architecture(json.loads(entry.read_text(encoding="utf-8")), entry.name)
            for name in spec.architectures:
                registry[name] = spec
    return registry


#: Entries loaded with --arch-file: they extend the built-in registry and win over it.
_USER_ENTRIES: dict[str, ArchitectureSpec] = {}


def load_arch_file(path: Path) -> list[str]:
    """Add a user's registry entry (the format of `architectures/*.json`); return the names it covers."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidCheckpoint(f"{path}: cannot read the architecture file: {e}") from e
    except json.JSONDecodeError as e:
        raise InvalidCheckpoint(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(data, dict) or not isinstance(data.get("architectures"), list):
        raise InvalidCheckpoint(f"{path}: an architecture file needs an 'architectures' list and 'fused_modules'")
    spec = parse_architecture(data, str(path))
    for module in spec.fused_modules:
        if len(module.shards) < 2:
            raise InvalidCheckpoint(f"{path}: fused module {module.module} needs at least two shards")
        for shard in module.shards:
            try:
                ast.parse(shard.rows, mode="eval")
            except SyntaxError as e:
                raise InvalidCheckpoint(f"{path}: rows of shard {shard.shard} of {module.module}: {e.msg}") from e
    for name in spec.architectures:
        _USER_ENTRIES[name] = spec
    return list(spec.architectures)


def known_architectures() -> dict[str, ArchitectureSpec]:
    return {**builtin_architectures(), **_USER_ENTRIES}


def architecture_for(config: dict[str, Any]) -> tuple[str, ArchitectureSpec]:
    """The registry entry for config.json's `architectures[0]`, or a clear error listing what is known."""
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise InvalidCheckpoint("config.json: has no 'architectures' list naming the model class")
    registry = known_architectures()
    if names[0] not in registry:
        raise UnsupportedCheckpoint(
            f"config.json: architecture {names[0]} is not in fp8fix's registry, so fp8fix cannot tell which "
            f"modules are fused; supported: {', '.join(sorted(registry))}. Describe it in a JSON file "
            "(the format of fp8fix/registry/architectures/*.json) and pass --arch-file"
        )
    return names[0], registry[names[0]]


def _config_lookup(config: dict[str, Any], defaults: dict[str, str]):  # type: ignore[no-untyped-def]
    def lookup(name: str) -> Any:
        value: Any = config
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            if name in defaults:
                return evaluate(defaults[name], lookup)
            raise ExpressionError(f"config.json has no '{name}'")
        return value

    return lookup

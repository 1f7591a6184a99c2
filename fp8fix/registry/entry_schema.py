"""The JSON schema of an architecture entry, and a validator that names the offending key.

Small on purpose (no jsonschema dependency): each object lists its keys with their
type and whether they are required; anything else is refused, so a typo such as
`"unfuse"` is an error instead of an unfused layout that silently vanishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8fix.errors import RegistryEntryError


@dataclass(frozen=True)
class Key:
    kind: Any  # str, a nested schema dict, ("list", item, min_items) or ("map", value)
    required: bool = False


TEXT = Key(str)
EXPRESSION = Key(str, required=True)

SHARD: dict[str, Key] = {"shard": Key(str, True), "rows": EXPRESSION, "unfused": TEXT}
FUSED_MODULE: dict[str, Key] = {
    "module": Key(str, True),
    "shards": Key(("list", SHARD, 2), True),
    "groups": TEXT,
    "block_grid": TEXT,
    "notes": TEXT,
}
EXPERT_SHARD: dict[str, Key] = {"shard": Key(str, True), "columns": EXPRESSION}
EXPERTS: dict[str, Key] = {
    "module": Key(str, True),
    "count": EXPRESSION,
    "fused": Key(("map", ("list", EXPERT_SHARD, 2))),
    "notes": TEXT,
}
ENTRY: dict[str, Key] = {
    "architectures": Key(("list", str, 1), True),
    "notes": TEXT,
    "defaults": Key(("map", str)),
    "fused_modules": Key(("list", FUSED_MODULE, 0)),
    "experts": Key(EXPERTS),
    "unfused_config": Key(("map", object)),
}


def parse_entry(data: Any, source: str) -> dict[str, Any]:
    """`data` itself when it follows ENTRY; else an error naming `source` and the key."""
    _check(data, ENTRY, source, "the entry")
    assert isinstance(data, dict)
    return data


def _check(value: Any, kind: Any, source: str, where: str) -> None:
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            raise RegistryEntryError(f"{source}: {where} must be a JSON object")
        unknown = sorted(set(value) - set(kind))
        if unknown:
            raise RegistryEntryError(f"{source}: unknown key '{unknown[0]}' in {where} (allowed: {', '.join(kind)})")
        for key, spec in kind.items():
            if key in value:
                _check(value[key], spec.kind, source, f"{where}.{key}" if where != "the entry" else key)
            elif spec.required:
                raise RegistryEntryError(f"{source}: {where} has no '{key}'")
    elif isinstance(kind, tuple) and kind[0] == "list":
        _, item, min_items = kind
        if not isinstance(value, list) or len(value) < min_items:
            raise RegistryEntryError(f"{source}: {where} must be a list of at least {min_items}")
        for i, element in enumerate(value):
            _check(element, item, source, f"{where}[{i}]")
    elif isinstance(kind, tuple) and kind[0] == "map":
        if not isinstance(value, dict):
            raise RegistryEntryError(f"{source}: {where} must be a JSON object")
        for key, element in value.items():
            _check(element, kind[1], source, f"{where}.{key}")
    elif not isinstance(value, kind):
        raise RegistryEntryError(f"{source}: {where} must be a {kind.__name__}, not {value!r}"[:300])

"""JSON as fp8fix reads it: bounded in size, depth and numbers, and never a traceback.

Python's `json` accepts things other readers refuse (NaN, Infinity, lone UTF-16
surrogates, 100,000-deep nesting that ends in RecursionError, integers that
raise ValueError past 4,300 digits). Every JSON file fp8fix reads goes through
`parse_json`, which turns each of these into a `JsonRefused` with the reason;
callers add the file name. With `strict=True` it reads numbers the way
safetensors' serde_json does, for headers (see io/safetensors_file.py).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: serde_json's recursion limit, which safetensors inherits: 127 nested containers pass, 128 do not.
MAX_DEPTH = 127
#: Config, index and registry files are kilobytes to a few megabytes; anything past this is not one.
MAX_FILE_BYTES = 100_000_000

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
#: Digits all read as one, so a run of 21 (an integer past u64) is a plain substring search.
_ONE_DIGIT = str.maketrans("123456789", "000000000")


class JsonRefused(ValueError):
    """The text is not JSON fp8fix accepts; the message says why (without the file name)."""


class KeyedObject(dict[str, Any]):
    """A JSON object that remembers which keys it held more than once (safetensors refuses some)."""

    duplicates: frozenset[str] = frozenset()


def _object(pairs: list[tuple[str, Any]]) -> KeyedObject:
    obj = KeyedObject(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicates = frozenset(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return obj


def _integer(text: str) -> int | float:
    """Integers as serde_json reads them: past u64 (20 digits) a float, '-0' the float -0.0."""
    if len(text.lstrip("-")) > 20:
        return float(text)  # inf past ~309 digits; never int()'s 4,300-digit ValueError
    return -0.0 if text == "-0" else int(text)


def _in_range(value: int | float, text: str) -> int | float:
    """serde_json refuses a number past the float range (~1.8e308), where Python reads inf."""
    if isinstance(value, float) and math.isinf(value):
        raise JsonRefused(f"number {text[:20]}... is out of range")
    return value


def _finite_integer(text: str) -> int | float:
    return _in_range(_integer(text), text)


def _finite(text: str) -> float:
    return float(_in_range(float(text), text))


def _no_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not JSON")


def parse_json(text: str | bytes, *, strict: bool = False, keyed: bool = True, check_depth: bool = True) -> Any:
    """Parse `text` (UTF-8 when bytes: a BOM or UTF-16 is refused, as safetensors does).

    strict: no NaN/Infinity, no number out of float range (safetensors headers).
    keyed: objects are `KeyedObject`s that remember duplicate keys (a third slower; a caller
    that can tell duplicates are impossible from counts skips it, see io/safetensors_file.py).
    check_depth: nesting at most MAX_DEPTH (a caller that knows where nesting can occur checks there).
    Always: no lone surrogate escapes (which cannot be written back as UTF-8).
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonRefused(f"not UTF-8 (byte {e.start})") from None
    try:
        # integers Python's int() reads differently from serde_json: past 20 digits, and -0. The
        # per-integer hook costs a fifth of the parse, so it runs only where such a literal may be.
        odd_integers = "-0" in text or "0" * 21 in text.translate(_ONE_DIGIT)
        value = json.loads(
            text,
            object_pairs_hook=_object if keyed else None,
            parse_int=(_finite_integer if strict else _integer) if odd_integers else None,
            parse_float=_finite if strict else float,
            parse_constant=_no_constant if strict else None,
        )
    except RecursionError:
        raise JsonRefused(f"nested more than {MAX_DEPTH} levels deep") from None
    except JsonRefused:
        raise
    except ValueError as e:  # json.JSONDecodeError included
        raise JsonRefused(str(e)) from None
    if check_depth and depth(value) > MAX_DEPTH:
        raise JsonRefused(f"nested more than {MAX_DEPTH} levels deep")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise JsonRefused("a string holds a lone UTF-16 surrogate escape, which is not Unicode text")
    return value


def depth(value: Any) -> int:
    """Nesting depth of containers, iteratively (never a RecursionError)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        strings: list[Any] = []
        if isinstance(node, dict):
            strings = list(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            strings = [node]
        for s in strings:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False

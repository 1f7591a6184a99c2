"""A tiny, safe evaluator for the size expressions of architecture entries.

Entries say `"rows": "num_key_value_heads * head_dim"`; this evaluates such text
against config.json without `eval`: integers, config names (dotted for nested
objects, as in `attn_config.kv_n_heads`), + - * //, parentheses, `a if c else b` and
indexing a config list with a whole number (`hybrid_layer_pattern[layer]`).
Expressions are small by nature, so their size and nesting are capped: a hostile
`--arch-file` cannot make fp8fix recurse or compute for long.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

#: Limits on one expression: characters of text and nodes of its syntax tree.
MAX_TEXT = 500
MAX_NODES = 100
#: The largest value arithmetic may make: sizes are far below it, and products of products of config
#: values (a hostile `--arch-file`'s `defaults` chain) must not grow into numbers of millions of digits.
MAX_VALUE = 2**62

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
}


class ExpressionError(ValueError):
    """The expression is malformed or names a value the config does not have."""


def evaluate(text: str, lookup: Callable[[str], Any]) -> Any:
    """Evaluate `text`, resolving each (dotted) name with `lookup`."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise ExpressionError(f"an expression must be text of at most {MAX_TEXT} characters")
    try:
        return _eval(_parsed(text).body, lookup, text)
    except ZeroDivisionError as e:
        raise ExpressionError(f"{text!r} divides by zero") from e


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> ast.Expression:
    """`text`'s syntax tree, checked for size; parsed once per text (a checkpoint of 30k fused modules sizes
    each from the same few expressions; a refusal is not cached, it is raised again)."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ExpressionError(f"invalid expression {text!r}") from e
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ExpressionError(f"expression {text[:40]!r}... has more than {MAX_NODES} terms")
    return tree


def _eval(node: ast.AST, lookup: Callable[[str], Any], text: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool)):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        return lookup(_dotted(node, text))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, lookup, text), _eval(node.right, lookup, text)
        if not all(isinstance(v, (int, bool)) for v in (left, right)):
            raise ExpressionError(f"{text!r}: arithmetic on a value that is not a whole number ({left!r}, {right!r})")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > MAX_VALUE:
            raise ExpressionError(f"{text!r} makes {_digits(value)}, too large to be a size")
        return value
    if isinstance(node, ast.IfExp):
        branch = node.body if _eval(node.test, lookup, text) else node.orelse
        return _eval(branch, lookup, text)
    if isinstance(node, ast.Subscript):
        return _index(_eval(node.value, lookup, text), _eval(node.slice, lookup, text), text)
    raise ExpressionError(f"unsupported syntax in {text!r}: {ast.dump(node)[:80]}")


def _digits(value: int) -> str:
    return f"a number of {len(str(abs(value)))} digits" if abs(value) < 10**100 else "a number of over 100 digits"


def _index(value: Any, index: Any, text: str) -> Any:
    """`value[index]`: a config list indexed by a whole number inside it (`Sample` stands for any list)."""
    if isinstance(value, Sample):
        return value
    if not isinstance(value, list) or not isinstance(index, int) or isinstance(index, bool):
        raise ExpressionError(
            f"{text!r}: only a config list can be indexed, by a whole number ({value!r}[{index!r}])"[:200]
        )
    if not 0 <= index < len(value):
        raise ExpressionError(f"{text!r}: index {index} is outside the config list of {len(value)}")
    return value[index]


class Sample(int):
    """The value every config name takes when an entry is checked on load: a whole number that also
    indexes like a list of itself, so `hybrid_layer_pattern[layer]` can be checked without a config."""


def _dotted(node: ast.AST, text: str) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value, text)}.{node.attr}"
    raise ExpressionError(f"unsupported name in {text!r}")


def config_lookup(
    config: dict[str, Any],
    defaults: dict[str, str],
    missing: Callable[[str], Any] | None = None,
    variables: dict[str, Any] | None = None,
) -> _ConfigLookup:
    """Resolve a name in `variables` (what a module's path says: `layer`, `mtp`), then a dotted name
    in `config`; absent names through their `defaults` expression, then `missing` (else an error).
    A default that needs itself, directly or not, is an error. Each default is worked out once per
    lookup: a chain of defaults that each use the next twice would otherwise take 2^n steps."""
    return _ConfigLookup(config, defaults, missing, variables)


class _ConfigLookup:
    """`config_lookup`'s resolver: an object, not a closure that calls itself (a reference cycle that only
    the cyclic collector frees: one per size worked out, 60k of them for a 30k-layer checkpoint)."""

    def __init__(
        self,
        config: dict[str, Any],
        defaults: dict[str, str],
        missing: Callable[[str], Any] | None,
        variables: dict[str, Any] | None,
    ) -> None:
        self.config, self.defaults, self.missing, self.variables = config, defaults, missing, variables
        self.resolving: list[str] = []
        self.known: dict[str, Any] = {}
        self.variables_read: set[str] = set()  # which of `variables` the expressions needed (`SizeMemo`)

    def __call__(self, name: str) -> Any:
        if self.variables and name in self.variables:
            self.variables_read.add(name)
            return self.variables[name]
        value: Any = self.config
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            return value
        if name in self.known:
            return self.known[name]
        if name in self.defaults:
            if name in self.resolving:
                raise ExpressionError(f"defaults are cyclic: {' -> '.join([*self.resolving, name])}")
            self.resolving.append(name)
            try:
                self.known[name] = evaluate(self.defaults[name], self)
            finally:
                self.resolving.pop()
            return self.known[name]
        if self.missing is not None:
            return self.missing(name)
        raise ExpressionError(f"config.json has no '{name}'")

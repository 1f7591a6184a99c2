"""A tiny, safe evaluator for the row-count expressions of architecture entries.

Entries say `"rows": "num_key_value_heads * head_dim"`; this evaluates such text
against config.json without `eval`: integers, config names (dotted for nested
objects, as in `attn_config.kv_n_heads`), + - * //, parentheses and `a if c else b`.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

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
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"invalid expression {text!r}") from e
    return _eval(tree.body, lookup, text)


def _eval(node: ast.AST, lookup: Callable[[str], Any], text: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool)):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        return lookup(_dotted(node, text))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval(node.left, lookup, text), _eval(node.right, lookup, text))
    if isinstance(node, ast.IfExp):
        branch = node.body if _eval(node.test, lookup, text) else node.orelse
        return _eval(branch, lookup, text)
    raise ExpressionError(f"unsupported syntax in {text!r}: {ast.dump(node)}")


def _dotted(node: ast.AST, text: str) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value, text)}.{node.attr}"
    raise ExpressionError(f"unsupported name in {text!r}")

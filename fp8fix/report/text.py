"""Text helpers every report shares: compact names for many modules, human sizes, printable lines."""

from __future__ import annotations

import math
import re

#: Control characters (C0 but tab, DEL, C1): a name from a checkpoint holding one could forge a line
#: (a newline then `Error: ...`) or drive the terminal (ESC sequences).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(line: str) -> str:
    """`line` with every control character written as its escape (`\\n`, `\\x1b`), so what
    fp8fix prints is one line, and inert on a terminal, whatever names a checkpoint holds."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], line)


def joined(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c': names in a sentence (loader rows hold commas of their own only rarely)."""
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else "".join(names)


def name_pattern(names: list[str]) -> str:
    """One compact name for many: 'model.layers.{0..31}.mlp.gate_up_proj',
    'model.layers.{0..47}.mlp.experts.{0..127}.{down_proj,gate_proj,up_proj}',
    'model.layers.0.{mlp.down_proj,self_attn.o_proj}'.

    Names that differ only in their numbers collapse into one pattern per shape, each number
    position a span, when the spans' every combination is there (a pattern never names a module
    that is not); the patterns then share their common leading components. Anything else is the
    first name and a count."""
    unique = list(dict.fromkeys(names))
    if len(unique) == 1:
        return unique[0]
    shapes: dict[tuple[str, ...], list[list[str]]] = {}
    for name in unique:
        parts = name.split(".")
        shapes.setdefault(tuple("#" if _number(p) else p for p in parts), []).append(parts)
    patterns = []
    for shape, members in shapes.items():
        numbers = [sorted({int(m[i]) for m in members}) for i, part in enumerate(shape) if part == "#"]
        if math.prod(len(n) for n in numbers) != len(members):  # not a full grid of numbers
            return f"{unique[0]} (+{len(unique) - 1} more)"
        spans = iter(_span(n) for n in numbers)
        patterns.append([next(spans) if part == "#" else part for part in shape])
    if len(patterns) == 1:
        return ".".join(patterns[0])
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == patterns[0][shared] for p in patterns):
        shared += 1
    rests = sorted(".".join(p[shared:]) for p in patterns)
    return ".".join([*patterns[0][:shared], "{" + ",".join(rests) + "}"])


def _span(numbers: list[int]) -> str:
    """0 / {0,1} / {0..31}: one number as itself, a run of more than two as a range."""
    if len(numbers) == 1:
        return str(numbers[0])
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{{{numbers[0]}..{numbers[-1]}}}"
    return "{" + ",".join(map(str, numbers)) + "}"


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _number(part: str) -> bool:
    """A name part that is a layer or expert number: ASCII digits, few enough for int()."""
    return part.isascii() and part.isdigit() and len(part) <= 18

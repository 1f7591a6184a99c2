"""Text helpers every report shares: compact names for many modules, human sizes."""

from __future__ import annotations

import re


def name_pattern(names: list[str]) -> str:
    """One compact name for many: 'model.layers.{0..31}.mlp.gate_up_proj',
    'model.layers.{0..1}.{mlp.down_proj,self_attn.o_proj}'."""
    unique = list(dict.fromkeys(names))
    if len(unique) == 1:
        return unique[0]
    parts = [re.match(r"^(.*?\.)(\d+)(\..*)$", n) for n in unique]
    if not all(parts) or len({p.group(1) for p in parts if p}) != 1:
        return f"{unique[0]} (+{len(unique) - 1} more)"
    layers = sorted({int(p.group(2)) for p in parts if p})
    tails = sorted({p.group(3)[1:] for p in parts if p})
    span = (
        f"{layers[0]}..{layers[-1]}"
        if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1))
        else ",".join(map(str, layers))
    )
    tail = tails[0] if len(tails) == 1 else "{" + ",".join(tails) + "}"
    return f"{parts[0].group(1)}{{{span}}}.{tail}" if parts[0] else unique[0]


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"

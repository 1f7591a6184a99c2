"""OUTPUT's model card, checked for the facts a reader (and the Hub) takes from it.

Read as plain text, without convert's card code: the card must say it was converted by
fp8fix, name the layout OUTPUT really has (`unfused` exactly where fused modules were
renamed into their shards), carry the `e4m3fnuz` tag and the encoding line exactly where
the FP8 weights changed encoding, and keep the `fp8` and `fp8fix` tags the Hub lists it by.
"""

from __future__ import annotations

import re

from fp8fix.errors import InvalidCheckpoint
from fp8fix.io.checkpoint import CARD, card_front_matter
from fp8fix.io.source_tree import read_regular
from fp8fix.numerics.dtypes import E4M3FNUZ, is_fp8
from fp8fix.verification.context import VerifyContext, fp8_weight_dtypes
from fp8fix.verification.report import METADATA

#: A card fp8fix writes is kilobytes; verify reads at most this much of OUTPUT's.
MAX_CARD_BYTES = 16 * 1024 * 1024
_LAYOUT = re.compile(r"^- Layout: \*\*([a-z-]+)\*\*$", re.MULTILINE)
_CONVERTED = re.compile(r"^Converted from `([^`\n]*)` with fp8fix ", re.MULTILINE)


def check_card(ctx: VerifyContext, renames: dict[str, list[str]]) -> None:
    path = ctx.out.root / CARD
    try:
        text = read_regular(path, MAX_CARD_BYTES, follow_links=False).decode("utf-8", errors="replace")
    except FileNotFoundError:
        ctx.report.problem(f"{CARD}: missing; a conversion writes a model card", METADATA, edit=True)
        return
    except InvalidCheckpoint as e:
        ctx.report.problem(str(e), METADATA)
        return

    def problem(text: str) -> None:
        ctx.report.problem(text, METADATA, edit=True)

    found = card_front_matter(text)
    if found is None:
        problem(f"{CARD}: no front matter")
        return
    tags, body = found
    body = fp8fix_section(body)
    fp8 = any(is_fp8(t.dtype) for t in ctx.out.tensors.values())
    for tag in ("fp8", "fp8fix") if fp8 else ("fp8fix",):
        if tag not in tags:
            problem(f"{CARD}: no `{tag}` tag")
    if not fp8 and "fp8" in tags:
        problem(f"{CARD}: an `fp8` tag on a model with no FP8 weights")
    converted = _CONVERTED.findall(body)
    if not converted:
        problem(f"{CARD}: does not say what it was converted from")
    elif ctx.source_name is not None and set(converted) != {ctx.source_name}:
        problem(f"{CARD}: says it was converted from `{converted[0]}`; SOURCE is `{ctx.source_name}`")
    layouts = _LAYOUT.findall(body)
    said = layouts[0] if len(layouts) == 1 else "no one layout"
    held = _fused_layout(ctx)
    if renames and said != "unfused":
        problem(f"{CARD}: says {said}, but OUTPUT holds SOURCE's fused modules unfused")
    elif not renames and said == "unfused" and ctx.model.fused:
        problem(f"{CARD}: says unfused, but OUTPUT keeps SOURCE's fused modules")
    elif not renames and held is not None and said != held and held != "channel":
        problem(f"{CARD}: says {said}, but OUTPUT's fused modules have the {held} layout's scales")
    encodings = fp8_weight_dtypes(ctx, "OUTPUT")
    recoded = bool(encodings) and encodings != fp8_weight_dtypes(ctx, "SOURCE")
    if recoded != ("FP8 encoding: e4m3fn" in body and "->" in body):
        problem(f"{CARD}: {'does not say' if recoded else 'says'} the FP8 weights changed encoding")
    if recoded and encodings == {E4M3FNUZ} and "e4m3fnuz" not in tags:
        problem(f"{CARD}: no `e4m3fnuz` tag on e4m3fnuz weights")


def _fused_layout(ctx: VerifyContext) -> str | None:
    """The layout OUTPUT's fused FP8 modules have, read off their weight scales' sizes: one value `fused`, one
    per shard `per-shard`, one per row `channel` (which a source's per-row scales keep under any layout but
    `unfused`: not checked); None where none is FP8 with such a scale, or they differ."""
    found = set()
    for module in ctx.model.fused.values():
        weight = ctx.out.tensors.get(f"{module.path}.weight")
        scale = ctx.out.tensors.get(f"{module.path}.{ctx.fmt.weight_scale}")
        if weight is None or scale is None or not is_fp8(weight.dtype) or len(scale.shape) > 2:
            continue
        if len(scale.shape) == 2 and scale.shape[1] != 1:
            continue  # a block grid: no per-tensor layout
        rows, shards = weight.shape[0], len(module.rows)
        found.add({1: "fused", shards: "per-shard", rows: "channel"}.get(scale.numel, "?"))
    return found.pop() if len(found) == 1 and "?" not in found else None


def fp8fix_section(text: str) -> str:
    """The card's text up to SOURCE's own card, which fp8fix keeps below it (and which may be one too)."""
    return text.split("\n## Original model card\n")[0]

"""OUTPUT's model card, checked for the facts a reader (and the Hub) takes from it.

Read as plain text, without convert's card code: the card must say it was converted by
fp8fix, name the layout OUTPUT really has (`unfused` exactly where fused modules were
renamed into their shards), carry the `e4m3fnuz` tag and the encoding line exactly where
the FP8 weights changed encoding, and keep the `fp8` and `fp8fix` tags the Hub lists it by.
"""

from __future__ import annotations

import re

from fp8fix.errors import InvalidCheckpoint
from fp8fix.io.checkpoint import CARD
from fp8fix.io.source_tree import read_regular
from fp8fix.numerics.dtypes import E4M3FN, E4M3FNUZ, is_fp8
from fp8fix.verification.context import VerifyContext

#: A card fp8fix writes is kilobytes; verify reads at most this much of OUTPUT's.
MAX_CARD_BYTES = 16 * 1024 * 1024
_LAYOUT = re.compile(r"^- Layout: \*\*([a-z-]+)\*\*$", re.MULTILINE)
_CONVERTED = re.compile(r"^Converted from `[^`\n]*` with fp8fix ", re.MULTILINE)


def check_card(ctx: VerifyContext, renames: dict[str, list[str]]) -> None:
    path = ctx.out.root / CARD
    try:
        text = read_regular(path, MAX_CARD_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        ctx.report.problem(f"{CARD}: missing; a conversion writes a model card")
        return
    except InvalidCheckpoint as e:
        ctx.report.problem(str(e))
        return
    problem = ctx.report.problem
    front, _, body = text.removeprefix("---\n").partition("\n---\n")
    if not text.startswith("---\n") or not body:
        problem(f"{CARD}: no front matter")
        return
    tags = _tags(front.splitlines())
    body = body.split("\n## Original model card\n")[0]  # fp8fix's section: SOURCE's own card may be one too
    fp8 = any(is_fp8(t.dtype) for t in ctx.out.tensors.values())
    for tag in ("fp8", "fp8fix") if fp8 else ("fp8fix",):
        if tag not in tags:
            problem(f"{CARD}: no `{tag}` tag")
    if not fp8 and "fp8" in tags:
        problem(f"{CARD}: an `fp8` tag on a model with no FP8 weights")
    if not _CONVERTED.search(body):
        problem(f"{CARD}: does not say what it was converted from")
    layouts = _LAYOUT.findall(body)
    said = layouts[0] if len(layouts) == 1 else "no one layout"
    if renames and said != "unfused":
        problem(f"{CARD}: says {said}, but OUTPUT holds SOURCE's fused modules unfused")
    elif not renames and said == "unfused" and ctx.model.fused:
        problem(f"{CARD}: says unfused, but OUTPUT keeps SOURCE's fused modules")
    encodings = {t.dtype for t in ctx.out.tensors.values()} & {E4M3FN, E4M3FNUZ}
    recoded = bool(encodings) and encodings != {t.dtype for t in ctx.src.tensors.values()} & {E4M3FN, E4M3FNUZ}
    if recoded != ("FP8 encoding: e4m3fn" in body and "->" in body):
        problem(f"{CARD}: {'does not say' if recoded else 'says'} the FP8 weights changed encoding")
    if recoded and encodings == {E4M3FNUZ} and "e4m3fnuz" not in tags:
        problem(f"{CARD}: no `e4m3fnuz` tag on e4m3fnuz weights")


def _tags(lines: list[str]) -> set[str]:
    """The items of the front matter's `tags:` list, as YAML's block style writes them (`- fp8`)."""
    if "tags:" not in lines:
        return set()
    found = set()
    for line in lines[lines.index("tags:") + 1 :]:
        if not line.startswith("- "):
            break
        found.add(line[2:].strip().strip("'\""))
    return found

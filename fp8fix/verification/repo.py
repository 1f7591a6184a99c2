"""Checking everything but FP8 weights: input scales, byte-identical tensors and the repo's files."""

from __future__ import annotations

import filecmp

from fp8fix.io.checkpoint import CARD, CONFIG, INDEX
from fp8fix.io.safetensors_file import read_values
from fp8fix.io.source_files import CHUNK
from fp8fix.io.source_tree import SourceTree
from fp8fix.numerics.recodings import scale_factor
from fp8fix.registry.formats import COMPRESSED_TENSORS, quantization_config
from fp8fix.verification.card import check_card
from fp8fix.verification.config import check_config
from fp8fix.verification.context import VerifyContext, fp8_weight_dtypes, side_configs_dropped
from fp8fix.verification.mapping import Target
from fp8fix.verification.report import COPIED


def check_input_scale(ctx: VerifyContext, name: str, weight: str, targets: list[Target]) -> None:
    """A static input scale equals the source's, times the encoding's factor, or (fused) their max."""
    s = ctx.src.tensors[name]
    values = read_values(s)
    for target in targets:
        o = ctx.out.tensors[target.name]
        got = read_values(o)
        out_weight = target.name.rsplit(".", 1)[0] + ".weight" if weight.endswith(".weight") else weight
        if out_weight not in ctx.out.tensors:  # an edited OUTPUT: check_shapes names the weight missing
            ctx.report.problem(f"input scale '{target.name}': OUTPUT holds no weight '{out_weight}' for it")
            continue
        f = scale_factor(ctx.src.tensors[weight].dtype, ctx.out.tensors[out_weight].dtype)
        if target.index is not None and len(values) > 1:
            expected = [[values[target.index] * f]]
        elif len(values) == 1:
            expected = [[values[0] * f] * len(got)]
        else:
            expected = [[v * f for v in values], [max(values) * f]]
        ctx.report.scales_checked += 1
        if o.dtype != s.dtype or got not in expected:
            ctx.report.problem(
                f"input scale '{target.name}' is {o.dtype} {got}; expected {s.dtype} "
                + " or ".join(map(str, expected))
                + f" from '{name}'"
            )


def check_bytes(ctx: VerifyContext, name: str, targets: list[Target]) -> None:
    """A tensor that is not an FP8 weight or its scale: byte-identical (whole, or its row slices)."""
    t = ctx.src.tensors[name]
    row_bytes = t.nbytes // (t.shape[0] if t.shape and t.shape[0] else 1)
    for target in targets:
        o = ctx.out.tensors[target.name]
        start = t.start + target.start * row_bytes if t.shape else t.start
        end = t.start + target.end * row_bytes if t.shape else t.end
        out_start = o.start + target.out_offset * row_bytes
        whole = len([x for x in targets if x.name == target.name]) == 1
        if o.dtype != t.dtype or (o.nbytes != end - start if whole else out_start + end - start > o.end):
            ctx.report.problem(f"'{target.name}' is {o.dtype} {list(o.shape)}; expected the bytes of '{name}'")
            continue
        for offset in range(0, end - start, CHUNK):
            n = min(CHUNK, end - start - offset)
            source_bytes = ctx.files.read(t.path, start + offset, start + offset + n)
            if source_bytes != ctx.files.read(o.path, out_start + offset, out_start + offset + n):
                ctx.report.problem(f"'{target.name}' differs from '{name}' of SOURCE (byte range from {offset})")
                break
        else:
            ctx.report.identical_tensors += 1


def check_repo(
    ctx: VerifyContext, renames: dict[str, list[str]], sizes: dict[str, int], unquantized: list[str]
) -> None:
    """Shard files, index, shard `__metadata__`, config files (`config.check_config`: `--tp` sizes,
    `--tp-bf16` modules listed as unquantized, renamed name lists, a compressed-tensors config) and
    copied files."""
    src, out, report = ctx.src, ctx.out, ctx.report
    if set(out.shards) != set(src.shards):
        report.problem(f"OUTPUT's shard files {sorted(out.shards)} are not SOURCE's {sorted(src.shards)}")
    if (src.index is None) != (out.index is None):
        report.problem(f"{INDEX}: present in only one of SOURCE and OUTPUT")
    if out.index is not None:
        _check_index(ctx)
    for name, header in out.shards.items():
        _check_metadata(ctx, name, header.metadata)
    rewritten = check_config(ctx, renames, sizes, unquantized)
    check_card(ctx, renames)
    # a plain model (`--to bf16`), or one re-blocked as compressed-tensors: a format's side config stays behind
    dropped = [n.file for n in ctx.fmt.name_lists if n.file != CONFIG] if side_configs_dropped(ctx) else []
    copies = src.copied_files([*rewritten, *dropped])
    present, unreadable = SourceTree.of(out.root).files()
    for line in unreadable:
        report.problem(f"{line.split('; ')[0]} in OUTPUT; a conversion writes only regular files", COPIED)
    for rel in copies:
        if rel not in present or not filecmp.cmp(out.root / rel, src.root / rel, shallow=False):
            report.problem(f"{rel}: missing from OUTPUT or not a copy of SOURCE's", COPIED)
    expected = {*out.model_files, *rewritten, *copies, CARD}
    for rel in present:
        if rel not in expected:
            report.problem(f"{rel}: in OUTPUT, but not a file a conversion of SOURCE writes", COPIED, edit=True)


def _check_index(ctx: VerifyContext) -> None:
    """OUTPUT's index: SOURCE's keys, its weight map listing exactly OUTPUT's tensors, the right total size,
    and SOURCE's metadata but for total_size."""
    src, out, report = ctx.src, ctx.out, ctx.report
    assert out.index is not None
    weight_map = out.index.get("weight_map", {})
    if set(weight_map) != set(out.tensors):
        report.problem(f"{INDEX}: its weight_map does not list exactly the tensors of OUTPUT's shards")
    if not all(weight_map.get(t.name) == f for f, h in out.shards.items() for t in h.tensors.values()):
        report.problem(f"{INDEX}: its weight_map places a tensor in a file that does not hold it")
    total = sum(t.nbytes for t in out.tensors.values())
    metadata = out.index.get("metadata") or {}
    if metadata.get("total_size") != total:
        report.problem(f"{INDEX}: total_size is not {total}, the sum of OUTPUT's tensor sizes")
    source = src.index or {}
    if set(out.index) != set(source) | {"metadata", "weight_map"}:
        changed = sorted((set(out.index) ^ set(source)) - {"metadata", "weight_map"})
        report.problem(f"{INDEX}: keys {changed} differ from SOURCE's")
    elif any(out.index[k] != source[k] for k in source if k not in ("metadata", "weight_map")):
        report.problem(f"{INDEX}: differs from SOURCE's beyond weight_map and total_size")
    if {k: v for k, v in metadata.items() if k != "total_size"} != {
        k: v for k, v in (source.get("metadata") or {}).items() if k != "total_size"
    }:
        report.problem(f"{INDEX}: metadata differs from SOURCE's beyond total_size")


def _check_metadata(ctx: VerifyContext, name: str, metadata: dict[str, str]) -> None:
    """A shard's `__metadata__`: SOURCE's, with `format: pt`, and in every shard `fp8fix_encoding` naming
    the encoding of OUTPUT's FP8 weights where it is not SOURCE's."""
    source = ctx.src.shards[name].metadata if name in ctx.src.shards else {}
    expected = {**source, "format": "pt"}
    encodings = {ENCODINGS[d] for d in fp8_weight_dtypes(ctx, "OUTPUT") - fp8_weight_dtypes(ctx, "SOURCE")}
    if len(encodings) == 1:
        expected["fp8fix_encoding"] = encodings.pop()
    if metadata.get("format") != "pt":
        ctx.report.problem(f"{name}: __metadata__ has no format: pt")
    elif metadata != expected:
        changed = sorted(k for k in set(metadata) | set(expected) if metadata.get(k) != expected.get(k))
        ctx.report.problem(f"{name}: __metadata__ differs from SOURCE's and the encoding's in {', '.join(changed[:3])}")


#: The safetensors dtype of each FP8 weight encoding, and its `fp8fix_encoding` name.
ENCODINGS = {"F8_E4M3": "e4m3fn", "F8_E4M3FNUZ": "e4m3fnuz"}


def converted_to_compressed_tensors(ctx: VerifyContext) -> bool:
    """OUTPUT says compressed-tensors where SOURCE is another format (its single scales are then [1])."""
    method = (quantization_config(ctx.out.config) or {}).get("quant_method")
    return method == COMPRESSED_TENSORS.name and ctx.fmt.name != COMPRESSED_TENSORS.name

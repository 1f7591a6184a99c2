"""Checking everything but FP8 weights: input scales, byte-identical tensors and the repo's files."""

from __future__ import annotations

import filecmp

from fp8fix.io.checkpoint import CARD, CONFIG, INDEX, read_json
from fp8fix.io.safetensors_file import read_values
from fp8fix.io.source_files import CHUNK
from fp8fix.io.source_tree import SourceTree
from fp8fix.model import ignore_linears, unquantized_linears
from fp8fix.numerics.recodings import scale_factor
from fp8fix.plan.config_edit import Scheme, can_write, output_config, scheme_of
from fp8fix.registry.formats import COMPRESSED_TENSORS, quantization_config
from fp8fix.verification.context import VerifyContext
from fp8fix.verification.mapping import Target


def check_input_scale(ctx: VerifyContext, name: str, weight: str, targets: list[Target]) -> None:
    """A static input scale equals the source's, times the encoding's factor, or (fused) their max."""
    s = ctx.src.tensors[name]
    values = read_values(s)
    for target in targets:
        o = ctx.out.tensors[target.name]
        got = read_values(o)
        out_weight = target.name.rsplit(".", 1)[0] + ".weight" if weight.endswith(".weight") else weight
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
    ctx: VerifyContext,
    renames: dict[str, list[str]],
    scheme: Scheme | None,
    sizes: dict[str, int] | None = None,
    unquantized: list[str] | None = None,
) -> None:
    """Shard files, index, `format: pt`, config.json (only renamed name-list entries, the
    compressed-tensors `scheme` where OUTPUT was written as compressed-tensors, `--tp` sizes and
    `--tp-bf16` modules listed as unquantized) and copied files."""
    src, out, report = ctx.src, ctx.out, ctx.report
    if set(out.shards) != set(src.shards):
        report.problem(f"OUTPUT's shard files {sorted(out.shards)} are not SOURCE's {sorted(src.shards)}")
    if (src.index is None) != (out.index is None):
        report.problem(f"{INDEX}: present in only one of SOURCE and OUTPUT")
    if out.index is not None:
        weight_map = out.index.get("weight_map", {})
        if set(weight_map) != set(out.tensors):
            report.problem(f"{INDEX}: its weight_map does not list exactly the tensors of OUTPUT's shards")
        total = sum(t.nbytes for t in out.tensors.values())
        if (out.index.get("metadata") or {}).get("total_size") != total:
            report.problem(f"{INDEX}: total_size is not {total}, the sum of OUTPUT's tensor sizes")
    for name, header in out.shards.items():
        if header.metadata.get("format") != "pt":
            report.problem(f"{name}: __metadata__ has no format: pt")
    unfused_config = ctx.model.spec.unfused_config if ctx.model.spec else None
    rewritten = output_config(
        src.config,
        src.root,
        ctx.fmt.name_lists,
        renames,
        scheme,
        channel_output(ctx),
        unfused_config,
        sizes,
        unquantized,
        unquantized_linears(src.tensors),
    )
    _, targeted = ignore_linears(out.config, unquantized_linears(out.tensors))
    if targeted:  # read off OUTPUT alone: what its compressed-tensors config would quantize without a scale
        report.problem(
            f"config.json: quantization_config targets {len(targeted)} Linear module(s) OUTPUT holds no FP8 weight "
            f"for ({', '.join(targeted[:3])}): compressed-tensors would quantize them; they belong in `ignore`"
        )
    if out.config != rewritten.get(CONFIG, (src.config, []))[0]:
        report.problem(
            "config.json: differs from SOURCE's beyond the renamed quantization_config entries"
            + (f" and {', '.join(unfused_config)}" if unfused_config else "")
        )
    for file, (content, _) in rewritten.items():
        if file != CONFIG and (not (out.root / file).is_file() or read_json(out.root / file) != content):
            report.problem(f"{file}: not SOURCE's with the renamed module entries")
    copies = src.copied_files(rewritten)
    present, unreadable = SourceTree.of(out.root).files()
    for line in unreadable:
        report.problem(f"{line.split('; ')[0]} in OUTPUT; a conversion writes only regular files")
    for rel in copies:
        if rel not in present or not filecmp.cmp(out.root / rel, src.root / rel, shallow=False):
            report.problem(f"{rel}: missing from OUTPUT or not a copy of SOURCE's")
    expected = {*out.model_files, *rewritten, *copies, CARD}
    for rel in present:
        if rel not in expected:
            report.problem(f"{rel}: in OUTPUT, but not a file a conversion of SOURCE writes")


def compressed_tensors_output(ctx: VerifyContext) -> Scheme | None:
    """The compressed-tensors scheme OUTPUT must say when it says it is compressed-tensors and SOURCE
    is not: the strategy read off OUTPUT's weight scales (one value each: tensor; one per row:
    channel), the rest from SOURCE's config, so a config that claims another is a mismatch."""
    if (quantization_config(ctx.out.config) or {}).get("quant_method") != COMPRESSED_TENSORS.name:
        return None
    if ctx.fmt.name == COMPRESSED_TENSORS.name or not can_write(ctx.model):
        return None
    scales = [t for name, t in ctx.out.tensors.items() if name.endswith("." + ctx.fmt.weight_scale)]
    return scheme_of(ctx.model, "tensor" if all(t.numel == 1 for t in scales) else "channel")


def channel_output(ctx: VerifyContext) -> bool:
    """A compressed-tensors SOURCE whose OUTPUT holds every weight scale per row (the channel layout)
    where SOURCE did not: its config groups must then say `strategy: channel`."""
    if ctx.fmt.name != COMPRESSED_TENSORS.name:
        return False
    scaled = [(w, ctx.out.tensors.get(w.scale.name)) for w in ctx.model.module_weights() if w.scale is not None]
    per_row = [o is not None and len(o.shape) == 2 and o.shape[1] == 1 for _, o in scaled]
    return bool(per_row) and all(per_row) and any(w.scale_kind != "channel" for w, _ in scaled)

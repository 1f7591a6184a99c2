"""`verify`: prove that OUTPUT is a faithful conversion of SOURCE, tensor by tensor.

What verify shares with convert, and what it works out again on its own:
- shared: reading and validating files (`io.checkpoint`, `io.safetensors_file`), the
  description of SOURCE (`model.describe_checkpoint`: architecture, format, fused
  modules, stacked experts, which tensors are FP8 weights and their scales), the
  registry and the name-list grammars of config files. These say what SOURCE *is*.
- its own: where every tensor went (`mapping`, from names and the registry, never from
  the converter's plan, so a planner bug cannot vouch for itself) and whether every
  value is right (`weights`, `repo`): OUTPUT is read as plain files.

Then:
- every FP8 weight is dequantized on both sides, row chunk by row chunk: where the
  output scale is the source scale times a power of two (splits, fn <-> fnuz) every
  output code must be the source value at the output scale, exactly when that value
  exists in the output encoding and else its nearest-even rounding; elsewhere
  (requantized modules) within half an fp8 step, or at the clamp;
- static input scales equal the source's (times the encoding's factor, or their max);
- every other tensor, or its row slice, is byte-identical;
- every OUTPUT tensor has the dtype and shape its SOURCE tensor and mapping give (`shapes`);
- index, shard files, config.json and the copied files are what they should be, and OUTPUT
  holds no file besides them.
Memory stays at one row chunk per tensor whatever the checkpoint's size.
"""

from __future__ import annotations

from pathlib import Path

from fp8fix.io.checkpoint import open_checkpoint
from fp8fix.io.progress import progress_bar
from fp8fix.io.source_files import SourceFiles
from fp8fix.model import describe_checkpoint
from fp8fix.registry.architectures import Registry
from fp8fix.verify.context import VerifyContext
from fp8fix.verify.mapping import map_tensors, module_renames
from fp8fix.verify.repo import check_bytes, check_input_scale, check_repo, compressed_tensors_output
from fp8fix.verify.report import VerifyReport, WeightCheck
from fp8fix.verify.shapes import check_shapes
from fp8fix.verify.weights import check_stacked_experts, check_weight

__all__ = ["VerifyReport", "WeightCheck", "verify"]


def verify(source: Path, output: Path, quiet: bool = False, registry: Registry | None = None) -> VerifyReport:
    """Check OUTPUT against SOURCE; the report's `problems` say what is wrong (empty: faithful)."""
    model = describe_checkpoint(open_checkpoint(source), registry or Registry.builtin())
    out = open_checkpoint(output)
    fmt = model.require_format()
    with SourceFiles() as files:
        ctx = VerifyContext(model, out, fmt, VerifyReport(str(source), str(output)), files)
        mapping = map_tensors(ctx)
        weights = {w.name: w for w in model.module_weights()}
        scale_names = {fmt.weight_scale_of(w) for w in weights}
        input_of = {fmt.input_scale_of(w): w for w in weights if fmt.input_scale_of(w) in ctx.src.tensors}
        scales = scale_names | set(input_of)  # checked through the weights' values, not streamed
        total = sum(ctx.src.tensors[n].nbytes for n in mapping if n not in scales)
        with progress_bar(total, "fp8fix verify", quiet) as bar:
            for name, targets in mapping.items():
                weight = weights.get(name)
                if weight is not None and weight.stacked:
                    ctx.report.weights.append(check_stacked_experts(ctx, weight))
                elif weight is not None:
                    ctx.report.weights.append(check_weight(ctx, weight, targets))
                elif name in input_of:
                    check_input_scale(ctx, name, input_of[name], targets)
                elif name not in scale_names:
                    check_bytes(ctx, name, targets)
                bar.update(0 if name in scales else ctx.src.tensors[name].nbytes)
        check_shapes(ctx, mapping, compressed_tensors_output(ctx) is not None)
        check_repo(ctx, module_renames(ctx, mapping))
    return ctx.report

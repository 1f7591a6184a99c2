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
- `--scales ue8m0` weights (power-of-two block scales) as such (`ue8m0`), `--blocks 128x128` MXFP8 weights
  re-blocked (`mx_blocks`), and `--blocks mx` block FP8 weights as MXFP8 (`block_mx`);
- `--tp` padding and weights written unquantized (`--to bf16`, `--dequantize`, `--tp-bf16`) are checked as
  such (`padding`, `dequantized`), FP4 modules written unquantized too (`fp4`), NVFP4 modules moved to their
  packed layer's global scale (`fp4_shared`);
- every OUTPUT tensor has the dtype and shape its SOURCE tensor and mapping give (`shapes`);
- index, shard files and their `__metadata__`, and the copied files are what they should be,
  and OUTPUT holds no file besides them;
- config.json (and ModelOpt's side config) by what it means for OUTPUT's tensors, never from
  convert's config code (`config`), and the model card's facts (`card`).
Memory stays at one row chunk per tensor whatever the checkpoint's size.
"""

from __future__ import annotations

from pathlib import Path

from fp8fix.collector import collector_paused, collector_running
from fp8fix.io.checkpoint import open_checkpoint
from fp8fix.io.progress import Progress, progress_bar
from fp8fix.io.source_files import SourceFiles
from fp8fix.io.workers import Jobs, resolve_jobs, run_tasks, window_start, worker_count
from fp8fix.model import describe_checkpoint
from fp8fix.registry.architectures import Registry
from fp8fix.verification.block_mx import check_block_mx, mx_weights
from fp8fix.verification.context import VerifyContext
from fp8fix.verification.dequantized import (
    check_dequantized,
    dequantized_weights,
    dropped_scales,
    unquantized_modules,
)
from fp8fix.verification.fp4 import check_fp4, fp4_dropped, unquantized_fp4, unquantized_name
from fp8fix.verification.fp4_shared import check_shared, shared_modules, shared_scale_names
from fp8fix.verification.mapping import Target, map_tensors, module_renames
from fp8fix.verification.mx_blocks import check_reblocked, reblocked_weights
from fp8fix.verification.padding import check_padded, padded_sizes, padded_tensors
from fp8fix.verification.repo import check_bytes, check_input_scale, check_repo, converted_to_compressed_tensors
from fp8fix.verification.report import VerifyReport, WeightCheck
from fp8fix.verification.shapes import check_shapes
from fp8fix.verification.ue8m0 import check_ue8m0, ue8m0_weights
from fp8fix.verification.weights import check_stacked_experts, check_weight

__all__ = ["VerifyReport", "WeightCheck", "verify"]


def verify(
    source: Path,
    output: Path,
    quiet: bool = False,
    registry: Registry | None = None,
    jobs: Jobs = 1,
    files: SourceFiles | None = None,
    part: tuple[int, int] | None = None,
    source_name: str | None = None,
    accept_edits: bool = False,
) -> VerifyReport:
    """Check OUTPUT against SOURCE; the report's `problems` say what is wrong (empty: faithful).

    With `jobs` > 1 (or `"auto"`: the cores other processes leave idle, 1 for less than 64 MB) the tensors
    are checked in forked processes, in runs of consecutive tensors; their reports are merged in order, so
    the report is the same whatever `jobs`.
    `files`: how the shards are read (a Hub repo's, downloaded as read: `verification.remote`);
    then one process. `part` (K, N): only the K-th of N consecutive shares of SOURCE's tensors, of
    about equal bytes, is checked (the checks of index, config and card in every part): N machines
    each run one, and together they check every tensor once. `source_name`: SOURCE as OUTPUT's card names it
    (default: the folder's name). `accept_edits`: the card's facts and files fp8fix did not write are listed as
    edits, not problems.
    """
    global _checks
    started = window_start()  # jobs "auto": what other processes ran while this one started and read headers
    with collector_paused():
        model = describe_checkpoint(open_checkpoint(source, "SOURCE"), registry or Registry.builtin())
        out = open_checkpoint(output, "OUTPUT")
    fmt = model.require_format()
    remote = files is not None  # a Hub repo's shards, downloaded as read: one process
    with files or SourceFiles() as files:
        report = VerifyReport(str(source), str(output), accept_edits=accept_edits)
        ctx = VerifyContext(model, out, fmt, report, files, source_name=source_name or Path(source).resolve().name)
        ctx.padded = padded_tensors(ctx)
        ctx.dequantized = dequantized_weights(ctx)
        ctx.fp4 = unquantized_fp4(ctx)
        ctx.shared_fp4 = shared_modules(ctx)
        ctx.dropped = dropped_scales(ctx, ctx.dequantized) | fp4_dropped(ctx.fp4)
        ctx.ue8m0 = ue8m0_weights(ctx)
        ctx.reblocked = reblocked_weights(ctx)
        ctx.renamed = {n: unquantized_name(w) for n, w in ctx.fp4.items()}
        ctx.renamed |= {n: m.out_name for n, m in ctx.reblocked.items() if m.out_name != n}
        ctx.block_mx = mx_weights(ctx)
        checks = _TensorChecks(ctx, map_tensors(ctx), part)
        jobs = 1 if remote else resolve_jobs(jobs, checks.total, started)
        ctx.report.part = list(part) if part else None
        with collector_running(), progress_bar(checks.total, "fp8fix verify", quiet) as bar:
            runs = checks.runs(RUNS_PER_JOB * jobs)
            workers = worker_count(jobs, len(runs))
            if workers > 1:
                _checks = checks  # inherited by the forked workers
                try:
                    names = [
                        f"the checks of '{checks.items[a][0]}' and {b - a - 1} tensor(s) after it" for a, b in runs
                    ]
                    for done in run_tasks(_check_run, runs, workers, bar, names):
                        ctx.report.merge(done)
                finally:
                    _checks = None
            else:
                checks.check(*checks.share, bar)
        check_shapes(ctx, checks.mapping, converted_to_compressed_tensors(ctx))
        renames = module_renames(ctx, checks.mapping)
        check_repo(ctx, renames, padded_sizes(ctx), unquantized_modules(ctx.dequantized))
    return ctx.report


#: Runs of tensors per process: enough that one slow run does not leave the other processes idle.
RUNS_PER_JOB = 4


class _TensorChecks:
    """The value checks of every SOURCE tensor, in mapping order, split into runs for `--jobs`."""

    def __init__(
        self, ctx: VerifyContext, mapping: dict[str, list[Target]], part: tuple[int, int] | None = None
    ) -> None:
        self.ctx, self.mapping = ctx, mapping
        self.items = list(mapping.items())
        self.weights = {w.name: w for w in ctx.model.module_weights()}
        fmt = ctx.fmt
        self.scale_names = {fmt.weight_scale_of(w) for w in self.weights}
        self.scale_names |= {m.scale.name for m in ctx.reblocked.values()}  # (MXFP4's, checked with its weight)
        self.scale_names |= shared_scale_names(ctx.shared_fp4)
        self.input_of = {fmt.input_scale_of(w): w for w in self.weights if fmt.input_scale_of(w) in ctx.src.tensors}
        # scales are checked through the weights' values, not streamed
        self.costs = [0 if n in self.scale_names or n in self.input_of else ctx.src.tensors[n].nbytes for n in mapping]
        self.share = share_of(self.costs, *part) if part else (0, len(self.items))
        self.total = sum(self.costs[slice(*self.share)])

    def runs(self, count: int) -> list[tuple[int, int]]:
        """[start, end) runs of consecutive tensors of this share, about `count` of them, of about equal bytes."""
        first, last = self.share
        share, runs, start, size = max(1, self.total // max(count, 1)), [], first, 0
        for i in range(first, last):
            size += self.costs[i]
            if size >= share:
                runs.append((start, i + 1))
                start, size = i + 1, 0
        if start < last:
            runs.append((start, last))
        return runs

    def check(self, start: int, end: int, bar: Progress) -> None:
        ctx = self.ctx
        for (name, targets), cost in zip(self.items[start:end], self.costs[start:end], strict=True):
            weight = self.weights.get(name)
            if name in ctx.dequantized:  # `--to bf16`, `--dequantize`, `--tp-bf16`: written unquantized
                ctx.report.add(check_dequantized(ctx, ctx.dequantized[name]))
            elif name in ctx.fp4:  # `--to bf16` of an FP4 module (its scales checked with it)
                ctx.report.add(check_fp4(ctx, ctx.fp4[name]))
            elif name in ctx.shared_fp4:  # NVFP4 at its packed layer's global scale (its scales checked with it)
                ctx.report.add(check_shared(ctx, ctx.shared_fp4[name]))
            elif name in ctx.ue8m0:  # `--scales ue8m0`: power-of-two block scales (its scale checked with it)
                ctx.report.add(check_ue8m0(ctx, ctx.ue8m0[name]))
            elif name in ctx.reblocked:  # `--blocks 128x128`: MXFP8, MXFP4 as block FP8 (its scale checked with it)
                ctx.report.add(check_reblocked(ctx, ctx.reblocked[name]))
            elif name in ctx.block_mx:  # `--blocks mx`: block FP8 as MXFP8 (its scale checked with it)
                ctx.report.add(check_block_mx(ctx, ctx.block_mx[name]))
            elif name in ctx.padded:  # `--tp`: a padded MLP weight (its scale is checked with it)
                if name not in self.scale_names:
                    ctx.report.add(check_padded(ctx, name, weight))
            elif weight is not None and weight.stacked:
                ctx.report.add(check_stacked_experts(ctx, weight))
            elif weight is not None:
                ctx.report.add(check_weight(ctx, weight, targets))
            elif name in self.input_of:
                check_input_scale(ctx, name, self.input_of[name], targets)
            elif name not in self.scale_names:
                check_bytes(ctx, name, targets)
            bar.update(cost)


def share_of(costs: list[int], k: int, n: int) -> tuple[int, int]:
    """The K-th of N consecutive [start, end) shares of `costs`: a tensor belongs to the share its first
    byte falls in (bytes counted in order), so the N shares cover every tensor once, each about 1/N of
    the bytes; free tensors (scales) go with the share of the bytes before them."""
    total, before, bounds = sum(costs), 0, []
    for cost in costs:
        bounds.append(min(n - 1, before * n // total) if total else 0)
        before += cost
    start = next((i for i, b in enumerate(bounds) if b >= k - 1), len(costs))
    end = next((i for i, b in enumerate(bounds) if b >= k), len(costs))
    return start, end


#: The checks a forked worker runs (set by the parent before forking).
_checks: _TensorChecks | None = None


def _check_run(progress: Progress, start: int, end: int) -> VerifyReport:
    """A worker's share: tensors [start, end), into a report of their own."""
    assert _checks is not None
    ctx = _checks.ctx
    ctx.report = VerifyReport(ctx.report.source, ctx.report.output, accept_edits=ctx.report.accept_edits)
    _checks.check(start, end, progress)
    return ctx.report

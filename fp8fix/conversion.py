"""`convert` end to end: describe, plan, then write into a staging folder renamed into place.

The steps read like the pipeline (compare compressed-tensors' model-free convert):
open the checkpoint -> describe it -> plan every output tensor -> rewrite the config
-> list the files to copy -> stream the shards -> write index, config, copies and
card -> rename the staging folder to OUTPUT. Any error or interrupt before the
rename removes the staging folder, so OUTPUT never holds a half-written checkpoint.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8fix.collector import collector_paused
from fp8fix.errors import OutputWriteFailed, VerificationFailed
from fp8fix.gate import no_loader_warning
from fp8fix.io.checkpoint import CARD, CONFIG, INDEX, Checkpoint, open_checkpoint
from fp8fix.io.staging import (
    check_output,
    output_lock,
    output_path,
    remove_stale_staging,
    staging_folder,
    write_json,
)
from fp8fix.io.workers import CpuReading, Jobs, resolve_jobs, window_start
from fp8fix.io.writer import WriteStats, write_plan
from fp8fix.model import CheckpointModel, describe_checkpoint
from fp8fix.plan.pieces import ConversionPlan
from fp8fix.plan.target_plan import plan_for_target
from fp8fix.registry.architectures import Registry
from fp8fix.report.convert_report import ConvertResult
from fp8fix.report.model_card import commit_title, write_card
from fp8fix.vocab import ConvertTo, Layout, OutputFormat, Target


@dataclass(frozen=True)
class ConvertOptions:
    layout: Layout | None = None  # None: the layout `target`'s loaders take best
    to: ConvertTo | None = None  # None keeps the encoding; bf16 / float16: the whole model unquantized
    target: Target = "auto"
    output_format: OutputFormat | None = None  # None: what `target`'s loaders take best
    dry_run: bool = False
    overwrite: bool = False
    quiet: bool = False
    verify: bool = False
    jobs: Jobs = 1  # processes writing shards where the work is CPU-bound (recoding, requantizing), and verifying;
    # "auto": the cores other processes leave idle
    tp: int | None = None  # pad MLP intermediates so every share is whole blocks at this tensor-parallel size
    tp_bf16: bool = False  # with tp: write attention modules that padding cannot fix in BF16 instead of refusing
    dequantize: tuple[str, ...] = ()  # shell-style module patterns: those modules written in BF16, unquantized
    scales: str | None = None  # "ue8m0": every block scale a power of two (DeepGEMM on Hopper / Blackwell)
    blocks: str | None = None  # "128x128": an MXFP8 checkpoint written as block FP8 (runtimes without MX kernels)
    source_repo: str | None = None  # the Hub repo SOURCE came from, for the model card
    revision: str | None = None

    def describe(self, plan: ConversionPlan) -> str:
        """The options as a command line, for the model card."""
        return (
            ("" if plan.unquantized else f"--layout {plan.layout}")
            + (f" --format {plan.output_format}" if plan.output_format != "keep" else "")
            + (f" --to {self.to}" if self.to else "")
            + (f" --tp {self.tp}" if self.tp else "")
            + (" --tp-bf16" if self.tp_bf16 else "")
            + "".join(f" --dequantize '{p}'" for p in self.dequantize)
            + (f" --scales {self.scales}" if self.scales else "")
            + (f" --blocks {self.blocks}" if self.blocks else "")
            + (" --verify" if self.verify else "")
        )


def convert(source: Path, output: Path, options: ConvertOptions, registry: Registry | None = None) -> ConvertResult:
    registry = registry or Registry.builtin()
    output = output_path(output)
    check_output(source, output, options.overwrite)
    started = window_start()  # --jobs auto: what other processes ran while this one started and planned
    with collector_paused():
        ckpt = open_checkpoint(source)
        model = describe_checkpoint(ckpt, registry)
        plan = plan_with(model, options)
        rewritten = plan.config_files
        edits = [edit for _, file_edits in rewritten.values() for edit in file_edits]
        copies = ckpt.copied_files([*rewritten, *plan.dropped_files])
    result = ConvertResult(plan, output, written=False, config_edits=edits, copied_files=copies)
    result.warnings += ckpt.warnings
    unloaded = no_loader_warning(plan)
    result.warnings += [unloaded] if unloaded else []
    if options.dry_run:
        return result
    with output_lock(output):
        # again: OUTPUT may have been written meanwhile; and --overwrite loses no file fp8fix did not write
        check_output(source, output, options.overwrite, [*rewritten, *copies])
        result.warnings += remove_stale_staging(output)
        try:
            _write(ckpt, plan, output, options, registry, result, started)
        except OSError as e:
            if e.errno not in OUTPUT_ERRNOS:
                raise
            raise OutputWriteFailed(
                f"OUTPUT {output}: {e.strerror or e} while writing it; nothing was written (free space on that "
                "disk, or choose another OUTPUT)"
            ) from None
    result.written = True
    return result


def plan_with(model: CheckpointModel, options: ConvertOptions) -> ConversionPlan:
    """The plan `options` ask for (a local conversion and a streamed one plan alike)."""
    return plan_for_target(
        model,
        options.layout,
        options.to,
        options.target,
        options.output_format,
        options.tp,
        options.tp_bf16,
        options.dequantize,
        options.scales,
        options.blocks,
    )


#: Errors of writing, not reading: the disk is full, a quota or a file-size limit is reached, read-only.
OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _write(
    ckpt: Checkpoint,
    plan: ConversionPlan,
    output: Path,
    options: ConvertOptions,
    registry: Registry,
    result: ConvertResult,
    started: CpuReading,
) -> None:
    """Stream the plan into a staging folder, add index, config, copies and card, verify, rename into place."""
    # "auto" asked once, before writing: --verify after it would see this conversion's own workers as others' load
    jobs = resolve_jobs(options.jobs, plan.total_bytes, started)
    with staging_folder(output) as staging:
        stats = write_plan(plan, staging, quiet=options.quiet, jobs=jobs)
        record_stats(plan, stats)
        result.processes = stats.processes
        write_repo_files(ckpt, plan, staging, options, result)
        if options.verify:
            from fp8fix.verification import verify  # numpy: only a --verify run needs it before writing

            result.verification = verify(
                ckpt.root,
                staging,
                quiet=options.quiet,
                registry=registry,
                jobs=jobs,
                source_name=_source_name(ckpt, options),
            )
            from fp8fix.card_facts import check_card_verdicts

            check_card_verdicts(result.verification, staging, registry)  # the card's table, as `verify` checks it
            if not result.verification.ok:
                raise VerificationFailed(
                    "verification failed, nothing written: " + "; ".join(result.verification.problems[:5])
                )
            write_card_for(ckpt, plan, staging, options, result, result.verification.summary())


def write_repo_files(
    ckpt: Checkpoint, plan: ConversionPlan, folder: Path, options: ConvertOptions, result: ConvertResult
) -> None:
    """Everything but the shards: index, config files, the copied files and the model card (before
    verify, which checks the card's facts too); sets the commit title."""
    source, rewritten = ckpt.root, plan.config_files
    if plan.has_index:
        write_json(folder / INDEX, new_index(ckpt, plan))
    if CONFIG not in rewritten:
        shutil.copyfile(source / CONFIG, folder / CONFIG)  # byte for byte when nothing changes
    for file, (content, _) in rewritten.items():
        write_json(folder / file, content)
    for name in result.copied_files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, folder / name)
    write_card_for(ckpt, plan, folder, options, result, None)
    result.commit_title = commit_title(_source_name(ckpt, options), options.describe(plan))


def write_card_for(
    ckpt: Checkpoint,
    plan: ConversionPlan,
    folder: Path,
    options: ConvertOptions,
    result: ConvertResult,
    summary: str | None,
) -> None:
    """The model card; with verify's `summary` once verified (its warnings were said: not repeated)."""
    write_card(
        ckpt.root / CARD if CARD in ckpt.extra_files else None,
        folder,
        plan,
        _source_name(ckpt, options),
        options.describe(plan),
        result.config_edits,
        summary,
        base_model=options.source_repo,
        warnings=result.warnings if summary is None else [],
    )


def _source_name(ckpt: Checkpoint, options: ConvertOptions) -> str:
    """SOURCE as the card and the commit title name it: the Hub repo (and revision) or the folder's name."""
    from fp8fix.io.hub import source_label

    return source_label(ckpt.root, options.source_repo, options.revision)


def record_stats(plan: ConversionPlan, stats: WriteStats) -> None:
    """What only the data could tell (requantization errors, inexact recodes), onto the plan for the reports."""
    for module in plan.modules:
        error = stats.requantized.get(module.weight)
        if error is not None:
            module.max_error, module.max_error_steps = error.max_abs, error.max_steps
    if plan.encoding is not None:
        plan.encoding.inexact_codes = stats.inexact_codes
    for m in plan.ue8m0.modules if plan.ue8m0 is not None else []:
        figures = stats.ue8m0.get(m.weight)
        if figures is not None:
            m.blocks_kept, m.blocks_requantized, m.blocks_halved = (
                figures.blocks_kept,
                figures.blocks_requantized,
                figures.blocks_halved,
            )
            m.max_steps, m.rms_steps = figures.max_steps, figures.rms_steps
            if not plan.ue8m0.mx:  # `--blocks mx` works out no vLLM figures (its DeepGEMM path reads block FP8)
                m.vllm_max_steps, m.vllm_rms_steps = figures.vllm_max_steps, figures.vllm_rms_steps
    for m in plan.reblocked:
        counted = stats.reblocked.get(m.weight)
        if counted is not None:
            m.blocks_exact, m.blocks_rounded, m.values_rounded = (
                counted.blocks_exact,
                counted.blocks_rounded,
                counted.values_rounded,
            )
            m.max_steps, m.max_error = counted.max_steps, counted.max_abs
    for shared in plan.shared_fp4:
        moved = stats.shared.get(shared.weight)
        if moved is not None:
            shared.groups_exact = moved.groups_exact
            shared.max_error, shared.max_steps = moved.max_abs, moved.max_steps
    for bf16 in [*plan.dequantized, *(plan.padding.bf16 if plan.padding is not None else [])]:
        rounding = stats.dequantized.get(bf16.weight)
        if rounding is not None:
            bf16.max_error, bf16.max_error_steps = rounding.max_abs, rounding.max_steps


def new_index(ckpt: Checkpoint, plan: ConversionPlan) -> dict[str, Any]:
    """The source index with the weight map following the plan, in source order, and a new total size."""
    assert ckpt.index is not None
    outputs: dict[str, list[tuple[str, str]]] = {}
    for shard in plan.shards:
        for t in shard.tensors:
            outputs.setdefault(t.source, []).append((t.name, shard.name))
    weight_map: dict[str, str] = {}
    for name in [*ckpt.index["weight_map"], *outputs]:
        for new_name, file in outputs.pop(name, []):
            weight_map[new_name] = file
    metadata = dict(ckpt.index.get("metadata") or {})
    metadata["total_size"] = plan.total_bytes
    return {**ckpt.index, "metadata": metadata, "weight_map": weight_map}

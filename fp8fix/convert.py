"""`convert` end to end: open, plan, then write into a staging folder renamed into place.

The steps read like the pipeline (compare compressed-tensors' model-free convert):
open the checkpoint -> plan every output tensor -> rewrite the config -> list the
files to copy -> stream the shards -> write index, config, copies and card ->
rename the staging folder to OUTPUT. Any error or interrupt before the rename
removes the staging folder, so OUTPUT never holds a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8fix.checkpoint import CONFIG, INDEX, Checkpoint, open_checkpoint
from fp8fix.config_edit import rewrite_name_lists
from fp8fix.errors import OutputError, VerificationFailed
from fp8fix.model_card import CARD, write_card
from fp8fix.plan import ConversionPlan
from fp8fix.planner import plan_conversion
from fp8fix.verify import VerifyReport, verify
from fp8fix.writer import write_plan


@dataclass(frozen=True)
class ConvertOptions:
    layout: str | None = None  # None: the architecture's default
    to: str | None = None  # e4m3fn / e4m3fnuz; None keeps the encoding
    dry_run: bool = False
    overwrite: bool = False
    quiet: bool = False
    verify: bool = False
    source_repo: str | None = None  # the Hub repo SOURCE came from, for the model card
    revision: str | None = None

    def describe(self, plan: ConversionPlan) -> str:
        """The options as a command line, for the model card."""
        return (
            f"--layout {plan.layout}" + (f" --to {self.to}" if self.to else "") + (" --verify" if self.verify else "")
        )


@dataclass
class ConvertResult:
    plan: ConversionPlan
    output: Path
    written: bool
    config_edits: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    verification: VerifyReport | None = None


def convert(source: Path, output: Path, options: ConvertOptions) -> ConvertResult:
    check_output(source, output, options.overwrite)
    ckpt = open_checkpoint(source)
    plan = plan_conversion(ckpt, options.layout, options.to)
    rewritten = rewrite_name_lists(ckpt.config, ckpt.root, plan.format.name_lists, plan.renames)
    edits = [edit for _, file_edits in rewritten.values() for edit in file_edits]
    copies = [f for f in ckpt.other_files() if f != CARD and f not in rewritten]
    result = ConvertResult(plan, output, written=False, config_edits=edits, copied_files=copies)
    if options.dry_run:
        return result
    with staging_folder(output) as staging:
        stats = write_plan(plan, staging, quiet=options.quiet)
        for module in plan.modules:
            error = stats.requantized.get(module.module + ".weight")
            if error is not None:
                module.max_error, module.max_error_steps = error.max_abs, error.max_steps
        if plan.encoding is not None:
            plan.encoding.inexact_codes = stats.inexact_codes
        if plan.has_index:
            write_json(staging / INDEX, new_index(ckpt, plan))
        if CONFIG not in rewritten:
            shutil.copyfile(source / CONFIG, staging / CONFIG)  # byte for byte when nothing changes
        for file, (content, _) in rewritten.items():
            write_json(staging / file, content)
        for name in copies:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, staging / name)
        if options.verify:
            result.verification = verify(source, staging, quiet=options.quiet)
            if not result.verification.ok:
                raise VerificationFailed(
                    "verification failed, nothing written: " + "; ".join(result.verification.problems[:5])
                )
        summary = result.verification.summary() if result.verification else None
        name = source.resolve().name
        if options.source_repo:
            name = options.source_repo + (f"@{options.revision}" if options.revision else "")
        write_card(
            source,
            staging,
            plan,
            name,
            options.describe(plan),
            edits,
            summary,
            base_model=options.source_repo,
        )
    result.written = True
    return result


def check_output(source: Path, output: Path, overwrite: bool) -> None:
    """Refuse destinations that would touch the source or clobber something unasked."""
    src, out = source.resolve(), output.resolve()
    if out == src or out.is_relative_to(src):
        raise OutputError(f"{output}: OUTPUT is inside SOURCE; fp8fix never writes into the source checkpoint")
    if src.is_relative_to(out):
        raise OutputError(f"{output}: OUTPUT contains SOURCE; choose another destination")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{output}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{output}: exists and is not empty; pass --overwrite to replace it")


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


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def staging_folder(output: Path) -> Iterator[Path]:
    """A fresh folder beside OUTPUT, renamed to OUTPUT on success and removed on any failure.

    The folder is created inside the guarded block, so an interrupt arriving just after
    it exists still removes it; the final swap runs with SIGINT/SIGTERM held back, so an
    interrupt cannot fall between moving an old OUTPUT aside and moving the new one in.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.fp8fix-{secrets.token_hex(6)}"
    try:
        staging.mkdir(mode=0o700)
        yield staging
        os.chmod(staging, 0o755)
        with _signals_held():
            _move_into_place(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, output: Path) -> None:
    if not output.exists():
        os.rename(staging, output)
        return
    old = output.parent / f".{output.name}.fp8fix-old-{secrets.token_hex(6)}"
    os.rename(output, old)
    os.rename(staging, output)
    shutil.rmtree(old)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back (delivered right after) where the platform allows it."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

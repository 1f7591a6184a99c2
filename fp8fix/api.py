"""fp8fix's Python API: `convert`, `inspect`, `verify`, `push` and `architectures`, as the CLI runs them.

Each function takes what the matching command takes, as keyword arguments of the same names
(`fp8fix convert --layout fused` is `fp8fix.convert(..., layout="fused")`; a test keeps the
two in step), validates them before any work (a `ValueError` naming the valid values), and
returns the result object the command prints (each has `to_json()`, the command's `--json`).
Paths are `str` or `os.PathLike`; a `str` SOURCE that is a Hub repo id (`org/name`, not a local
path) is downloaded through huggingface_hub, as on the command line. Progress bars are off
unless `progress=True`. Problems raise the `Fp8fixError` subclasses the CLI turns into exit
codes, with options named as keyword arguments. `registry` / `arch_files` add architecture
entries for this call only: nothing global changes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8fix.errors import (  # the errors the API raises, public as fp8fix.<name>
    Fp8fixError,
    HubError,
    InvalidCheckpoint,
    OutputBusy,
    RegistryEntryError,
    SourceChanged,
    UnsupportedCheckpoint,
    UsageError,
    VerificationFailed,
)
from fp8fix.vocab import (
    AUTO_JOBS,
    BLOCKS,
    LAYOUTS,
    OUTPUT_FORMATS,
    PRECISIONS,
    SCALES,
    SCHEMA_VERSION,
    TARGETS,
    TO_NAMES,
    AutoJobs,
    Blocks,
    ConvertTo,
    Layout,
    OutputFormat,
    Scales,
    Target,
)

if TYPE_CHECKING:
    from fp8fix.conversion import ConvertOptions
    from fp8fix.inspection import Report
    from fp8fix.registry.architectures import Registry
    from fp8fix.report.convert_report import ConvertResult
    from fp8fix.streaming import StreamResult
    from fp8fix.verification import VerifyReport

PathArg = str | os.PathLike[str]

__all__ = [
    "Architecture",
    "PushResult",
    "architecture_template",
    "architectures",
    "convert",
    "convert_to_hub",
    "inspect",
    "push",
    "verify",
    "Fp8fixError",
    "HubError",
    "InvalidCheckpoint",
    "OutputBusy",
    "RegistryEntryError",
    "SourceChanged",
    "UnsupportedCheckpoint",
    "UsageError",
    "VerificationFailed",
]


def convert(
    source: PathArg,
    output: PathArg,
    *,
    layout: Layout | None = None,
    to: ConvertTo | None = None,
    target: Target = "auto",
    output_format: OutputFormat | None = None,
    tp: int | None = None,
    tp_bf16: bool = False,
    dequantize: Sequence[str] = (),
    scales: Scales | None = None,
    blocks: Blocks | None = None,
    verify: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    jobs: int | AutoJobs = 1,
    revision: str | None = None,
    token: str | None = None,
    arch_files: Sequence[PathArg] = (),
    registry: Registry | None = None,
    progress: bool = False,
) -> ConvertResult:
    """Convert the FP8 checkpoint `source` (folder or Hub repo id) into a fixed copy at `output`.

    `source` is never modified; `output` appears only once complete. Returns what was planned and
    written (`result.plan.modules`: each fused module's action and why; `result.plan.loaders`:
    what each runtime does with the output; `result.verification` with `verify=True`).
    """
    from fp8fix.conversion import convert as run_convert

    _jobs(jobs)
    with api_errors(), _hub_progress(progress, source):
        base = _conversion(layout, to, target, output_format, tp, tp_bf16, dequantize, scales, blocks)
        reg = _registry(registry, arch_files)
        folder, repo_id = _source(source, revision, token)
        options = replace(
            base,
            dry_run=dry_run,
            overwrite=overwrite,
            quiet=not progress,
            verify=verify,
            jobs=jobs,
            source_repo=repo_id,
            revision=revision,
        )
        return run_convert(folder, Path(output), options, reg)


def _conversion(
    layout: Layout | None,
    to: ConvertTo | None,
    target: Target,
    output_format: OutputFormat | None,
    tp: int | None,
    tp_bf16: bool,
    dequantize: Sequence[str] = (),
    scales: Scales | None = None,
    blocks: Blocks | None = None,
) -> ConvertOptions:
    """What convert and convert_to_hub both take, checked before any work, as options."""
    from fp8fix.conversion import ConvertOptions

    _choice("layout", layout, LAYOUTS)
    _choice("to", to, TO_NAMES)
    _choice("scales", scales, SCALES)
    _choice("blocks", blocks, BLOCKS)
    _choice("target", target, TARGETS, optional=False)
    _choice("output_format", output_format, OUTPUT_FORMATS)
    if tp is not None:
        _count("tp", tp, "or None")
    if tp_bf16 and tp is None:
        raise UsageError("--tp-bf16 needs --tp: it writes in BF16 the modules that padding for --tp cannot fix")
    if isinstance(dequantize, str) or not all(isinstance(p, str) and p for p in dequantize):
        raise UsageError("--dequantize takes module name patterns (a list of non-empty strings)")
    given = {
        "--to": to is not None,
        "--layout": layout is not None,
        "--format": output_format is not None,
        "--tp": tp is not None,
        "--tp-bf16": tp_bf16,
        "--dequantize": bool(dequantize),
        "--scales": scales is not None,
    }
    if to in PRECISIONS:
        _alone(
            f"--to {to} writes the whole model unquantized, with no scales to lay out and no FP8 module to keep",
            given,
            "--to",
            "--tp",
        )
    if blocks is not None:
        what = "writes block FP8 as MXFP8" if blocks == "mx" else "re-blocks an MXFP8 checkpoint"
        _alone(f"--blocks {blocks} {what} and changes nothing else", given)
    return ConvertOptions(
        layout=layout,
        to=to,
        target=target,
        output_format=output_format,
        tp=tp,
        tp_bf16=tp_bf16,
        dequantize=tuple(dequantize),
        scales=scales,
        blocks=blocks,
    )


def _alone(what: str, given: dict[str, bool], *allowed: str) -> None:
    """Refuse the options in `given` that were given, but `allowed`, beside an option that does `what`."""
    extra = [flag for flag, on in given.items() if on and flag not in allowed]
    if extra:
        raise UsageError(f"{what}: drop {', '.join(extra)}")


def convert_to_hub(
    source: str,
    dest: str,
    *,
    max_disk: int | None = None,
    private: bool = False,
    create_pr: bool = False,
    commit_message: str | None = None,
    commit_description: str | None = None,
    part: tuple[int, int] | None = None,
    finalize: bool = False,
    layout: Layout | None = None,
    to: ConvertTo | None = None,
    target: Target = "auto",
    output_format: OutputFormat | None = None,
    tp: int | None = None,
    tp_bf16: bool = False,
    dequantize: Sequence[str] = (),
    scales: Scales | None = None,
    blocks: Blocks | None = None,
    revision: str | None = None,
    token: str | None = None,
    arch_files: Sequence[PathArg] = (),
    registry: Registry | None = None,
    progress: bool = False,
) -> StreamResult:
    """Convert the Hub repo `source` into the Hub repo `dest`, shard by shard, in at most `max_disk`
    bytes of disk (default: three of the largest source shard): `fp8fix convert SOURCE --push-to-hub
    DEST` with no OUTPUT. Lands on `dest`'s main in one merge (a pull request with `create_pr`); a
    rerun after an interruption continues from the output shards already uploaded. `part=(K, N)`: only the
    K-th of N shares of the output shards, for N machines; then one call with `finalize=True` (or one with
    neither) makes the final commit."""
    from fp8fix.io.hub import is_repo_id
    from fp8fix.streaming import Destination, stream_convert

    _shares(max_disk, part)
    if part is not None and finalize:
        raise ValueError(
            "part and finalize: a part converts its share, finalize makes the final commit; one or the other"
        )
    with api_errors(), _hub_progress(progress, source):
        base = _conversion(layout, to, target, output_format, tp, tp_bf16, dequantize, scales, blocks)
        if not is_repo_id(source):
            raise UsageError(
                f"SOURCE {source}: streaming to the Hub reads a Hub repo id (org/name); for a folder, "
                "give OUTPUT and --push-to-hub"
            )
        options = replace(base, quiet=not progress, source_repo=source, revision=revision)
        where = Destination(dest, private, create_pr, commit_message, commit_description)
        registry = _registry(registry, arch_files)
        return stream_convert(
            source, where, options, registry, max_disk=max_disk, token=token, part=part, finalize=finalize
        )


def inspect(
    source: PathArg,
    *,
    scan_data: bool = False,
    tp: Sequence[int] = (),
    target: Target = "auto",
    revision: str | None = None,
    token: str | None = None,
    arch_files: Sequence[PathArg] = (),
    registry: Registry | None = None,
    progress: bool = False,
) -> Report:
    """What the checkpoint `source` is, its problems, and which loaders take it (`report.loaders`).

    A Hub repo id is read from the Hub's header API when it can be (no weights downloaded). `tp`:
    tensor-parallel sizes to check a block-scaled checkpoint's rank shares at (`report.tensor_parallel`).
    `target`: the loaders the gate is for (`report.gate`: the rows `inspect --strict` fails on, `fp8fix.gate`).
    """
    _choice("target", target, TARGETS, optional=False)
    if isinstance(tp, int) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in tp):
        raise ValueError(f"tp must be a list of tensor-parallel sizes (whole numbers >= 1), not {tp!r}")
    from fp8fix.inspection import inspect_checkpoint
    from fp8fix.io.hub import is_repo_id, remote_headers

    with api_errors(), _hub_progress(progress, source):  # downloads of a Hub SOURCE's config files
        reg = _registry(registry, arch_files)
        hub = isinstance(source, str) and is_repo_id(source) and not scan_data
        remote = remote_headers(source, revision, token) if isinstance(source, str) and hub else None
        checkpoint = remote or _source(source, revision, token)[0]
        report = inspect_checkpoint(checkpoint, scan_data=scan_data, registry=reg, tp=tp, target=target)
        report.source = os.fspath(source)
        return report


def verify(
    source: PathArg,
    output: PathArg,
    *,
    jobs: int | AutoJobs = 1,
    max_disk: int | None = None,
    part: tuple[int, int] | None = None,
    revision: str | None = None,
    token: str | None = None,
    arch_files: Sequence[PathArg] = (),
    registry: Registry | None = None,
    progress: bool = False,
    accept_edits: bool = False,
) -> VerifyReport:
    """Check that `output` is a faithful conversion of `source`; `report.ok`, `report.problems`.

    Three classes of files, each in `report.classes`: the weights and the config, the model card's facts (what
    it was converted from, layout, encoding, tags, the loader table as the rules say for OUTPUT) and the files
    copied from SOURCE (OUTPUT holding no other). `accept_edits`: card facts and files fp8fix did not write
    are `report.edits`, not problems (a card people edited on purpose).

    `output` may be a Hub repo id: then both are read shard by shard, in at most `max_disk` bytes of
    downloaded shards (default: three of the largest), nothing in the Hub cache. `part` (K, N): check
    only the K-th of N shares of the tensors (about 1/N of the bytes each; index, config and card in
    every part), for N machines that together check everything."""
    from fp8fix.io.hub import is_repo_id, local_folder, source_label
    from fp8fix.verification import verify as run_verify

    _jobs(jobs)
    _shares(max_disk, part)
    with api_errors(), _hub_progress(progress, source):
        reg = _registry(registry, arch_files)
        if isinstance(output, str) and is_repo_id(output):
            from fp8fix.verification.remote import verify_remote

            if jobs not in (1, AUTO_JOBS):
                raise UsageError(
                    "--jobs applies to a local OUTPUT: a Hub repo OUTPUT is checked in one process, shard by shard "
                    "as it downloads (for several machines: --part K/N)"
                )

            return verify_remote(
                str(source),
                output,
                revision=revision,
                token=token,
                max_disk=max_disk,
                part=part,
                registry=reg,
                quiet=not progress,
                accept_edits=accept_edits,
            )
        if max_disk is not None:
            raise UsageError("--max-disk bounds the verify of a Hub repo OUTPUT; this OUTPUT is a local folder")
        folder, repo_id = _source(source, revision, token)
        out = local_folder(output, "OUTPUT")  # missing: a usage error, as a missing SOURCE is
        name = source_label(folder, repo_id, revision)
        report = run_verify(
            folder,
            out,
            quiet=not progress,
            registry=reg,
            jobs=jobs,
            part=part,
            source_name=name,
            accept_edits=accept_edits,
        )
        from fp8fix.card_facts import check_card_verdicts

        check_card_verdicts(report, out, reg)
        return report


@dataclass(frozen=True)
class PushResult:
    """Where a push went: the commit's URL, or the pull request's."""

    repo_id: str
    url: str

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "repo_id": self.repo_id, "url": self.url}


def push(
    repo_id: str,
    folder: PathArg,
    *,
    private: bool = False,
    create_pr: bool = False,
    commit_message: str | None = None,
    commit_description: str | None = None,
    commit_size: int | None = None,
    revision: str | None = None,
    token: str | None = None,
    progress: bool = False,
) -> PushResult:
    """Upload the converted checkpoint `folder` to the Hub repo `repo_id` (the order of `hf upload`).

    Large folders go out in several commits of at most `commit_size` bytes (default: 20 GiB); a
    rerun after an interruption skips what the Hub already has. With `create_pr`, one pull request.
    `revision`: the branch to push to (made from main when missing), or the pull request's base.
    """
    from fp8fix.io.hub import COMMIT_BYTES, push_folder
    from fp8fix.report.model_card import commit_message as default_message

    if commit_size is not None and (not isinstance(commit_size, int) or commit_size < 1):
        raise ValueError(f"commit_size must be a positive number of bytes, not {commit_size!r}")
    path = Path(folder)
    with api_errors(), _hub_progress(progress, repo_id):
        if not path.is_dir():
            raise UsageError(f"FOLDER {path}: no such folder" if not path.exists() else f"FOLDER {path}: not a folder")
        if not (path / "config.json").is_file():
            raise InvalidCheckpoint(f"FOLDER {path}: not a checkpoint folder (no config.json)")
        message = commit_message or default_message(path)
        url = push_folder(
            path,
            repo_id,
            private=private,
            create_pr=create_pr,
            commit_message=message,
            commit_description=commit_description,
            revision=revision,
            token=token,
            commit_bytes=commit_size or COMMIT_BYTES,
        )
    return PushResult(repo_id, url)


@dataclass(frozen=True)
class Architecture:
    """One architecture fp8fix converts: its fused modules (with their shards) and experts."""

    name: str
    fused_modules: dict[str, list[str]]  # module suffix -> shard names
    unfused: bool  # runtimes know per-shard names for every fused module (the unfused layout exists)
    experts: str | None  # the stacked-experts module suffix, if any
    source: str  # the entry's file

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fused_modules": self.fused_modules,
            "unfused": self.unfused,
            "experts": self.experts,
            "source": self.source,
        }


def architectures(*, arch_files: Sequence[PathArg] = (), registry: Registry | None = None) -> list[Architecture]:
    """Every architecture of the registry (built in, plus `arch_files` / `registry`), sorted by name."""
    with api_errors():
        reg = _registry(registry, arch_files)
    return [
        Architecture(
            name,
            {m.module: [s.shard for s in m.shards] for m in spec.fused_modules},
            bool(spec.fused_modules) and all(m.can_unfuse for m in spec.fused_modules),
            spec.experts.module if spec.experts else None,
            spec.source,
        )
        for name, spec in sorted(reg.entries.items())
    ]


def architecture_template(name: str) -> dict[str, Any]:
    """A starting registry entry for the architecture `name` (`--arch-file`): a Phi-3-style fused
    qkv_proj and gate_up_proj, each shard's rows an expression over config.json, to edit."""
    if not name or not isinstance(name, str):
        raise ValueError("name must be the config.json architectures[0] of the model, e.g. 'MyModelForCausalLM'")
    return {
        "architectures": [name],
        "notes": (
            "A starting point: make each fused module's suffix, shard order and row expressions say how "
            f"{name} stores them (docs/architectures.md); drop a shard's 'unfused' where no runtime knows "
            "per-shard names. Check with: fp8fix inspect SOURCE --arch-file THIS_FILE"
        ),
        "defaults": {"num_key_value_heads": "num_attention_heads", "head_dim": "hidden_size // num_attention_heads"},
        "fused_modules": [
            {
                "module": "self_attn.qkv_proj",
                "shards": [
                    {"shard": "q", "rows": "num_attention_heads * head_dim", "unfused": "self_attn.q_proj"},
                    {"shard": "k", "rows": "num_key_value_heads * head_dim", "unfused": "self_attn.k_proj"},
                    {"shard": "v", "rows": "num_key_value_heads * head_dim", "unfused": "self_attn.v_proj"},
                ],
            },
            {
                "module": "mlp.gate_up_proj",
                "shards": [
                    {"shard": "gate", "rows": "intermediate_size", "unfused": "mlp.gate_proj"},
                    {"shard": "up", "rows": "intermediate_size", "unfused": "mlp.up_proj"},
                ],
            },
        ],
    }


def _choice(name: str, value: object, valid: Iterable[str], optional: bool = True) -> None:
    valid = tuple(valid)
    if (value is None and optional) or value in valid:
        return
    listed = ", ".join(repr(v) for v in valid) + (" or None" if optional else "")
    raise ValueError(f"{name} must be one of {listed}, not {value!r}")


#: What each count option counts, for its ValueError.
_COUNTS = {"jobs": "a whole number of processes, at least 1", "tp": "a tensor-parallel size (a whole number >= 1)"}


def _shares(max_disk: object, part: object) -> None:
    """`max_disk` None or a positive int; `part` None or (K, N) with 1 <= K <= N."""
    if max_disk is not None and (type(max_disk) is not int or max_disk < 1):
        raise ValueError(f"max_disk must be a positive number of bytes, not {max_disk!r}")
    if part is not None and not (
        isinstance(part, tuple) and len(part) == 2 and all(type(x) is int for x in part) and 1 <= part[0] <= part[1]
    ):
        raise ValueError(f"part must be (K, N) with 1 <= K <= N, not {part!r}")


def _jobs(jobs: object) -> None:
    """`jobs`: a count of processes, or "auto" (the cores other processes leave idle)."""
    if jobs != AUTO_JOBS:
        _count("jobs", jobs, f"or {AUTO_JOBS!r}")


def _count(name: str, value: object, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be {_COUNTS[name]}{' ' + alternative if alternative else ''}, not {value!r}")


def _source(source: PathArg, revision: str | None, token: str | None) -> tuple[Path, str | None]:
    """The folder to read and the Hub repo id, if any: a `str` SOURCE may be a Hub repo id (as on the
    command line); a path object is always a local folder."""
    from fp8fix.io.hub import local_folder, resolve_source

    if not isinstance(source, str):
        return local_folder(source), None
    if not source:
        raise ValueError("source must name a checkpoint folder or a Hub repo id, not ''")
    return resolve_source(source, revision, token)


def _registry(registry: Registry | None, arch_files: Sequence[PathArg]) -> Registry:
    from fp8fix.registry.architectures import Registry

    if isinstance(arch_files, (str, os.PathLike)):
        raise ValueError("arch_files must be a list of paths, not a single path")
    base = registry or Registry.builtin()
    return base.with_arch_files(Path(p) for p in arch_files) if arch_files else base


#: CLI options as the messages spell them -> the keyword argument of this API.
_FLAGS = {
    "layout": "layout",
    "format": "output_format",
    "to": "to",
    "target": "target",
    "jobs": "jobs",
    "revision": "revision",
}
_SWITCHES = {
    "overwrite": "overwrite=True",
    "verify": "verify=True",
    "scan-data": "scan_data=True",
    "dry-run": "dry_run=True",
    "arch-file": "arch_files",
    "create-pr": "create_pr=True",
    "tp-bf16": "tp_bf16=True",
}
#: Options whose value is a number: written unquoted (`tp=8`), or bare (`tp`) without one.
_NUMBERS = {"tp": "tp"}
_FLAG = re.compile(
    r"--(" + "|".join(_FLAGS) + r") ([\w.-]+)|--(" + "|".join(_SWITCHES) + r")\b"
    r"|--(" + "|".join(_NUMBERS) + r")(?: (\d+))?(?![\w-])"
)


def api_message(text: str) -> str:
    """A message written for the command line, with each option as this API's keyword argument."""

    def keyword(m: re.Match[str]) -> str:
        if m.group(1):
            return f'{_FLAGS[m.group(1)]}="{m.group(2)}"'
        if m.group(3):
            return _SWITCHES[m.group(3)]
        return _NUMBERS[m.group(4)] + (f"={m.group(5)}" if m.group(5) else "")

    return _FLAG.sub(keyword, text)


@contextmanager
def api_errors() -> Iterator[None]:
    """Re-raise fp8fix's errors with their options named as keyword arguments (same type, same cause)."""
    try:
        yield
    except Fp8fixError as e:
        text = str(e)
        rewritten = api_message(text)
        if rewritten == text:
            raise
        error = type(e)(rewritten)
        error.command_line = text  # the CLI, which calls this API, prints the message with its flags
        raise error from e.__cause__


@contextmanager
def _hub_progress(progress: bool, repo: object) -> Iterator[None]:
    """huggingface_hub's own progress bars, for the downloads and uploads of `repo` when it is a Hub repo
    id, only when asked for (and not disabled by its HF_HUB_DISABLE_PROGRESS_BARS). A local SOURCE
    does not import huggingface_hub at all (0.1 s of start-up)."""
    from fp8fix.io.hub import is_repo_id

    if progress or not isinstance(repo, str) or not is_repo_id(repo):
        yield
        return
    from huggingface_hub.utils import (  # type: ignore[attr-defined]
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()

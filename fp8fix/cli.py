"""The `fp8fix` command line: parse options, call the Python API (`fp8fix.api`), print the result.

Kept thin on purpose: every command is one API call under the same option names (a test
checks the two against each other), and every decision lives in the library. The options the
commands share and their value types are `cli_options`; what is printed and how a command ends
(text wrapped to 80 columns, `--json` with errors as JSON objects, `-q`, `-v`, one line and an exit
code per user error, a quiet end on a closed pipe) is `cli_output`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fp8fix import __version__
from fp8fix.cli_options import (
    ByteSize,
    PartOfN,
    SizeList,
    arch_file_option,
    given_on_command_line,
    jobs_option,
    output_options,
    push_options,
    source_options,
    token_option,
)
from fp8fix.cli_output import echo_json, echo_lines, error_json, exiting, reports_errors, say, with_exit_codes
from fp8fix.errors import EXIT_HUB, EXIT_MISMATCH, UsageError
from fp8fix.vocab import (
    BLOCKS,
    ENCODING_NAMES,
    LAYOUTS,
    OUTPUT_FORMATS,
    PRECISIONS,
    SCALES,
    SCHEMA_VERSION,
    TARGETS,
)

if TYPE_CHECKING:
    from fp8fix.registry.architectures import Registry


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="fp8fix")
def main() -> None:
    """Fix FP8 checkpoints that runtimes load wrongly or not at all.

    Shell completion (click's): eval "$(_FP8FIX_COMPLETE=bash_source fp8fix)"
    in ~/.bashrc (zsh_source / fish_source for zsh and fish).
    """


CONVERT_EPILOG = """\b
Examples:
  fp8fix convert ./Phi-3-mini-fp8 ./Phi-3-mini-fp8-fixed
  fp8fix convert ./model ./out --target transformers --dry-run
  fp8fix convert ./model ./out --layout fused --dry-run
  fp8fix convert ./model ./out --layout per-shard --overwrite --json
  fp8fix convert ./model ./model-mi300 --to e4m3fnuz --layout fused --verify
  fp8fix convert ./model ./out --layout channel --dry-run
  fp8fix convert ./DeepSeek-R1 ./DeepSeek-R1-tp32 --tp 32 --verify   # whole 128-blocks per rank
  fp8fix convert ./model ./model-tp8 --tp 8 --tp-bf16   # attention not whole blocks per rank: BF16
  fp8fix convert ./model ./model-bf16 --to bf16 --verify   # for GPUs without FP8 (A100, RTX 30xx)
  fp8fix convert ./model ./out --dequantize 'model.layers.0.*' --dequantize '*.o_proj'
  fp8fix convert ./DeepSeek-V3 ./DeepSeek-V3-ue8m0 --scales ue8m0 --verify   # Blackwell DeepGEMM
  fp8fix convert ./model-MXFP8 ./model-FP8-block --blocks 128x128 --verify   # MXFP8 on Hopper / MI300
  fp8fix convert ./DeepSeek-V3.1 ./DeepSeek-V3.1-MXFP8 --blocks mx --verify   # block FP8 on Blackwell
  fp8fix convert org/model-FP8 ./out --revision main --push-to-hub me/model-FP8-fixed --create-pr

\b
Layouts (how fused modules such as qkv_proj carry their scales); without
--layout, the one --target's loaders load correctly (see "loaders" in the output):
  unfused    q_proj/k_proj/v_proj, gate_proj/up_proj, one scale each
             (where runtimes know per-shard names, e.g. Phi-3)
  per-shard  fused weight, one scale per shard (vLLM <= 0.5.0)
  fused      fused weight, one scale (current vLLM, transformers)
  channel    fused weight, one scale per row, as compressed-tensors: exact
             where shard scales differ (current vLLM, transformers)

{exit_codes} With --push-to-hub, a push that fails exits 4 after the conversion record.
"""


@main.command(epilog=with_exit_codes(CONVERT_EPILOG))
@source_options
@click.argument("output", type=click.Path(path_type=Path), required=False)
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="auto",
    show_default=True,
    help="The loaders OUTPUT is for; picks the layout they load correctly (auto: every vLLM since 0.19 and "
    "transformers first, then the older vLLMs).",
)
@click.option(
    "--layout", type=click.Choice(LAYOUTS), help="Layout of fused modules' scales, overriding --target's choice."
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(OUTPUT_FORMATS),
    help="keep SOURCE's format, or write an AutoFP8, Quark, ModelOpt or FBGEMM checkpoint as compressed-tensors "
    "(same codes), overriding --target's choice.",
)
@click.option(
    "--to",
    type=click.Choice([*sorted(ENCODING_NAMES, reverse=True), *PRECISIONS]),
    help="Change the FP8 encoding: e4m3fnuz for AMD MI300-class GPUs, e4m3fn (OCP) back; or write the whole "
    "model unquantized for GPUs without FP8: bf16 (or float16), each weight its code x scale rounded once.",
)
@click.option(
    "--scales",
    type=click.Choice(SCALES),
    help="Write every block scale as a power of two (ue8m0), as DeepGEMM on Hopper / Blackwell reads them: "
    "vLLM requantizes other block scales at every load. Blocks already at one keep their codes; the others are "
    "requantized once, error reported beside vLLM's own.",
)
@click.option(
    "--blocks",
    type=click.Choice(BLOCKS),
    help="128x128: write an MXFP8 or MXFP4 checkpoint (a scale per 32 elements) as 128x128 block FP8, for "
    "runtimes without MX kernels (Hopper, MI300): each block one power of two; values kept where its scales agree "
    "(MXFP4: lie within 14 powers of two), else rounded once (counted, at most half a step). mx: write block FP8 "
    "as MXFP8 (Blackwell): exact where block scales are powers of two, else requantized once as --scales ue8m0 "
    "does (reported).",
)
@click.option(
    "--dequantize",
    metavar="PATTERN",
    multiple=True,
    default=(),
    help="Write the FP8 modules whose names match this shell-style pattern in BF16, listed as unquantized "
    "(the rest stays FP8); repeatable, e.g. --dequantize '*.self_attn.*' --dequantize 'model.layers.0.*'.",
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    help="Zero-pad block-FP8 MLP intermediates (dense, shared and routed experts) so every rank's share "
    "is whole blocks at this tensor-parallel size and its divisors; config.json sizes follow; outputs unchanged.",
)
@click.option(
    "--tp-bf16",
    is_flag=True,
    help="With --tp: write the attention modules padding cannot fix (split by heads, not whole blocks per rank) "
    "in BF16, listed as unquantized in quantization_config, instead of refusing; the rounding error is reported.",
)
@click.option("--verify", is_flag=True, help="Verify OUTPUT against SOURCE before it appears.")
@jobs_option(
    "Processes writing shards in parallel where the work is CPU-bound (--to, requantizing), and "
    "verifying with --verify; capped at the shard count. Output is identical whatever the number."
)
@click.option("--dry-run", is_flag=True, help="Print the plan (each module: what changes and why); write nothing.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace OUTPUT if it is a folder fp8fix wrote; files it did not write are never deleted (refused, named).",
)
@click.option(
    "--push-to-hub",
    metavar="REPO_ID",
    help="Then upload OUTPUT to this Hub repo. With a Hub SOURCE and no OUTPUT: stream Hub to Hub, shard by shard.",
)
@click.option(
    "--max-disk",
    type=ByteSize(),
    help="Streaming (no OUTPUT): bytes of disk the work may hold at once [default: 3 of the largest source shard].",
)
@click.option(
    "--part",
    type=PartOfN(),
    metavar="K/N",
    help="Streaming: convert and upload only the K-th of N shares of the output shards (N machines, one each); "
    "then run once with --finalize.",
)
@click.option(
    "--finalize",
    is_flag=True,
    help="Streaming: after every --part K/N ran, check all output shards are there and make the final commit.",
)
@push_options
@output_options("Also list every module and every tensor written anew.")
@reports_errors
def convert(
    source: str,
    output: Path | None,
    registry: Registry | None,
    push_to_hub: str | None,
    max_disk: int | None,
    part: tuple[int, int] | None,
    finalize: bool,
    as_json: bool,
    quiet: bool,
    verbose: bool,
    private: bool,
    create_pr: bool,
    commit_message: str | None,
    commit_description: str | None,
    commit_size: int | None,
    **options: Any,
) -> None:
    """Convert the FP8 checkpoint SOURCE (folder or Hub repo id) into a fixed copy in OUTPUT.

    SOURCE is never modified. OUTPUT appears only once complete: an error or an
    interrupt leaves nothing behind. With a Hub SOURCE, --push-to-hub and no OUTPUT,
    the conversion streams Hub to Hub: each output shard is made from the source
    shards it needs, uploaded and deleted, in at most --max-disk of disk; the
    destination's main gets everything in one merge, and a rerun resumes.
    """
    from fp8fix import api
    from fp8fix.errors import HubError

    push_flags = {
        "--private": private,
        "--create-pr": create_pr,
        "--commit-message": commit_message is not None,
        "--commit-description": commit_description is not None,
        "--commit-size": commit_size is not None,
    }
    given = [flag for flag, on in push_flags.items() if on]
    if given and not push_to_hub and output is not None:
        raise UsageError(f"{', '.join(given)}: options of the push, which needs --push-to-hub REPO_ID")
    if output is None or max_disk is not None or part is not None or finalize:
        push: dict[str, Any] = {
            "private": private,
            "create_pr": create_pr,
            "commit_message": commit_message,
            "commit_description": commit_description,
            "max_disk": max_disk,
            "part": part,
            "finalize": finalize,
        }
        _stream(source, output, push_to_hub, push, as_json, quiet, verbose, commit_size, registry, options)
        return

    result = api.convert(source, output, registry=registry, progress=not (quiet or as_json), **options)
    for warning in result.warnings:  # even with -q: each is something to act on (docs/ci.md)
        say(f"warning: {warning}", err=True)
    payload = result.to_json() if as_json else {}
    echo_lines(() if as_json else _result_lines(result, verbose), quiet)
    if push_to_hub and result.written:
        try:
            pushed = api.push(
                push_to_hub,
                output,
                private=private,
                create_pr=create_pr,
                commit_message=commit_message or result.commit_title,
                commit_description=commit_description,
                commit_size=commit_size,
                token=options["token"],
                progress=not (quiet or as_json),
            )
        except HubError as e:
            error = HubError(
                f"{e.command_line or e}. {output} is intact: retry with `fp8fix push {push_to_hub} {output}`"
            )
            if not as_json:
                raise error from None
            # the conversion happened: its record goes out with the push's error, then the exit code
            with exiting(EXIT_HUB):
                echo_json(
                    {**payload, "pushed": None, "push_error": error_json(EXIT_HUB, str(error), error)["error"]},
                    EXIT_HUB,
                )
                say(f"Error: {error}", err=True)
        payload["pushed"] = pushed.url
        if not as_json and not quiet:
            say(f"pushed: {pushed.url}")
    if as_json:
        echo_json(payload)


def _stream(
    source: str,
    output: Path | None,
    push_to_hub: str | None,
    push: dict[str, Any],
    as_json: bool,
    quiet: bool,
    verbose: bool,
    commit_size: int | None,
    registry: Registry | None,
    options: dict[str, Any],
) -> None:
    """convert with no OUTPUT: Hub to Hub (`api.convert_to_hub`); the options that need OUTPUT are refused."""
    from fp8fix import api

    if output is not None:
        given = "--max-disk" if push["max_disk"] is not None else "--part" if push["part"] else "--finalize"
        raise UsageError(f"{given} applies to a streamed conversion, which has no OUTPUT: drop OUTPUT or {given}")
    if not push_to_hub:
        raise UsageError(
            "OUTPUT is missing: give an OUTPUT folder, or, for a Hub repo SOURCE, --push-to-hub REPO_ID to convert "
            "Hub to Hub without one"
        )
    needs_output = [
        ("--dry-run", options["dry_run"]),
        ("--overwrite", options["overwrite"]),
        ("--commit-size", commit_size is not None),
        ("--jobs", given_on_command_line("jobs")),  # a stream writes one shard at a time
    ]
    if options["verify"]:
        raise UsageError(
            "--verify checks OUTPUT before it appears, and a streamed conversion has no OUTPUT: give an OUTPUT folder"
        )
    for flag, given in needs_output:
        if given:
            raise UsageError(f"{flag} applies to a conversion into OUTPUT; a streamed conversion has none")
    streamed = api.convert_to_hub(
        source,
        push_to_hub,
        **push,
        registry=registry,
        progress=not (quiet or as_json),
        **{
            k: options[k]
            for k in (
                "layout",
                "to",
                "target",
                "output_format",
                "tp",
                "tp_bf16",
                "dequantize",
                "scales",
                "blocks",
                "revision",
                "token",
            )
        },
    )
    result = streamed.result
    for warning in result.warnings:
        say(f"warning: {warning}", err=True)
    summary = (
        f"streamed: {len(streamed.converted)} output shards converted and uploaded, {len(streamed.skipped)} already "
        f"on the Hub; at most {streamed.peak_disk} bytes on disk (--max-disk {streamed.max_disk})"
    )
    if streamed.part is not None:
        summary += (
            f"\npart {streamed.part[0]}/{streamed.part[1]} done; once every part is: the same command with --finalize"
        )
    if as_json:
        payload = result.to_json()
        payload["pushed"] = streamed.url
        payload["streamed"] = {
            "part": list(streamed.part) if streamed.part else None,
            "converted": streamed.converted,
            "skipped": streamed.skipped,
            "peak_disk": streamed.peak_disk,
            "max_disk": streamed.max_disk,
        }
        echo_json(payload)
        return
    echo_lines([*_result_lines(result, verbose), summary, f"pushed: {streamed.url}"], quiet)


def _result_lines(result: Any, verbose: bool) -> list[str]:
    from fp8fix.report.convert_report import result_lines

    return result_lines(result, verbose)


PUSH_EPILOG = """\b
Examples:
  fp8fix push me/Phi-3-mini-fp8-fixed ./Phi-3-mini-fp8-fixed
  fp8fix push org/model-FP8 ./out --create-pr      # propose the fix to the model's owner
  fp8fix push me/big-model ./big-model --commit-size 10GB   # smaller commits; a rerun resumes
  fp8fix push me/model ./out --revision fp8-fixed           # to a branch (made from main if missing)

\b
REPO_ID comes first, as in `hf upload`. The old order (FOLDER REPO_ID) still works,
with a deprecation warning, when FOLDER is an existing folder and REPO_ID is not.

{exit_codes}
"""


@main.command(epilog=with_exit_codes(PUSH_EPILOG))
@click.argument("repo_id")
@click.argument("folder", type=click.Path(path_type=Path))
@push_options
@click.option(
    "--revision",
    help="Branch to push to, made from main when it does not exist (as `hf upload --revision`); with "
    "--create-pr, the branch the pull request is opened against.",
)
@token_option
@output_options(None)
@reports_errors
def push(repo_id: str, folder: Path, as_json: bool, quiet: bool, **options: Any) -> None:
    """Upload the converted checkpoint FOLDER to the Hub repo REPO_ID (commits of at most --commit-size,
    config and card last; a rerun skips what the Hub already has), or to one pull request."""
    from fp8fix import api

    if Path(repo_id).is_dir() and not folder.is_dir():  # the order of fp8fix <= 0.1: push FOLDER REPO_ID
        repo_id, folder = str(folder), Path(repo_id)
        if not quiet:
            click.echo(
                f"warning: `fp8fix push FOLDER REPO_ID` is deprecated: use `fp8fix push {repo_id} {folder}` "
                "(REPO_ID first, as `hf upload` takes it)",
                err=True,
            )
    pushed = api.push(repo_id, folder, progress=not (quiet or as_json), **options)
    if as_json:
        echo_json(pushed.to_json())
    elif not quiet:
        say(f"pushed: {pushed.url}")


INSPECT_EPILOG = """\b
Examples:
  fp8fix inspect ./Phi-3-mini-fp8
  fp8fix inspect org/model-FP8 --revision main     # headers only, no weights downloaded
  fp8fix inspect ./model --scan-data --json > report.json
  fp8fix inspect ./model --strict -q    # CI gate: exit 1 unless every target row loads and convert changes none
  fp8fix inspect ./model --strict --target vllm   # gate on every vLLM since 0.19 only
  fp8fix inspect ./model --tp 4,8       # block-FP8 modules whose rank share is not whole blocks

\b
--strict fails when a row of --target's loaders (auto: every vLLM since 0.19 and
transformers; with --tp N, vLLM at TP N too) does not load the checkpoint
correctly, or when `fp8fix convert --target TARGET` would make a row load that
does not: the findings name each such row (row-fails, row-rounded, row-loads-wrong,
row-not-judged, row-improved) and the command that makes it load, if any.

{exit_codes}
"""


@main.command(epilog=with_exit_codes(INSPECT_EPILOG))
@source_options
@click.option(
    "--strict",
    is_flag=True,
    help="Exit 1 when a row of --target's loaders does not load correctly, or convert would make a row load.",
)
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="auto",
    show_default=True,
    help="The loaders --strict gates on, and the conversion it asks about (as convert's --target).",
)
@click.option("--scan-data", is_flag=True, help="Also read the FP8 weights: NaN codes, fnuz data under an fn label.")
@click.option(
    "--tp",
    type=SizeList(),
    default=(),
    help="Tensor-parallel sizes, e.g. 4,8: for block-FP8 checkpoints, each module whose rank share is not "
    "whole blocks at each size, and what vLLM 0.32 does about it.",
)
@output_options("List every FP8 module on its own row.")
@reports_errors
def inspect(
    source: str, registry: Registry | None, as_json: bool, quiet: bool, verbose: bool, strict: bool, **options: Any
) -> None:
    """Report what the checkpoint SOURCE is, its problems, and which loaders take it.

    Reads config.json, the safetensors headers and the scales; the weights only
    with --scan-data. A Hub SOURCE is read from the Hub's header API when it can be.
    """
    from fp8fix import api
    from fp8fix.report.inspect_report import report_lines

    report = api.inspect(source, registry=registry, progress=not (quiet or as_json), **options)
    code = EXIT_MISMATCH if strict and report.gate else 0
    with exiting(code):
        if as_json:
            echo_json(report.to_json(), code)
        else:
            echo_lines(report_lines(report, verbose), quiet)


VERIFY_EPILOG = """\b
Examples:
  fp8fix verify ./Phi-3-mini-fp8 ./Phi-3-mini-fp8-fixed
  fp8fix verify org/model-FP8 ./model-mi300 --json > verify.json
  fp8fix verify org/model-FP8 me/model-FP8-fixed --max-disk 30GB   # both on the Hub, shard by shard
  fp8fix verify org/model-FP8 me/model-FP8-fixed --part 2/4         # a quarter of the tensors, on one of 4 machines

{exit_codes}
"""


@main.command("verify", epilog=with_exit_codes(VERIFY_EPILOG))
@source_options
@click.argument("output")
@jobs_option("Processes checking tensors in parallel. The report is identical whatever the number.")
@click.option(
    "--max-disk",
    type=ByteSize(),
    help="OUTPUT a Hub repo: bytes of downloaded shards held at once [default: 3 of the largest].",
)
@click.option(
    "--part",
    type=PartOfN(),
    help="Check only the K-th of N shares of the tensors (about 1/N of the bytes; index, config and card "
    "in every part): N machines, one part each, together check every tensor once.",
)
@click.option(
    "--accept-edits",
    is_flag=True,
    help="A model card people edited (its facts: source, layout, encoding, loader table) and files fp8fix did not "
    "write are listed as edits, not differences. Weights, config and copied files are checked as ever.",
)
@output_options("Also list every weight found exact.")
@reports_errors
def verify_command(
    source: str, output: str, registry: Registry | None, as_json: bool, quiet: bool, verbose: bool, **options: Any
) -> None:
    """Prove OUTPUT a faithful conversion of SOURCE, tensor by tensor.

    Splits and fn <-> fnuz changes must be exact in value, requantized modules
    within half an fp8 step; every other tensor byte-identical; index, config and
    copied files as they should be; the model card's facts true of OUTPUT. Streams
    with bounded memory.
    """
    from fp8fix import api
    from fp8fix.io.hub import is_repo_id
    from fp8fix.report.verify_report import verify_lines

    if is_repo_id(output) and not given_on_command_line("jobs"):
        options["jobs"] = 1  # a Hub OUTPUT is checked in one process, as its shards download (api.verify)
    report = api.verify(source, output, registry=registry, progress=not (quiet or as_json), **options)
    code = 0 if report.ok else EXIT_MISMATCH
    with exiting(code):
        if as_json:
            echo_json(report.to_json(), code)
        else:
            echo_lines(verify_lines(report, verbose), quiet and report.ok)


ARCHITECTURES_EPILOG = """\b
Examples:
  fp8fix architectures
  fp8fix architectures --json
  fp8fix architectures --template MyModelForCausalLM > my-arch.json   # edit, then --arch-file my-arch.json
"""


@main.command(epilog=ARCHITECTURES_EPILOG)
@arch_file_option
@click.option(
    "--template",
    metavar="NAME",
    help="Print a starting registry entry for the architecture NAME (a fused qkv_proj and gate_up_proj, "
    "to edit), for --arch-file.",
)
@output_options(None)
@reports_errors
def architectures(registry: Registry | None, template: str | None, as_json: bool, quiet: bool) -> None:
    """List the architectures fp8fix knows: their fused modules and shards, and whether the unfused
    layout exists (runtimes know per-shard names)."""
    from fp8fix import api

    if template is not None:
        click.echo(json.dumps(api.architecture_template(template), indent=2))
        return
    found = api.architectures(registry=registry)
    if as_json:
        echo_json({"schema_version": SCHEMA_VERSION, "architectures": [a.to_json() for a in found]})
        return
    lines = []
    for a in found:
        modules = "; ".join(f"{m} ({', '.join(shards)})" for m, shards in a.fused_modules.items())
        experts = f"; stacked experts {a.experts}" if a.experts else ""
        layout = ", unfused layout" if a.unfused else ""
        lines.append(f"{a.name}: {modules or 'nothing fused'}{experts}{layout}")
    echo_lines(lines, quiet)

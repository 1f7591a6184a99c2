"""The `fp8fix` command line: parse options, call the library, print the result.

Kept thin on purpose: every decision lives in the library modules. User mistakes
become one line on stderr and their exit code, never a traceback; which error exits
how is `errors.ERROR_TABLE`'s call, not this module's.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from fp8fix import __version__
from fp8fix.errors import DEBUG_VARIABLE, EXIT_BUG, RegistryEntryError, bug_line, user_error
from fp8fix.vocab import ENCODING_NAMES, LAYOUTS, OUTPUT_FORMATS, TARGETS

if TYPE_CHECKING:
    from fp8fix.registry.architectures import Registry

F = TypeVar("F", bound=Callable[..., Any])


def reports_errors(func: F) -> F:
    """Turn the errors of `errors.ERROR_TABLE` (fp8fix's own, Ctrl-C, OS errors) into one line and an exit code.

    Anything else is a bug: one line saying so and exit 70 (FP8FIX_DEBUG=1 re-raises it for the traceback).
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (Exception, KeyboardInterrupt) as e:
            known = user_error(e)
            if known is None:
                if os.environ.get(DEBUG_VARIABLE):
                    raise
                known = EXIT_BUG, bug_line(e)
            code, line = known
            click.echo(line, err=True)
            sys.exit(code)

    return wrapper  # type: ignore[return-value]


def _registry(ctx: click.Context, param: click.Parameter, paths: tuple[Path, ...]) -> Registry:
    """The built-in registry extended by every --arch-file entry (validated: a bad one is a usage error)."""
    from fp8fix.registry.architectures import Registry

    try:
        return Registry.builtin().with_arch_files(paths)
    except RegistryEntryError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


def source_options(func: F) -> F:
    """SOURCE: a checkpoint folder, or a Hub repo id with --revision; --arch-file for unknown architectures."""
    func = click.option(
        "--arch-file",
        "registry",
        type=click.Path(path_type=Path, dir_okay=False),
        multiple=True,
        callback=_registry,
        help="A registry entry (JSON, as in fp8fix/registry/architectures/) for an architecture fp8fix does not know.",
    )(func)
    func = click.option("--revision", help="Branch, tag or commit of a Hub SOURCE.")(func)
    return click.argument("source")(func)


def jobs_option(help_text: str) -> Callable[[F], F]:
    """--jobs for the commands whose work can run in several processes (convert, verify)."""
    return click.option(
        "--jobs",
        type=click.IntRange(min=1),
        default=os.cpu_count() or 1,
        show_default="the machine's cores",
        help=help_text,
    )


def push_options(func: F) -> F:
    for option in reversed(
        [
            click.option("--private", is_flag=True, help="Create the Hub repo private (when it does not exist)."),
            click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to main."),
            click.option("--commit-message", help="Commit / PR title [default: what was converted and how]."),
        ]
    ):
        func = option(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="fp8fix")
def main() -> None:
    """Fix FP8 checkpoints that runtimes load wrongly or not at all."""


CONVERT_EPILOG = """\b
Examples:
  fp8fix convert ./Phi-3-mini-fp8 ./Phi-3-mini-fp8-fixed
  fp8fix convert ./model ./out --target transformers --dry-run
  fp8fix convert ./model ./out --layout fused --dry-run
  fp8fix convert ./model ./out --layout per-shard --overwrite --json
  fp8fix convert ./model ./model-mi300 --to e4m3fnuz --layout fused --verify
  fp8fix convert ./model ./out --layout channel --dry-run
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

\b
Exit codes: 0 done, 1 --verify found a mismatch or OUTPUT could not be
written, 2 usage error (options, OUTPUT not empty or inside SOURCE), 3 invalid
or unsupported checkpoint, 4 Hub error.
"""


@main.command(epilog=CONVERT_EPILOG)
@source_options
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    default="auto",
    show_default=True,
    help="The loaders OUTPUT is for; picks the layout they load correctly (auto: vLLM >= 0.20 and transformers "
    "first, then the older vLLMs).",
)
@click.option(
    "--layout", type=click.Choice(LAYOUTS), help="Layout of fused modules' scales, overriding --target's choice."
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(OUTPUT_FORMATS),
    help="keep SOURCE's format, or write an AutoFP8, Quark or ModelOpt checkpoint as compressed-tensors "
    "(same codes), overriding --target's choice.",
)
@click.option(
    "--to",
    type=click.Choice(sorted(ENCODING_NAMES, reverse=True)),
    help="Change the FP8 encoding: e4m3fnuz for AMD MI300-class GPUs, e4m3fn (OCP) back.",
)
@click.option("--verify", "run_verify", is_flag=True, help="Verify OUTPUT against SOURCE before it appears.")
@jobs_option(
    "Processes writing shards in parallel where the work is CPU-bound (--to, requantizing), and "
    "verifying with --verify; capped at the shard count. Output is identical whatever the number."
)
@click.option("--dry-run", is_flag=True, help="Print the plan (each module: what changes and why); write nothing.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists and is not empty.")
@click.option("--push-to-hub", metavar="REPO_ID", help="Then upload OUTPUT to this Hub repo.")
@push_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (for CI).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@reports_errors
def convert(
    source: str, registry: Registry, revision: str | None, output: Path, push_to_hub: str | None, **options: Any
) -> None:
    """Convert the FP8 checkpoint SOURCE (folder or Hub repo id) into a fixed copy in OUTPUT.

    SOURCE is never modified. OUTPUT appears only once complete: an error or an
    interrupt leaves nothing behind.
    """
    from fp8fix.conversion import ConvertOptions
    from fp8fix.conversion import convert as run_convert
    from fp8fix.errors import HubError
    from fp8fix.io.hub import push_folder, resolve_source
    from fp8fix.report.convert_report import result_json, result_lines

    as_json = options["as_json"]
    folder, repo_id = resolve_source(source, revision)
    settings = ConvertOptions(
        layout=options["layout"],
        to=options["to"],
        target=options["target"],
        output_format=options["output_format"],
        dry_run=options["dry_run"],
        overwrite=options["overwrite"],
        quiet=options["quiet"] or as_json,
        verify=options["run_verify"],
        jobs=options["jobs"],
        source_repo=repo_id,
        revision=revision,
    )
    result = run_convert(folder, output, settings, registry)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    if as_json:
        payload = result_json(result)
    else:
        for line in result_lines(result):
            click.echo(line)
    if push_to_hub and result.written:
        try:
            url = push_folder(
                output,
                push_to_hub,
                private=options["private"],
                create_pr=options["create_pr"],
                commit_message=options["commit_message"] or result.commit_title,
            )
        except HubError as e:
            raise HubError(f"{e}. {output} is intact: retry with `fp8fix push {output} {push_to_hub}`") from None
        if as_json:
            payload["pushed"] = url
        else:
            click.echo(f"pushed: {url}")
    if as_json:
        click.echo(json.dumps(payload, indent=2))


PUSH_EPILOG = """\b
Examples:
  fp8fix push ./Phi-3-mini-fp8-fixed me/Phi-3-mini-fp8-fixed
  fp8fix push ./out org/model-FP8 --create-pr      # propose the fix to the model's owner

\b
Exit codes: 0 pushed, 2 usage error, 3 OUTPUT is not a checkpoint folder, 4 Hub error.
"""


@main.command(epilog=PUSH_EPILOG)
@click.argument("output", type=click.Path(path_type=Path))
@click.argument("repo_id")
@push_options
@reports_errors
def push(output: Path, repo_id: str, private: bool, create_pr: bool, commit_message: str | None) -> None:
    """Upload the converted checkpoint folder OUTPUT to the Hub repo REPO_ID in one commit (or pull request)."""
    from fp8fix.errors import InvalidCheckpoint
    from fp8fix.io.hub import push_folder
    from fp8fix.report.model_card import commit_message as default_message

    if not (output / "config.json").is_file():
        raise InvalidCheckpoint(f"{output}: not a checkpoint folder (no config.json)")
    message = commit_message or default_message(output)
    click.echo(f"pushed: {push_folder(output, repo_id, private=private, create_pr=create_pr, commit_message=message)}")


INSPECT_EPILOG = """\b
Examples:
  fp8fix inspect ./Phi-3-mini-fp8
  fp8fix inspect org/model-FP8 --revision main     # headers only, no weights downloaded
  fp8fix inspect ./model --scan-data --json > report.json
  fp8fix inspect ./model --strict      # CI gate: exit 1 if convert would fix something

\b
Exit codes: 0 inspected (no --strict finding), 1 --strict and a finding convert
fixes, 2 usage error, 3 invalid checkpoint, 4 Hub error.
"""


@main.command(epilog=INSPECT_EPILOG)
@source_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema: README, 'inspect --json').")
@click.option("--strict", is_flag=True, help="Exit 1 when there is a finding that `fp8fix convert` would fix.")
@click.option("--scan-data", is_flag=True, help="Also read the FP8 weights: NaN codes, fnuz data under an fn label.")
@reports_errors
def inspect(
    source: str, registry: Registry, revision: str | None, as_json: bool, strict: bool, scan_data: bool
) -> None:
    """Report what the checkpoint SOURCE is, its problems, and which loaders take it.

    Reads config.json, the safetensors headers and the scales; the weights only
    with --scan-data. A Hub SOURCE is read from the Hub's header API when it can be.
    """
    from fp8fix.inspection import inspect_checkpoint
    from fp8fix.io.hub import is_repo_id, remote_headers, resolve_source
    from fp8fix.report.inspect_report import report_lines

    remote = remote_headers(source, revision) if is_repo_id(source) and not scan_data else None
    report = inspect_checkpoint(remote or resolve_source(source, revision)[0], scan_data=scan_data, registry=registry)
    report.source = source
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for line in report_lines(report):
            click.echo(line)
    if strict and report.fixable:
        sys.exit(1)


VERIFY_EPILOG = """\b
Examples:
  fp8fix verify ./Phi-3-mini-fp8 ./Phi-3-mini-fp8-fixed
  fp8fix verify org/model-FP8 ./model-mi300 --json > verify.json

\b
Exit codes: 0 faithful, 1 mismatch (the tensors are named), 2 usage error,
3 invalid input, 4 Hub error.
"""


@main.command("verify", epilog=VERIFY_EPILOG)
@source_options
@click.argument("output", type=click.Path(path_type=Path))
@jobs_option("Processes checking tensors in parallel. The report is identical whatever the number.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@reports_errors
def verify_command(
    source: str, registry: Registry, revision: str | None, output: Path, jobs: int, as_json: bool, quiet: bool
) -> None:
    """Prove OUTPUT a faithful conversion of SOURCE, tensor by tensor.

    Splits and fn <-> fnuz changes must be exact in value, requantized modules
    within half an fp8 step; every other tensor byte-identical; index, config and
    copied files as they should be. Streams with bounded memory.
    """
    from fp8fix.io.hub import resolve_source
    from fp8fix.report.verify_report import verify_lines
    from fp8fix.verification import verify

    report = verify(resolve_source(source, revision)[0], output, quiet=quiet or as_json, registry=registry, jobs=jobs)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for line in verify_lines(report):
            click.echo(line)
    if not report.ok:
        sys.exit(1)

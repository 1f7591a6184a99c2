"""The `fp8fix` command line: parse options, call the library, print the result.

Kept thin on purpose: every decision lives in the library modules. User mistakes
(`Fp8fixError`) become one line on stderr and their exit code, never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from fp8fix import __version__
from fp8fix.errors import Fp8fixError
from fp8fix.plan import LAYOUTS

F = TypeVar("F", bound=Callable[..., Any])


def reports_errors(func: F) -> F:
    """Turn fp8fix's errors and Ctrl-C into a one-line message and an exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Fp8fixError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted: nothing was written.", err=True)
            sys.exit(130)
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"Error: {where}{e.strerror or e}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="fp8fix")
def main() -> None:
    """Fix FP8 checkpoints that runtimes load wrongly or not at all."""


CONVERT_EPILOG = """\b
Examples:
  fp8fix convert ./Phi-3-mini-fp8 ./Phi-3-mini-fp8-fixed
  fp8fix convert ./model ./out --layout fused --dry-run
  fp8fix convert ./model ./out --layout per-shard --overwrite --json
  fp8fix convert ./model ./model-mi300 --to e4m3fnuz --layout fused

\b
Layouts (how fused modules such as qkv_proj carry their scales):
  unfused    q_proj/k_proj/v_proj, gate_proj/up_proj, one scale each
             (default where runtimes know per-shard names, e.g. Phi-3)
  per-shard  fused weight, one scale per shard (vLLM <= 0.5.0; default elsewhere)
  fused      fused weight, one scale (current vLLM, transformers)

\b
Exit codes: 0 done, 1 --verify found a mismatch or OUTPUT could not be
written, 2 usage error, 3 invalid or unsupported checkpoint.
"""


@main.command(epilog=CONVERT_EPILOG)
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--layout", type=click.Choice(LAYOUTS), help="Layout of fused modules' scales [default: by architecture]."
)
@click.option(
    "--to",
    type=click.Choice(["e4m3fnuz", "e4m3fn"]),
    help="Change the FP8 encoding: e4m3fnuz for AMD MI300-class GPUs, e4m3fn (OCP) back.",
)
@click.option(
    "--verify",
    "run_verify",
    is_flag=True,
    help="Verify OUTPUT against SOURCE before it appears (exit 1 on a mismatch).",
)
@click.option("--dry-run", is_flag=True, help="Print the plan (each module: what changes and why); write nothing.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists and is not empty.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (for CI).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@reports_errors
def convert(
    source: Path,
    output: Path,
    layout: str | None,
    to: str | None,
    run_verify: bool,
    dry_run: bool,
    overwrite: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Convert the FP8 checkpoint folder SOURCE into a fixed copy in OUTPUT.

    SOURCE is never modified. OUTPUT appears only once complete: an error or an
    interrupt leaves nothing behind.
    """
    from fp8fix.convert import ConvertOptions
    from fp8fix.convert import convert as run_convert
    from fp8fix.summary import VLLM_FNUZ_NOTE, loader_lines, plan_json, plan_lines

    result = run_convert(source, output, ConvertOptions(layout, to, dry_run, overwrite, quiet or as_json, run_verify))
    if as_json:
        payload = plan_json(result.plan)
        payload.update(
            output=str(output),
            dry_run=dry_run,
            written=result.written,
            config_edits=result.config_edits,
            copied_files=result.copied_files,
            verification=result.verification.to_json() if result.verification else None,
        )
        click.echo(json.dumps(payload, indent=2))
        return
    for line in plan_lines(result.plan):
        click.echo(line)
    for edit in result.config_edits:
        click.echo(f"  config.json: {edit}")
    if result.copied_files:
        click.echo(f"  copied: {', '.join(result.copied_files)}")
    for line in loader_lines(result.plan.layout):
        click.echo(line)
    if result.plan.encoding and result.plan.encoding.target == "e4m3fnuz":
        click.echo(VLLM_FNUZ_NOTE)
    if result.verification:
        click.echo(f"verified: {result.verification.summary()}")
    if dry_run:
        click.echo("dry run: nothing written")
    else:
        click.echo(f"wrote {output}")


INSPECT_EPILOG = """\b
Examples:
  fp8fix inspect ./Phi-3-mini-fp8
  fp8fix inspect ./model --scan-data --json > report.json
  fp8fix inspect ./model --strict      # CI gate: exit 1 if convert would fix something

\b
Exit codes: 0 inspected (no --strict finding), 1 --strict and a finding convert
fixes, 3 invalid checkpoint.
"""


@main.command(epilog=INSPECT_EPILOG)
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema: README, 'inspect --json').")
@click.option("--strict", is_flag=True, help="Exit 1 when there is a finding that `fp8fix convert` would fix.")
@click.option("--scan-data", is_flag=True, help="Also read the FP8 weights: NaN codes, fnuz data under an fn label.")
@reports_errors
def inspect(source: Path, as_json: bool, strict: bool, scan_data: bool) -> None:
    """Report what the checkpoint SOURCE is, its problems, and which loaders take it.

    Reads config.json, the safetensors headers and the scales; the weights only
    with --scan-data.
    """
    from fp8fix.inspect import inspect_checkpoint, report_lines

    report = inspect_checkpoint(source, scan_data=scan_data)
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
  fp8fix verify ./model ./model-mi300 --json > verify.json

\b
Exit codes: 0 faithful, 1 mismatch (the tensors are named), 3 invalid input.
"""


@main.command("verify", epilog=VERIFY_EPILOG)
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@reports_errors
def verify_command(source: Path, output: Path, as_json: bool, quiet: bool) -> None:
    """Prove OUTPUT a faithful conversion of SOURCE, tensor by tensor.

    Splits and fn <-> fnuz changes must be exact in value, requantized modules
    within half an fp8 step; every other tensor byte-identical; index, config and
    copied files as they should be. Streams with bounded memory.
    """
    from fp8fix.verify import verify

    report = verify(source, output, quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(f"{'faithful' if report.ok else 'MISMATCH'}: {report.summary()}")
        for w in report.weights:
            if w.kind != "exact":
                click.echo(
                    f"  {w.kind:<11} {w.tensor}: max error {w.max_error:.3g} ({w.max_error_steps:.2f} fp8 steps)"
                    + (f", {w.rounded_codes} codes rounded" if w.rounded_codes else "")
                )
        for problem in report.problems:
            click.echo(f"  problem: {problem}")
    if not report.ok:
        sys.exit(1)

"""The options the commands share (SOURCE, `--arch-file`, `--token`, `--jobs`, `--json` / `-q` / `-v`, the Hub push)
and their value types, each checked by the library's own rules (`fp8fix.vocab`, `fp8fix.api`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fp8fix.cli_output import F
from fp8fix.errors import RegistryEntryError
from fp8fix.vocab import AUTO_JOBS

if TYPE_CHECKING:
    from fp8fix.registry.architectures import Registry


def _registry(ctx: click.Context, param: click.Parameter, paths: tuple[Path, ...]) -> Registry | None:
    """The built-in registry extended by every --arch-file entry (validated: a bad one is a usage error)."""
    from fp8fix.registry.architectures import Registry

    if not paths:
        return None
    try:
        return Registry.builtin().with_arch_files(paths)
    except RegistryEntryError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


def arch_file_option(func: F) -> F:
    return click.option(
        "--arch-file",
        "registry",
        type=click.Path(path_type=Path, dir_okay=False),
        multiple=True,
        callback=_registry,
        help="A registry entry (JSON, as in fp8fix/registry/architectures/; `fp8fix architectures --template` "
        "starts one) for an architecture fp8fix does not know.",
    )(func)


def token_option(func: F) -> F:
    return click.option(
        "--token",
        metavar="TOKEN",
        help="Hugging Face token [default: HF_TOKEN, or the one `hf auth login` saved].",
    )(func)


def source_options(func: F) -> F:
    """SOURCE: a checkpoint folder, or a Hub repo id with --revision; --arch-file for unknown architectures."""
    func = arch_file_option(func)
    func = token_option(func)
    func = click.option("--revision", help="Branch, tag or commit of a Hub SOURCE.")(func)
    return click.argument("source")(func)


def output_options(verbose: str | None) -> Callable[[F], F]:
    """--json, -q and (where there is more to say) -v."""

    def apply(func: F) -> F:
        if verbose:
            func = click.option("-v", "--verbose", is_flag=True, help=verbose)(func)
        func = click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors (no progress, no report).")(
            func
        )
        return click.option(
            "--json",
            "as_json",
            is_flag=True,
            help="Print the result as JSON on stdout (docs/cli-output.md).",
        )(func)

    return apply


def given_on_command_line(name: str) -> bool:
    """Whether the option `name` of the running command was given, not left at its default."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) is ParameterSource.COMMANDLINE


def jobs_option(help_text: str) -> Callable[[F], F]:
    """--jobs for the commands whose work can run in several processes (convert, verify)."""
    return click.option(
        "--jobs",
        type=JobCount(),
        metavar="N|auto",
        default=AUTO_JOBS,
        show_default=True,
        help=help_text + " auto: the cores other processes leave idle (1 on a busy machine, or under 64 MB).",
    )


if TYPE_CHECKING:
    IntParam = click.ParamType[int]  # generic in click >= 8.2's typing; a plain class at run time before
    JobsParam = click.ParamType[int | str]
    SizesParam = click.ParamType[tuple[int, ...]]
    PairParam = click.ParamType[tuple[int, int]]
else:
    IntParam = SizesParam = PairParam = JobsParam = click.ParamType


class SizeList(SizesParam):
    """A comma-separated list of tensor-parallel sizes: 4,8."""

    name = "sizes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            sizes = tuple(int(part) for part in str(value).split(",") if part.strip())
        except ValueError:
            sizes = (0,)
        if any(n < 1 for n in sizes):
            self.fail(f"{value!r} is not a list of sizes such as 4,8", param, ctx)
        return sizes


class JobCount(JobsParam):
    """A number of processes, at least 1, or "auto"."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        if text == AUTO_JOBS:
            return AUTO_JOBS
        if not re.fullmatch(r"\d{1,6}", text) or int(text) < 1:
            self.fail(f"{value!r:.40} is not a number of processes (1 or more) or 'auto'", param, ctx)
        return int(text)


class PartOfN(PairParam):
    """K/N: the K-th of N parts, 1 <= K <= N."""

    name = "K/N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        m = re.fullmatch(r"\s*(\d{1,6})\s*/\s*(\d{1,6})\s*", str(value))
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            self.fail(f"{value!r:.40} is not K/N with 1 <= K <= N, such as 2/4", param, ctx)
        return int(m.group(1)), int(m.group(2))


class ByteSize(IntParam):
    """A size in bytes: 1000, 100KB, 20GB, 5GiB."""

    name = "size"
    UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    UNITS |= {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    #: A commit of more than a pebibyte is no limit at all; a number past it is a typo.
    LARGEST = 2**50

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*([kKmMgGtT]i?)?[bB]?\s*", str(value))
        if not m:
            self.fail(f"{value!r:.60} is not a size such as 20GB, 512MiB or 1000000", param, ctx)
        size = int(Fraction(m.group(1)) * self.UNITS[(m.group(2) or "").upper()])
        if not 1 <= size <= self.LARGEST:
            self.fail(f"{value!r:.60} is {size} bytes; a size is 1 byte to 1PiB", param, ctx)
        return size


def push_options(func: F) -> F:
    for option in reversed(
        [
            click.option("--private", is_flag=True, help="Create the Hub repo private (when it does not exist)."),
            click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to main."),
            click.option("--commit-message", help="Commit / PR title [default: what was converted and how]."),
            click.option("--commit-description", help="Commit / PR description, below the title."),
            click.option(
                "--commit-size",
                type=ByteSize(),
                help="Bytes per commit: larger folders go out in several commits, which a rerun resumes "
                "[default: 20GiB].",
            ),
        ]
    ):
        func = option(func)
    return func

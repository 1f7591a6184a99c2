"""What the command line prints, and how it ends: text wrapped to the terminal, `--json` (errors too, as JSON
objects with their `exit_reason`), `-q` and `-v`, one line and an exit code per user error (`errors.ERROR_TABLE`)
and a quiet end on a closed pipe with the command's own exit status (`exiting`)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import click

from fp8fix.errors import (
    DEBUG_VARIABLE,
    EXIT_BUG,
    EXIT_REASONS,
    UsageError,
    bug_line,
    exit_codes_line,
    user_error,
)
from fp8fix.vocab import SCHEMA_VERSION

F = TypeVar("F", bound=Callable[..., Any])

#: Text output is wrapped to the terminal's width, or to COLUMNS, or (a log, a pipe) to this.
WIDTH = 80


def wrapped(lines: Iterable[str], width: int | None = None) -> list[str]:
    """Each line cut at spaces to `width` columns (the terminal's, COLUMNS, else 80), continuation lines
    indented 4 more than the line; a word longer than the width (a tensor path) stays whole."""
    width = width or shutil.get_terminal_size((WIDTH, 24)).columns
    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")) + 4)
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False) or [
            line
        ]
    return out


def echo_lines(lines: Iterable[str], quiet: bool = False) -> None:
    if not quiet:
        for line in wrapped(lines):
            say(line)


def say(line: str, err: bool = False) -> None:
    """Print one line of text output, its control characters escaped (`report.text.printable`)."""
    from fp8fix.report.text import printable

    click.echo(printable(line), err=err)


def echo_json(payload: dict[str, Any], code: int = 0) -> None:
    """`payload` as strict JSON, with `exit_reason` (the exit code's class, `errors.EXIT_CODES`): a figure that
    is not finite (vLLM's float32 arithmetic overflowing on a hostile scale) is null, not the `NaN` / `Infinity`
    most JSON parsers reject."""
    payload = {**payload, "exit_reason": EXIT_REASONS[code]}
    try:
        text = json_text(payload)
    except ValueError:  # a figure that is not finite: the payload walked to replace it (rare; seconds at 50k rows)
        text = json_text(finite(payload))
    click.echo(text)


#: A top-level list longer than this is printed one item per line (`json_text`).
LONG_LIST = 100


def json_text(payload: dict[str, Any]) -> str:
    """`json.dumps(payload, indent=2)`, but for top-level lists longer than LONG_LIST, whose items are one
    line each: Python's indenting encoder is pure Python (4 s for inspect's 50,000 module rows), its compact
    one C. Raises ValueError on a float that is not finite."""
    if not payload:
        return "{}"
    fields = []
    for key, value in payload.items():
        if isinstance(value, list) and len(value) > LONG_LIST:
            text = "[\n" + ",\n".join("    " + json.dumps(v, allow_nan=False) for v in value) + "\n  ]"
        else:
            text = json.dumps(value, indent=2, allow_nan=False).replace("\n", "\n  ")
        fields.append(f"  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(fields) + "\n}"


def with_exit_codes(epilog: str) -> str:
    """A command's epilog with the one exit-code table (`errors.EXIT_CODES`) where it says `{exit_codes}`."""
    return epilog.replace("{exit_codes}", exit_codes_line())


def finite(value: Any) -> Any:
    """`value` with every float that is not finite replaced by None, through lists and dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def error_json(code: int, line: str, error: BaseException) -> dict[str, Any]:
    """An error as `--json` prints it (docs/cli-output.md, "JSON output")."""
    message = line.removeprefix("Error: ")
    return {
        "schema_version": SCHEMA_VERSION,
        "error": {
            "type": type(error).__name__,
            "message": message,
            "exit_code": code,
            "exit_reason": EXIT_REASONS[code],
        },
    }


def reports_errors(func: F) -> F:
    """Turn the errors of `errors.ERROR_TABLE` (fp8fix's own, Ctrl-C, OS errors) into one line and an exit
    code (and, under --json, a JSON error object on stdout); a closed stdout into a quiet exit.

    Anything else is a bug: one line saying so and exit 70 (FP8FIX_DEBUG=1 re-raises it for the traceback).
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            if kwargs.get("quiet") and kwargs.get("verbose"):
                raise UsageError("-q and -v: -q prints nothing but errors, -v more detail; give one of them")
            return func(*args, **kwargs)
        except BrokenPipeError:
            quiet_exit()
        except (Exception, KeyboardInterrupt) as e:
            known = user_error(e)
            if known is None:
                if os.environ.get(DEBUG_VARIABLE):
                    raise
                known = EXIT_BUG, bug_line(e)
            code, line = known
            with exiting(code):
                if kwargs.get("as_json"):
                    echo_json(error_json(code, line, e), code)
                say(line, err=True)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def exiting(code: int) -> Iterator[None]:
    """Print the outcome of a command that then exits with `code`: a reader that went away (`| head`) stops
    the printing quietly, and the exit status is `code` still, so a failing verify or `inspect --strict`
    cannot pass through a pipe as 0."""
    try:
        yield
    except BrokenPipeError:
        quiet_exit(code)
    if code:
        sys.exit(code)


def quiet_exit(code: int = 0) -> None:
    """The reader of stdout went away (`| head`): stop without a word, as Unix tools do, with the exit
    status the command had come to (0 for a command whose output is all there is)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):  # so the interpreter's own flush at exit cannot fail again
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    sys.exit(code)

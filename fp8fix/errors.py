"""Errors a user can act on, and the one table that turns each into a line and an exit code.

Commands raise typed errors and never format messages or choose exit codes
themselves (the shape of huggingface_hub's CLI `_errors.py`): `ERROR_TABLE` below is
the only place that says which error exits how. Anything in it is printed as one line
without a traceback: it describes the user's input or environment, not a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_INVALID_INPUT = 3
EXIT_HUB = 4
EXIT_ENVIRONMENT = 5
EXIT_BUG = 70  # sysexits' EX_SOFTWARE: fp8fix itself failed
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


@dataclass(frozen=True)
class ExitCode:
    """One exit code: one class of cause, so a CI step can tell a bad model from a bad runner."""

    code: int
    reason: str  # JSON `exit_reason`
    meaning: str


#: The one table of exit codes: README, every command's `--help` and JSON `exit_reason` are made from it.
EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(0, "ok", "done: converted, faithful, inspected (or a dry run)"),
    ExitCode(1, "difference", "the model: verify found a difference, or `--strict` a finding"),
    ExitCode(2, "usage", "the command: an option, a path, OUTPUT not replaceable"),
    ExitCode(3, "bad-input", "the checkpoint: invalid or unsupported (which file, which tensor)"),
    ExitCode(4, "hub", "the Hub or the network: not found, no permission, gated, offline"),
    ExitCode(
        5,
        "environment",
        "the machine: disk full, OUTPUT locked by another fp8fix, out of memory, a SOURCE "
        "file changed while read, a missing extra (torch)",
    ),
    ExitCode(EXIT_BUG, "bug", "a bug in fp8fix (one line; FP8FIX_DEBUG=1 shows the traceback)"),
    ExitCode(EXIT_INTERRUPTED, "interrupted", "Ctrl-C, at any moment; nothing written"),
    ExitCode(EXIT_TERMINATED, "terminated", "SIGTERM; nothing written"),
)
EXIT_REASONS = {e.code: e.reason for e in EXIT_CODES}


def exit_codes_line() -> str:
    """The exit-code table as every command's `--help` ends with it."""
    return "Exit codes: " + "; ".join(f"{e.code} {e.reason}" for e in EXIT_CODES) + " (docs/cli-output.md)."


#: Set to see a bug's traceback instead of its one line.
DEBUG_VARIABLE = "FP8FIX_DEBUG"
ISSUES_URL = "https://github.com/fp8fix/fp8fix/issues"


def some(names: list[str], shown: int = 3, width: int = 80, quoted: bool = False) -> str:
    """The first `shown` of `names` for a message, each cut to `width` characters (quoted: as repr), and a count
    of the rest: names from input (a hostile config's entries, a card's rows) are of any length and number."""
    listed = ", ".join(f"{name!r:.{width}}" if quoted else f"{name:.{width}}" for name in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


class Fp8fixError(Exception):
    """A problem the user can fix. `command_line`: the message as the CLI words it (options as flags),
    where the Python API reworded it (options as keyword arguments)."""

    command_line: str | None = None


class UsageError(Fp8fixError):
    """The command was asked for something it cannot do as given (options, paths)."""


class OutputError(UsageError):
    """The destination cannot be written as asked (exists, overlaps the source, ...)."""


class RegistryEntryError(UsageError):
    """An architecture entry (built in or `--arch-file`) that does not follow the registry's schema."""


class InvalidCheckpoint(Fp8fixError):
    """The source is not a well-formed checkpoint (bad config, index or safetensors file)."""


class UnsupportedCheckpoint(Fp8fixError):
    """A well-formed checkpoint in a format or architecture fp8fix cannot convert yet."""


class VerificationFailed(Fp8fixError):
    """`convert --verify` found the output unfaithful; nothing was written."""


class HubError(Fp8fixError):
    """The Hub could not be read or written: not found, no permission, gated, offline, network."""


class RepoNotReached(HubError):
    """No such repo on the Hub, or the Hub could not be asked (offline, network error): for a SOURCE that
    could also be a local path (`examples/model` run from another folder), the message says that no
    folder of that name exists either."""


class OutputBusy(Fp8fixError):
    """Another fp8fix process is writing the same OUTPUT right now."""


class SourceChanged(Fp8fixError):
    """A SOURCE file changed size while it was being read (another process truncated or rewrote it)."""


class OutputWriteFailed(Fp8fixError):
    """OUTPUT could not be written: the disk is full, a quota or file-size limit was hit, read-only."""


class WorkerDied(Fp8fixError):
    """A `--jobs` worker process ended without answering (killed by the OOM killer or a signal)."""


class MissingExtra(Fp8fixError):
    """An optional dependency a path needs is not installed (torch: `fp8fix[torch]`)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the same cleanup runs (entry.run installs the handler)."""


@dataclass(frozen=True)
class ErrorForm:
    """How one type of error reaches the user: its exit code and its one line."""

    exit_code: int
    template: str  # formatted with `message`


#: Error type -> what the user sees; the first entry the error is an instance of wins.
ERROR_TABLE: tuple[tuple[type[BaseException], ErrorForm], ...] = (
    (VerificationFailed, ErrorForm(EXIT_MISMATCH, "Error: {message}")),
    (OutputBusy, ErrorForm(EXIT_ENVIRONMENT, "Error: {message}")),
    (SourceChanged, ErrorForm(EXIT_ENVIRONMENT, "Error: {message}")),
    (WorkerDied, ErrorForm(EXIT_ENVIRONMENT, "Error: {message}")),
    (OutputWriteFailed, ErrorForm(EXIT_ENVIRONMENT, "Error: {message}")),
    (UsageError, ErrorForm(EXIT_USAGE, "Error: {message}")),
    (HubError, ErrorForm(EXIT_HUB, "Error: {message}")),
    (InvalidCheckpoint, ErrorForm(EXIT_INVALID_INPUT, "Error: {message}")),
    (UnsupportedCheckpoint, ErrorForm(EXIT_INVALID_INPUT, "Error: {message}")),
    (MissingExtra, ErrorForm(EXIT_ENVIRONMENT, "Error: {message}")),
    (Fp8fixError, ErrorForm(EXIT_INVALID_INPUT, "Error: {message}")),
    (Terminated, ErrorForm(EXIT_TERMINATED, "Terminated: nothing was written.")),
    (KeyboardInterrupt, ErrorForm(EXIT_INTERRUPTED, "Interrupted: nothing was written.")),
    (MemoryError, ErrorForm(EXIT_ENVIRONMENT, "Error: out of memory; nothing was written (try fewer --jobs)")),
    (OSError, ErrorForm(EXIT_ENVIRONMENT, "Error: {message}")),  # disk full, permissions: OUTPUT not written
)


def user_error(error: BaseException) -> tuple[int, str] | None:
    """(exit code, line) for an error the user can act on; None for a bug (let it raise)."""
    for kind, form in ERROR_TABLE:
        if isinstance(error, kind):
            return form.exit_code, form.template.format(message=_message(error))
    return None


def bug_line(error: BaseException) -> str:
    """The one line for an exception no entry of ERROR_TABLE covers: fp8fix's fault, not the user's."""
    text = str(error).splitlines()[0][:200] if str(error) else ""
    return (
        f"Internal error (a bug in fp8fix, not a problem with your input): {type(error).__name__}"
        f"{': ' + text if text else ''}. Nothing was written. Please report it at {ISSUES_URL} "
        f"with the command you ran; {DEBUG_VARIABLE}=1 shows the traceback."
    )


def _message(error: BaseException) -> str:
    if isinstance(error, Fp8fixError) and error.command_line:
        return error.command_line
    if isinstance(error, OSError) and not isinstance(error, Fp8fixError):
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror or error}"
    return str(error)

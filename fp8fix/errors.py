"""Errors a user can act on, each with the exit code the CLI returns for it.

Anything raised as an `Fp8fixError` is printed as one line, without a traceback:
it describes a problem with the user's input or environment, not a bug in fp8fix.
"""

from __future__ import annotations

EXIT_MISMATCH = 1
EXIT_INVALID_INPUT = 3
EXIT_HUB = 4


class Fp8fixError(Exception):
    """A problem the user can fix; `exit_code` is what the CLI exits with."""

    exit_code = EXIT_INVALID_INPUT


class InvalidCheckpoint(Fp8fixError):
    """The source is not a well-formed checkpoint (bad config, index or safetensors file)."""


class UnsupportedCheckpoint(Fp8fixError):
    """A well-formed checkpoint in a format or architecture fp8fix cannot convert yet."""


class OutputError(Fp8fixError):
    """The destination cannot be written as asked (exists, overlaps the source, ...)."""


class VerificationFailed(Fp8fixError):
    """`convert --verify` found the output unfaithful; nothing was written."""

    exit_code = EXIT_MISMATCH

"""The process entry point (`fp8fix` and `python -m fp8fix`): the CLI plus what no command can do itself.

Importing click and fp8fix takes about a tenth of a second, before any command's
error handling exists; Ctrl-C in that window, or while click parses options, must
still be one line and exit 130. SIGTERM is turned into an exception like Ctrl-C, so
the staging folder is removed instead of being left behind. A bug anywhere is one
line and exit 70 (FP8FIX_DEBUG=1 shows the traceback). Kept free of imports beyond
the standard library so the guards are in place almost at once.
"""

from __future__ import annotations

import _signal  # the C module, built in: importing `signal` builds its enums first (milliseconds, unguarded)
import os


def _early_exit(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM before `run` holds its guards (while fp8fix.errors and click import): one line and the
    signal's exit code, at once; nothing has been written yet."""
    interrupted = signum == _signal.SIGINT
    os.write(2, b"Interrupted: nothing was written.\n" if interrupted else b"Terminated: nothing was written.\n")
    os._exit(130 if interrupted else 143)


_signal.signal(_signal.SIGINT, _early_exit)  # the first thing the process does once Python runs fp8fix's code
_signal.signal(_signal.SIGTERM, _early_exit)

import signal  # noqa: E402 (after the guard above)
import sys  # noqa: E402
from types import FrameType  # noqa: E402

from fp8fix.errors import (  # noqa: E402
    DEBUG_VARIABLE,
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Terminated,
    bug_line,
)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def run() -> None:
    try:
        signal.signal(signal.SIGTERM, _terminate)  # from here on, both are exceptions the handlers below catch
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import click

        from fp8fix.cli import main

        try:
            # not standalone: click would turn Ctrl-C during option parsing into "Aborted!" and exit 1
            code = main(prog_name="fp8fix", standalone_mode=False)
        except click.Abort as e:
            raise (e.__context__ if isinstance(e.__context__, KeyboardInterrupt) else KeyboardInterrupt()) from None
        except click.ClickException as e:  # a usage error click found: under --json, a JSON error too
            from fp8fix.cli_output import echo_json, error_json, exiting

            with exiting(e.exit_code):
                if "--json" in sys.argv[1:][: (sys.argv[1:] + ["--"]).index("--")]:
                    echo_json(error_json(e.exit_code, e.format_message(), e), e.exit_code)
                e.show()
        sys.exit(code if isinstance(code, int) else 0)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Terminated:
        sys.stderr.write("Terminated: nothing was written.\n")
        sys.exit(EXIT_TERMINATED)
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted: nothing was written.\n")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:
        if os.environ.get(DEBUG_VARIABLE):
            raise
        sys.stderr.write(bug_line(e) + "\n")
        sys.exit(EXIT_BUG)

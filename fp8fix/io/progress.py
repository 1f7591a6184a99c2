"""Progress over bytes for long work (convert, verify): a tqdm bar on a terminal, and in CI logs (stderr
not a terminal) a plain line every `FP8FIX_PROGRESS_SECONDS` (default 30), and one at the end of work
that printed any, so a 20-minute conversion is not silent (and a 2-second one prints nothing).
`HF_HUB_DISABLE_PROGRESS_BARS=1` (huggingface_hub's switch, which
also silences its downloads and uploads) or `TQDM_DISABLE=1` turns both off, as `-q` does.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Protocol

#: Seconds between two progress lines when stderr is not a terminal.
INTERVAL_VARIABLE = "FP8FIX_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0


class Progress(Protocol):
    def update(self, n: int) -> Any: ...


class NoProgress:
    """Stands in for tqdm when no bar is shown, so tqdm is not even imported."""

    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class LineProgress:
    """One line on stderr every `interval` seconds, and one when work that printed any completes: for logs."""

    def __init__(self, total: int, desc: str, interval: float) -> None:
        self.total, self.desc, self.interval = total, desc, interval
        self.done = self.lines = 0
        self.start = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        from fp8fix.report.text import human_size

        self.lines += 1
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        sys.stderr.write(
            f"{self.desc}: {human_size(self.done)} of {human_size(self.total)}{share}, {now - self.start:.0f} s\n"
        )
        sys.stderr.flush()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and self.lines:
            self._line(time.monotonic())


def progress_disabled() -> bool:
    """huggingface_hub's and tqdm's own switches for progress output."""
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")
    )


def progress_bar(total: int, desc: str, quiet: bool) -> Any:
    """A tqdm bar over bytes on a terminal, progress lines in a log, nothing when quiet or disabled."""
    if quiet or progress_disabled():
        return NoProgress()
    if not sys.stderr.isatty():
        try:
            interval = float(os.environ.get(INTERVAL_VARIABLE, DEFAULT_INTERVAL))
        except ValueError:
            interval = DEFAULT_INTERVAL
        return LineProgress(total, desc, interval)
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

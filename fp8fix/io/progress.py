"""Progress over bytes for long work (convert, verify): tqdm on a terminal, nothing otherwise."""

from __future__ import annotations

import sys
from typing import Any, Protocol


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


def progress_bar(total: int, desc: str, quiet: bool) -> Any:
    """A tqdm bar over bytes on a terminal (tqdm's own rule: no bar when stderr is not a TTY)."""
    if quiet or not sys.stderr.isatty():
        return NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

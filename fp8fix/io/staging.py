"""Safe output: OUTPUT appears complete or not at all, and SOURCE is never touched.

Everything is written into a hidden staging folder beside OUTPUT, which is renamed
into place only when complete; any error or interrupt before that removes it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fp8fix.errors import OutputError


def check_output(source: Path, output: Path, overwrite: bool) -> None:
    """Refuse destinations that would touch the source or clobber something unasked."""
    src, out = source.resolve(), output.resolve()
    if out == src or out.is_relative_to(src):
        raise OutputError(f"{output}: OUTPUT is inside SOURCE; fp8fix never writes into the source checkpoint")
    if src.is_relative_to(out):
        raise OutputError(f"{output}: OUTPUT contains SOURCE; choose another destination")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{output}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{output}: exists and is not empty; pass --overwrite to replace it")


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def staging_folder(output: Path) -> Iterator[Path]:
    """A fresh folder beside OUTPUT, renamed to OUTPUT on success and removed on any failure.

    The folder is created inside the guarded block, so an interrupt arriving just after
    it exists still removes it; the final swap runs with SIGINT/SIGTERM held back, so an
    interrupt cannot fall between moving an old OUTPUT aside and moving the new one in.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.fp8fix-{secrets.token_hex(6)}"
    try:
        staging.mkdir(mode=0o700)
        yield staging
        os.chmod(staging, 0o755)
        with _signals_held():
            _move_into_place(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, output: Path) -> None:
    if not output.exists():
        os.rename(staging, output)
        return
    old = output.parent / f".{output.name}.fp8fix-old-{secrets.token_hex(6)}"
    os.rename(output, old)
    os.rename(staging, output)
    shutil.rmtree(old)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back (delivered right after) where the platform allows it."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

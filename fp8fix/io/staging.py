"""Safe output: OUTPUT appears complete or not at all, SOURCE is never touched, one writer at a time.

Everything is written into a hidden staging folder beside OUTPUT, which is renamed
into place only when complete; any error, Ctrl-C or SIGTERM before that removes it.
A lock file beside OUTPUT (`.NAME.fp8fix.lock`, flock) admits one fp8fix writer per
OUTPUT; the loser gets `OutputBusy` at once. Because every writer holds that lock,
staging folders found beside OUTPUT by the lock holder were left by runs that were
killed (SIGKILL, power loss): `remove_stale_staging` deletes them and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint, OutputBusy, OutputError, some
from fp8fix.io.checkpoint import CARD, CONFIG, INDEX, card_front_matter, index_weight_map, read_json
from fp8fix.io.source_tree import open_regular

try:
    import fcntl
except ImportError:  # Windows: no flock; one writer per OUTPUT is then up to the user
    fcntl = None  # type: ignore[assignment]


def output_path(output: Path) -> Path:
    """Where OUTPUT is really written: a symbolic link is followed, so the link keeps naming the new checkpoint;
    `.` or `..` become the folder they name (whose parent holds the lock and the staging folder)."""
    if output.is_symlink():
        return Path(os.path.realpath(output))
    return Path(os.path.abspath(output)) if output.name in ("", "..") else output


#: Random hex bytes in a staging folder's name (`.NAME.fp8fix-<hex>`, `.NAME.fp8fix-old-<hex>`).
_TOKEN_BYTES = 6
#: OUTPUT names up to this many bytes appear whole in the names beside it; a longer one (up to the 255
#: bytes a file name can be) is cut and followed by a digest of it, so the lock and staging names fit too.
_LABEL_BYTES = 200


def _label(output: Path) -> str:
    """OUTPUT's name as the files beside it carry it: whole when short, else cut and made unique by a digest."""
    name = output.name
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) <= _LABEL_BYTES:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    return f"{encoded[:100].decode('utf-8', 'ignore')}~{digest}"


def _staging_name(output: Path, old: bool = False) -> Path:
    """A fresh hidden folder name beside OUTPUT: for the new checkpoint, or (old) for the one it replaces."""
    return output.parent / f".{_label(output)}.fp8fix-{'old-' if old else ''}{os.urandom(_TOKEN_BYTES).hex()}"


def _staging_pattern(output: Path) -> re.Pattern[str]:
    """Every name `_staging_name` can give for OUTPUT, and no other."""
    return re.compile(rf"\.{re.escape(_label(output))}\.fp8fix-(old-)?[0-9a-f]{{{2 * _TOKEN_BYTES}}}")


@contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold `.NAME.fp8fix.lock` beside OUTPUT for the block; raise OutputBusy if another process holds it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    path = output.parent / f".{_label(output)}.fp8fix.lock"
    if fcntl is None:
        yield
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusy(
                f"{output}: another fp8fix process is writing it right now ({path.name} is locked); "
                "wait for it to finish or choose another OUTPUT"
            ) from None
        try:  # the holder before us may have unlinked the file we opened: lock the one at `path`
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def remove_stale_staging(output: Path) -> list[str]:
    """Delete staging folders of killed runs into OUTPUT (call with `output_lock` held); one line per folder."""
    removed = []
    pattern = _staging_pattern(output)
    for entry in sorted(output.parent.iterdir()) if output.parent.is_dir() else []:
        if pattern.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file() and not p.is_symlink())
            shutil.rmtree(entry)
            removed.append(f"removed {entry.name} ({size / 1e6:.1f} MB), left beside OUTPUT by an interrupted run")
    return removed


def check_output(source: Path, output: Path, overwrite: bool, rewrites: Collection[str] | None = None) -> None:
    """Refuse destinations that would touch the source or clobber something unasked. `rewrites` (the files the
    conversion writes, once planned): `--overwrite` replaces an empty folder or one fp8fix wrote, and never loses
    a file fp8fix did not write (`files_lost`)."""
    src, out = source.resolve(), output.resolve()
    if out == src or out.is_relative_to(src):
        raise OutputError(f"OUTPUT {output}: inside SOURCE; fp8fix never writes into the source checkpoint")
    if src.is_relative_to(out):
        raise OutputError(f"OUTPUT {output}: contains SOURCE; choose another destination")
    if out.exists() and not out.is_dir():
        raise OutputError(f"OUTPUT {output}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"OUTPUT {output}: exists and is not empty; pass --overwrite to replace it")
    lost = files_lost(out, rewrites) if out.is_dir() and rewrites is not None else []
    if lost:
        raise OutputError(
            f"OUTPUT {output}: --overwrite replaces only an empty folder or one fp8fix wrote, and replacing this one "
            f"would lose {some(lost, SHOWN_LOST, width=255)}, which fp8fix did not write; move them away or choose "
            "another OUTPUT"
        )


#: Files a refusal names; how many entries of OUTPUT are looked at (a hostile folder may hold millions).
SHOWN_LOST = 10
MAX_ENTRIES = 100_000
#: How much of OUTPUT's model card is read for fp8fix's tag.
CARD_BYTES = 64 * 1024


def files_lost(output: Path, rewrites: Collection[str]) -> list[str]:
    """The entries of OUTPUT (relative paths, links and folders' files included) that replacing it would lose:
    every one, unless its model card carries fp8fix's tag; then those fp8fix did not write (its card, config
    files, index and the shards that index names) and the new conversion does not write again (`rewrites`)."""
    entries = _entries(output)
    if not entries or not _written_by_fp8fix(output):
        return entries
    ours = {CARD, CONFIG, "hf_quant_config.json", INDEX, *rewrites, *_indexed_shards(output)}
    return [e for e in entries if e not in ours]


def _entries(folder: Path) -> list[str]:
    """Every file, link and empty folder under `folder`, as sorted relative paths; links are not followed."""
    found: list[str] = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        dirs[:] = [d for d in dirs if d not in links]
        found += [str(rel / name) for name in (*files, *links)]
        if not dirs and not files and not links and root != str(folder):
            found.append(str(rel) + "/")
        if len(found) > MAX_ENTRIES:
            break
    return sorted(found)


def _written_by_fp8fix(output: Path) -> bool:
    """OUTPUT's model card is a regular file whose front matter lists the `fp8fix` tag (convert writes it)."""
    try:
        fd = open_regular(output / CARD, follow_links=False)
    except (OSError, InvalidCheckpoint):
        return False
    try:
        head = os.read(fd, CARD_BYTES).decode("utf-8", "replace")
    finally:
        os.close(fd)
    found = card_front_matter(head)
    return found is not None and "fp8fix" in found[0]


def _indexed_shards(output: Path) -> set[str]:
    """The shard files OUTPUT's index names (none for an unreadable index: those shards count as lost)."""
    index = output / INDEX
    if index.is_symlink():
        return set()
    if not index.exists():
        return {"model.safetensors"}
    try:
        return set(index_weight_map(read_json(index)).values())
    except InvalidCheckpoint:
        return set()


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
    staging = _staging_name(output)
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
    old = _staging_name(output, old=True)
    os.rename(output, old)
    os.rename(staging, output)
    shutil.rmtree(old, ignore_errors=True)  # OUTPUT is complete; a leftover is removed by the next run as stale


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

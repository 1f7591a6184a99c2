"""SOURCE as fp8fix may read it: regular files inside the folder, read with a bound.

Checkpoints come from the internet and are converted in CI beside write tokens. A file
of a downloaded repo may be a symbolic link out of it (to a secret, to
`/proc/self/environ`), a FIFO (a read that never returns) or a device (`/dev/zero`: a
read that never ends). fp8fix reads a file only when its real path is inside SOURCE
(for a Hub cache snapshot, whose files link to `../../blobs/`, inside that repo's blobs)
and it is a regular file, and never more bytes than the caller's bound. Model files
(config, index, shards) that break the rule are refused; other files (tokenizer, card,
license) are skipped with a warning, never followed out.

The check is made on the real path, then the file is opened and checked again on the open
descriptor (`fstat`): a regular file within the caller's bound. OUTPUT's files, which no
SourceTree checks and which fp8fix writes as regular files, are opened without following a
link at all (`follow_links=False`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from fp8fix.errors import InvalidCheckpoint

#: A model repo holds tens to a few thousand files; past this the folder is not one.
MAX_FILES = 100_000


def open_regular(path: Path, limit: int | None = None, *, follow_links: bool = True) -> int:
    """A read-only descriptor of `path`, which must be a regular file of at most `limit` bytes.

    Opened non-blocking, so a FIFO cannot hang the open; checked on the descriptor, so a
    FIFO, device or folder is refused before any read. Raises InvalidCheckpoint naming the file.
    `follow_links=False` refuses a symbolic link itself (for OUTPUT's files, which fp8fix writes
    as regular files, and which no SourceTree checked): its target is never opened.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        if path.is_symlink():
            raise InvalidCheckpoint(f"{path.name}: is a symbolic link, not a regular file; not followed")
        flags |= getattr(os, "O_NOFOLLOW", 0)  # and if it became one since: ELOOP, below
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InvalidCheckpoint(f"{path.name}: cannot be read ({e.strerror or e})") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"is {_kind(info.st_mode)}, not a regular file; fp8fix reads only regular files"
    elif limit is not None and info.st_size > limit:
        problem = f"is {info.st_size} bytes, more than the {limit} bytes such a file can be"
    if problem:
        os.close(fd)
        raise InvalidCheckpoint(f"{path.name}: {problem}")
    return fd


def read_regular(path: Path, limit: int, *, follow_links: bool = True) -> bytes:
    """The whole content of the regular file `path` (at most `limit` bytes: a file that grows past
    its size while being read is cut there, never read without end)."""
    fd = open_regular(path, limit, follow_links=follow_links)
    try:
        size = os.fstat(fd).st_size
        chunks, got = [], 0
        while got <= size:
            chunk = os.read(fd, min(size + 1 - got, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)[:limit]
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


@dataclass(frozen=True)
class SourceTree:
    """Which paths of the folder `root` may be read: the real path inside `root` (or inside the
    Hub cache's blobs of the repo, for a cache snapshot) and a regular file."""

    root: Path
    allowed: tuple[Path, ...] = field(default=())

    @classmethod
    def of(cls, root: Path) -> SourceTree:
        real_root = Path(os.path.realpath(root))
        allowed = [real_root]
        # a Hub cache snapshot (<repo>/snapshots/<revision>) links every file to <repo>/blobs/
        if real_root.parent.name == "snapshots":
            allowed.append(real_root.parent.parent / "blobs")
        return cls(root, tuple(allowed))

    def problem(self, rel: str) -> str | None:
        """Why the file `rel` (relative to root) may not be read, or None when it may."""
        path = self.root / rel
        real = Path(os.path.realpath(path))
        if not any(real == a or real.is_relative_to(a) for a in self.allowed):
            return f"a symbolic link to {real}, outside the checkpoint folder"
        try:
            mode = os.stat(real).st_mode
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if not stat.S_ISREG(mode):
            return f"{_kind(mode)}, not a regular file"
        return None

    def require(self, rel: str) -> Path:
        """`root / rel`, refused (InvalidCheckpoint, naming it) unless it may be read."""
        problem = self.problem(rel)
        if problem:
            raise InvalidCheckpoint(
                f"{rel}: {problem}; fp8fix reads only regular files inside the checkpoint folder "
                "(copy the file itself into the folder, e.g. with cp -L)"
            )
        return self.root / rel

    def files(self) -> tuple[list[str], list[str]]:
        """(every readable file below root, relative and sorted; one warning per entry skipped).

        Hidden names (`.git`, `.cache`) are not looked into. Links to folders are not followed:
        their files are listed as skipped. At most MAX_FILES entries are looked at.
        """
        found: list[str] = []
        skipped: list[str] = []
        seen = 0
        for folder, dirs, names in os.walk(self.root, followlinks=False):
            base = Path(folder).relative_to(self.root)
            for name in sorted(dirs):
                if os.path.islink(os.path.join(folder, name)) and not name.startswith("."):
                    skipped.append(f"{(base / name).as_posix()}: a symbolic link to a folder; not followed, not copied")
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                seen += 1
                if seen > MAX_FILES:
                    raise InvalidCheckpoint(
                        f"{self.root}: holds more than {MAX_FILES} files; a model repo holds a few thousand at most"
                    )
                if name.startswith("."):
                    continue
                rel = (base / name).as_posix()
                problem = self.problem(rel)
                if problem:
                    skipped.append(f"{rel}: {problem}; not read, not copied")
                else:
                    found.append(rel)
        return sorted(found), skipped

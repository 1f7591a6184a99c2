"""A Hub repo read shard by shard: a sparse local stand-in to plan from, then each shard when needed.

Planning reads headers and scales, never weights. `mirror` makes a folder that the ordinary
open / describe / plan code reads as a local checkpoint: the repo's small files downloaded, each
shard a sparse file of its full size holding its header, the rest a hole that takes no disk;
`fill_values` then writes in the scales planning reads, fetched with HTTP range requests.
`fetch` later replaces one shard with the whole file (downloaded beside it, its header checked
against the one planned from, renamed over it); `release` deletes it again. Everything is read at
one commit, so the files cannot change between planning and writing, and nothing goes to the Hub
cache.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8fix.errors import HubError, InvalidCheckpoint
from fp8fix.io.hub import ALLOW_PATTERNS, bounded_session, hub_errors, retried
from fp8fix.io.safetensors_file import MAX_HEADER_BYTES, TensorInfo, read_header
from fp8fix.io.source_files import SourceFiles

#: The largest scale tensor fetched for planning (a block grid of a 2^20 x 2^20 weight is 256 KiB).
SMALL_TENSOR = 1 << 20
#: Small tensors closer together than this are fetched in one range request.
GAP = 1 << 20
#: Range requests in flight at once while mirroring.
FETCHERS = 8
#: Bytes per read of a download.
DOWNLOAD_CHUNK = 1 << 22


@dataclass(frozen=True)
class RemoteRepo:
    """A Hub model repo pinned at one commit: its files (path -> size) and how to read them."""

    repo_id: str
    commit: str
    files: dict[str, int]
    token: str | None = None

    def _get(self, name: str, headers: dict[str, str]) -> Any:
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status  # type: ignore[attr-defined]

        session = get_session()  # httpx (huggingface_hub >= 1.0, the declared floor)
        url = hf_hub_url(self.repo_id, name, revision=self.commit)
        request = session.build_request("GET", url, headers={**build_hf_headers(token=self.token), **headers})
        response = session.send(request, stream=True, follow_redirects=True)
        try:
            hf_raise_for_status(response)
        except Exception:
            response.close()
            raise
        return response

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of file `name`, exactly (a short or long answer is the Hub's error)."""

        def read() -> bytes:
            data = bytearray()
            with closing(self._get(name, {"Range": f"bytes={start}-{end - 1}"})) as response:
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > end - start:  # an answer longer than asked is never held whole
                        break
            if len(data) != end - start:
                raise HubError(f"{self.repo_id}: {name}: asked for {end - start} bytes at {start}, got {len(data)}")
            return bytes(data)

        with hub_errors(self.repo_id, self.commit):
            return bytes(retried(read))

    def download(self, name: str, dest: Path) -> None:
        """File `name` into `dest` (written as `dest`.part, renamed when complete and of the listed size)."""
        part = dest.with_name(dest.name + ".part")

        def read() -> None:
            with closing(self._get(name, {})) as response, open(part, "wb") as f:
                for chunk in response.iter_bytes(DOWNLOAD_CHUNK):
                    f.write(chunk)
                    if f.tell() > self.files[name]:  # longer than listed: stop before the disk fills
                        break

        with hub_errors(self.repo_id, self.commit):
            retried(read)
        if part.stat().st_size != self.files[name]:
            got = part.stat().st_size
            part.unlink()
            raise HubError(f"{self.repo_id}: {name}: the download is {got} bytes, the repo lists {self.files[name]}")
        os.replace(part, dest)


def open_remote(repo_id: str, revision: str | None, token: str | None = None, role: str = "SOURCE") -> RemoteRepo:
    """The repo at `revision` (its current commit), with every file's size, from the Hub's tree API;
    `role`: the argument it is, for errors."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=token)
    with hub_errors(repo_id, revision, role=role):
        bounded_session()
        commit = retried(api.repo_info, repo_id, revision=revision).sha
        entries = retried(lambda: list(api.list_repo_tree(repo_id, revision=commit, recursive=True)))
    files = {e.path: e.size for e in entries if isinstance(e, RepoFile)}
    return RemoteRepo(repo_id, commit or revision or "main", files, token)


def mirror(remote: RemoteRepo, folder: Path) -> dict[str, bytes]:
    """Make `folder` the planning stand-in for `remote` (see the module docstring); return each shard's
    header as planned from, which `fetch` holds the downloaded file to."""
    for name in remote.files:
        _inside(folder, name)  # every name checked before anything is written
    for name in sorted(remote.files):
        if not name.endswith(".safetensors") and any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            remote.download(name, folder / name)
    shards = sorted(n for n in remote.files if n.endswith(".safetensors"))
    with ThreadPoolExecutor(FETCHERS) as pool:
        return dict(zip(shards, pool.map(lambda name: _shell(remote, name, folder / name), shards), strict=True))


def _shell(remote: RemoteRepo, name: str, path: Path) -> bytes:
    """Shard `name` as a sparse file: its header, holes for the data (`fill_values` adds the scales)."""
    size = remote.files[name]
    if size < 8:
        raise InvalidCheckpoint(f"{name}: file is {size} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", remote.read_range(name, 0, 8))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise InvalidCheckpoint(f"{name}: header length {header_len} does not fit the {size}-byte file")
    path.parent.mkdir(parents=True, exist_ok=True)
    planned = remote.read_range(name, 0, 8 + header_len)
    with open(path, "wb") as f:
        f.write(planned)
        f.truncate(size)
    return planned


def fill_values(remote: RemoteRepo, folder: Path, tensors: list[TensorInfo]) -> None:
    """Write `tensors` (the scales planning reads, each at most SMALL_TENSOR bytes) into the stand-ins,
    fetched in range requests that merge neighbours."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for t in tensors:
        if t.nbytes > SMALL_TENSOR:
            raise InvalidCheckpoint(f"{t.path.name}: scale '{t.name}' is {t.nbytes} bytes; a scale is small")
        by_file.setdefault(t.path.relative_to(folder).as_posix(), []).append((t.start, t.end))

    def fill(name: str) -> None:
        with open(folder / name, "r+b") as f:
            for start, end in _coalesced(by_file[name]):
                f.seek(start)
                f.write(remote.read_range(name, start, end))

    with ThreadPoolExecutor(FETCHERS) as pool:
        for _ in pool.map(fill, sorted(by_file)):
            pass


def _coalesced(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges merged where the gap between them is under GAP: fewer requests, a little more data."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] < GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def fetch(remote: RemoteRepo, folder: Path, name: str, planned: dict[str, bytes]) -> None:
    """Shard `name` downloaded whole over its stand-in; its header must be the one planned from."""
    path = folder / name
    full = path.with_name(path.name + ".full")
    remote.download(name, full)
    with open(full, "rb") as f:
        if f.read(len(planned[name])) != planned[name]:
            full.unlink()
            raise HubError(f"{remote.repo_id}@{remote.commit}: {name} is not the file planned from (changed?)")
    os.replace(full, path)


def _inside(folder: Path, name: str) -> Path:
    """`folder / name` for a repo path that stays inside `folder` (a hostile repo cannot choose where to write)."""
    normal = posixpath.normpath(name)
    if name.startswith("/") or normal.startswith("..") or normal != name or "\\" in name or "\0" in name:
        raise InvalidCheckpoint(f"the repo lists a file named {name!r}, which is not a plain relative path")
    return folder / normal


def fill_small_floats(remote: RemoteRepo, folder: Path) -> None:
    """Every float tensor of at most SMALL_TENSOR bytes of every stand-in (scales, input scales, norms):
    what verify reads by value without streaming, for a repo it knows nothing else about."""
    floats = ("F64", "F32", "F16", "BF16")
    tensors = [
        t
        for name in remote.files
        if name.endswith(".safetensors")
        for t in read_header(folder / name).tensors.values()
        if t.dtype in floats and 0 < t.nbytes <= SMALL_TENSOR
    ]
    fill_values(remote, folder, tensors)


@dataclass(frozen=True)
class StandIn:
    """A shard's stand-in: the repo it is read from, its name there, the folder it is under, its header."""

    remote: RemoteRepo
    name: str
    folder: Path
    header: bytes


class LazyShards(SourceFiles):
    """SourceFiles over stand-ins: a shard is downloaded whole the first time it is read, and when the next
    one would take the files past `bound` bytes, the least recently read goes back to its stand-in (its
    descriptor closed, so its disk is freed). Reads of the small tensors a stand-in holds need no download."""

    def __init__(self, stand_ins: dict[Path, StandIn], bound: int) -> None:
        super().__init__()
        self.stand_ins, self.bound = stand_ins, bound
        self.full: dict[Path, int] = {}  # downloaded shards, least recently read first, with their sizes
        self.held: dict[Path, list[tuple[int, int]]] = {}  # what each downloaded shard's stand-in held
        self.downloads = 0
        self.peak = 0

    def fd(self, path: Path) -> int:
        if path in self.stand_ins:
            if path not in self.full:
                self._download(path)
            self.full[path] = self.full.pop(path)  # the most recently read
        return super().fd(path)

    def _download(self, path: Path) -> None:
        shard = self.stand_ins[path]
        size = shard.remote.files[shard.name]
        while self.full and sum(self.full.values()) + size > self.bound:
            self._restore(next(iter(self.full)))
        ranges = _held_ranges(path)
        self.close(path)
        fetch(shard.remote, shard.folder, shard.name, {shard.name: shard.header})
        self.full[path] = size
        self.held[path] = ranges
        self.downloads += 1
        self.peak = max(self.peak, sum(self.full.values()))

    def _restore(self, path: Path) -> None:
        """Put the stand-in back in place of the downloaded shard."""
        shard = self.stand_ins[path]
        self.close(path)
        part = path.with_name(path.name + ".stand-in")
        with open(path, "rb") as full, open(part, "wb") as f:
            f.write(shard.header)
            f.truncate(shard.remote.files[shard.name])
            for start, end in self.held.pop(path):
                full.seek(start)
                f.seek(start)
                f.write(full.read(end - start))
        os.replace(part, path)
        del self.full[path]


def _held_ranges(path: Path) -> list[tuple[int, int]]:
    """The byte ranges a stand-in holds besides its header (the small tensors written in): its data regions."""
    ranges = []
    with open(path, "rb") as f:
        fd, size = f.fileno(), os.fstat(f.fileno()).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after offset
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            ranges.append((start, end))
            offset = end
    return ranges

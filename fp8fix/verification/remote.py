"""verify where OUTPUT (and SOURCE) are Hub repos: shard by shard, in bounded disk, nothing in the Hub cache.

Each repo becomes a folder of stand-ins (`io/remote_source.py`: headers, and every small float tensor
fetched by range requests), which the ordinary verify reads as checkpoints; a shard is downloaded whole
the first time a check reads its data, and the least recently read one goes back to its stand-in when
the next would pass the disk bound. verify checks tensor by tensor in the order the files hold them,
so each shard is downloaded about once.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fp8fix.errors import UsageError
from fp8fix.io.hub import looks_local, source_label
from fp8fix.io.remote_source import LazyShards, StandIn, fill_small_floats, mirror, open_remote
from fp8fix.registry.architectures import Registry
from fp8fix.verification import verify
from fp8fix.verification.report import VerifyReport

#: The default disk bound, in largest shards: two are read at once (a SOURCE shard and an OUTPUT shard).
DEFAULT_SHARDS_ON_DISK = 3


def verify_remote(
    source: str,
    output: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    max_disk: int | None = None,
    part: tuple[int, int] | None = None,
    registry: Registry | None = None,
    quiet: bool = False,
    accept_edits: bool = False,
) -> VerifyReport:
    """`verify` of the Hub repo OUTPUT against SOURCE (a Hub repo at `revision`, or a local folder)."""
    work = Path(tempfile.mkdtemp(prefix="fp8fix-verify-"))
    try:
        stand_ins: dict[Path, StandIn] = {}

        def stand_in(repo_id: str, at: str | None, folder: Path) -> Path:
            remote = open_remote(repo_id, at, token, role=folder.name.upper())
            folder.mkdir()
            headers = mirror(remote, folder)
            fill_small_floats(remote, folder)
            for name, header in headers.items():
                stand_ins[folder / name] = StandIn(remote, name, folder, header)
            return folder

        src = Path(source) if looks_local(source) else stand_in(source, revision, work / "source")
        out = stand_in(output, None, work / "output")
        sizes = sorted((s.remote.files[s.name] for s in stand_ins.values()), reverse=True)
        least = sum(sizes[:2])
        bound = max_disk if max_disk is not None else max(DEFAULT_SHARDS_ON_DISK * sizes[0], least)
        if bound < least:
            raise UsageError(f"--max-disk {bound}: verify reads two shards at once, {least} bytes; give that or more")
        name = source_label(src, None if looks_local(source) else source, revision)
        files = LazyShards(stand_ins, bound)
        report = verify(
            src,
            out,
            quiet=quiet,
            registry=registry,
            files=files,
            part=part,
            source_name=name,
            accept_edits=accept_edits,
        )
        report.source, report.output = source, output
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)

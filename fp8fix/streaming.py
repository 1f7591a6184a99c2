"""`convert ORG/SRC --push-to-hub ORG/DST` with no OUTPUT: Hub to Hub, shard by shard, in bounded disk.

The plan comes from a sparse stand-in of SOURCE (`io/remote_source.py`: headers and scales only).
Then, for each output shard: download the source shards it reads (releasing others first where
the disk bound needs it), write it, commit it with a small record of it to a pull request on DST,
delete it, and delete the source shards no later output shard reads. The index, config files,
copied files and model card go last, in one commit that also removes the records; the pull request
is then merged (left open with --create-pr), so DST's main never shows a half checkpoint.

A rerun resumes: the pull request's title carries a fingerprint of the plan (source commit,
options, fp8fix version, output shard names and sizes), and every output shard the pull request
holds whose record gives the same fingerprint and the shard's sha256 is neither rebuilt nor
uploaded again. The records also keep what writing the shard revealed (requantization errors),
so the model card of a resumed run is the one a single run writes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fp8fix import __version__
from fp8fix.collector import collector_paused
from fp8fix.conversion import ConvertOptions, plan_with, record_stats, write_repo_files
from fp8fix.errors import UsageError
from fp8fix.io.checkpoint import Checkpoint, open_checkpoint
from fp8fix.io.hub_pull_request import StreamPullRequest, stats_from_json
from fp8fix.io.progress import progress_bar
from fp8fix.io.remote_source import RemoteRepo, fetch, fill_values, mirror, open_remote
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.io.shard_loop import ShardLoop, disk_bytes
from fp8fix.io.writer import WriteStats, shard_file_bytes, shard_inputs, write_shard
from fp8fix.model import CheckpointModel, describe_checkpoint
from fp8fix.numerics.dtypes import E4M3FNUZ
from fp8fix.plan.pieces import ConversionPlan, OutputShard
from fp8fix.registry.architectures import Registry
from fp8fix.report.convert_report import ConvertResult
from fp8fix.report.model_card import commit_title

#: The default disk bound: this many times the largest source shard (or what one output shard needs).
DEFAULT_SHARDS_ON_DISK = 3


@dataclass
class StreamResult:
    """A streamed conversion: what was planned (`result`), where it went, and what each shard took."""

    result: ConvertResult
    url: str = ""
    converted: list[str] = field(default_factory=list)  # output shards written and uploaded by this run
    skipped: list[str] = field(default_factory=list)  # output shards the pull request already held
    max_disk: int = 0  # the bound the working folder was held under
    part: tuple[int, int] | None = None  # (K, N) of --part K/N: no final commit
    peak_disk: int = 0  # the most bytes it held (source shards downloaded, the output shard being written)


@dataclass(frozen=True)
class Destination:
    """The Hub repo a streamed conversion lands on, and how: as `push` takes them."""

    repo_id: str
    private: bool
    create_pr: bool
    commit_message: str | None
    commit_description: str | None


def stream_convert(
    repo_id: str,
    where: Destination,
    options: ConvertOptions,
    registry: Registry,
    *,
    max_disk: int | None = None,
    token: str | None = None,
    part: tuple[int, int] | None = None,
    finalize: bool = False,
) -> StreamResult:
    """Convert the Hub repo `repo_id` into the Hub repo `where` says, shard by shard (see the module
    docstring).

    With `part` (K, N): only the K-th of N shares of the output shards (balanced by bytes, the same in
    every part), no final commit. `finalize`: nothing converted; every output shard must be on the pull
    request already, and the final commit is made."""
    remote = open_remote(repo_id, options.revision, token)
    work = Path(tempfile.mkdtemp(prefix="fp8fix-stream-"))
    try:
        return _stream(remote, where, options, registry, work, max_disk, part, finalize)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stream(
    remote: RemoteRepo,
    where: Destination,
    options: ConvertOptions,
    registry: Registry,
    work: Path,
    max_disk: int | None,
    part: tuple[int, int] | None,
    finalize: bool,
) -> StreamResult:
    dest = where.repo_id
    source = work / "source"
    source.mkdir()
    headers = mirror(remote, source)
    ckpt, plan = _plan_from_stand_ins(remote, source, options, registry)
    edits = [edit for _, file_edits in plan.config_files.values() for edit in file_edits]
    result = ConvertResult(plan, Path(dest), written=False, config_edits=edits)
    result.copied_files = ckpt.copied_files([*plan.config_files, *plan.dropped_files])
    result.warnings += ckpt.warnings
    sizes = {source / name: size for name, size in remote.files.items()}
    needs = [(shard, sorted(shard_inputs(shard))) for shard in plan.shards]
    base = disk_bytes(work)  # held throughout: the stand-ins (headers, scales) and the small files
    bound = _bound(max_disk, needs, sizes, base)
    streamed = StreamResult(result, max_disk=bound)
    name = remote.repo_id + (f"@{options.revision}" if options.revision else "")
    fingerprint = _fingerprint(remote, options, plan)
    title = f"{where.commit_message or commit_title(name, options.describe(plan))} [fp8fix {fingerprint}]"
    hub = StreamPullRequest(dest, title, fingerprint, remote.token, where.private, where.commit_description)
    stats = WriteStats()
    todo = _shards_to_write(needs, hub.records, part, finalize, stats, streamed)
    out = work / "output"
    out.mkdir()
    with progress_bar(plan.total_bytes, "fp8fix convert", options.quiet) as bar:
        bar.update(sum(shard.nbytes for shard, _ in needs if shard.name in hub.records))
        loop = ShardLoop(todo, sizes, bound, lambda name: fetch(remote, source, name, headers), source)
        loop.base = base
        for shard, path in loop.run(out):
            shard_stats = write_shard(plan, shard, path, bar)
            stats.merge(shard_stats)
            loop.upload(shard.name, path, partial(hub.send_shard, shard, path, shard_stats), hub.commit_shard)
            streamed.converted.append(shard.name)
        streamed.peak_disk = loop.peak
    if part is not None:  # another run makes the final commit (`--finalize`)
        hub.open()
        streamed.url = hub.url
        return streamed
    record_stats(plan, stats)
    final = work / "final"
    final.mkdir()
    write_repo_files(ckpt, plan, final, options, result)
    streamed.url = hub.finish(final, merge=not where.create_pr)
    result.written = True
    return streamed


def parts_of(shards: list[OutputShard], n: int) -> dict[str, int]:
    """Which of N parts (1..N) writes each output shard: largest first, each to the part with the fewest
    bytes so far (the lowest-numbered on a tie). The plan fixes the shards, so every part computes the same."""
    loads = [0] * n
    owner: dict[str, int] = {}
    for shard in sorted(shards, key=lambda s: (-s.nbytes, s.name)):
        k = min(range(n), key=lambda k: (loads[k], k))
        owner[shard.name] = k + 1
        loads[k] += shard.nbytes
    return owner


def _scales(model: CheckpointModel) -> list[TensorInfo]:
    """Every weight's scale and input scale, the KV-cache scales and FP4 modules' global scales (one value each; their
    group scales are read as their rows are written): all a plan reads of the data."""
    found = {s.name: s for w in model.weights.values() for s in (w.scale, w.input_scale) if s is not None}
    found.update((s.name, s) for s in model.kv_cache_scales)
    found.update((s.name, s) for w in model.fp4.values() for s in (w.global_scale, w.input_global_scale) if s)
    return list(found.values())


@collector_paused()
def _plan_from_stand_ins(
    remote: RemoteRepo, source: Path, options: ConvertOptions, registry: Registry
) -> tuple[Checkpoint, ConversionPlan]:
    """The checkpoint of the stand-ins and its plan: described from the headers alone first, to learn which
    tensors are scales, whose values are then fetched, as planning reads them."""
    ckpt = open_checkpoint(source)
    ckpt.has_data = False  # headers only: which tensors are scales, before their values are there
    fill_values(remote, source, _scales(describe_checkpoint(ckpt, registry)))
    ckpt.has_data = True  # the same headers, now with the scales' values on disk
    ckpt.codes_on_disk = False  # ... and no weight's codes
    model = describe_checkpoint(ckpt, registry)
    if options.to == "e4m3fn" and any(w.tensor.dtype == E4M3FNUZ for w in model.module_weights()):
        raise UsageError(
            "--to e4m3fn from e4m3fnuz depends on every code of every weight (whether code 0x7F occurs), which a "
            "streamed conversion plans without: give an OUTPUT folder"
        )
    return ckpt, plan_with(model, options)


def _shards_to_write(
    needs: list[tuple[OutputShard, list[Path]]],
    records: dict[str, dict[str, Any]],
    part: tuple[int, int] | None,
    finalize: bool,
    stats: WriteStats,
    streamed: StreamResult,
) -> list[tuple[int, OutputShard, list[Path]]]:
    """(index, shard, source files) of the shards this run writes: those the pull request lacks (the others'
    recorded stats go into `stats`), of this part's share; none, or an error, with `finalize`."""
    todo = []
    for i, (shard, inputs) in enumerate(needs):
        record = records.get(shard.name)
        if record is None:
            todo.append((i, shard, inputs))
        else:
            stats.merge(stats_from_json(record["stats"]))
            streamed.skipped.append(shard.name)
    if part is not None:
        owners = parts_of([shard for shard, _ in needs], part[1])
        todo = [t for t in todo if owners[t[1].name] == part[0]]
    if finalize and todo:
        raise UsageError(
            f"--finalize: {len(todo)} output shards are not on the pull request yet ({todo[0][1].name}...): run every "
            "--part K/N (again), or the command without --part or --finalize, which converts what is missing"
        )
    streamed.part = part
    return todo


def _bound(max_disk: int | None, needs: list[tuple[OutputShard, list[Path]]], sizes: dict[Path, int], base: int) -> int:
    """The disk bound: `max_disk`, or DEFAULT_SHARDS_ON_DISK times the largest source shard (at least what
    one output shard needs); a bound some output shard cannot be written under (the source shards it reads,
    itself, and the `base` bytes held throughout) is refused here, before any shard is downloaded."""
    need = {shard.name: base + shard_file_bytes(shard) + sum(sizes[p] for p in inputs) for shard, inputs in needs}
    largest = max(need, key=lambda name: need[name])
    if max_disk is None:
        return max(DEFAULT_SHARDS_ON_DISK * max(sizes.values(), default=0), need[largest])
    if need[largest] > max_disk:
        raise UsageError(
            f"--max-disk {max_disk}: output shard {largest} needs {need[largest]} bytes on disk at once (the source "
            f"shards it reads, itself, and the headers and small files held throughout); give --max-disk "
            f"{need[largest]} or more"
        )
    return max_disk


def _fingerprint(remote: RemoteRepo, options: ConvertOptions, plan: ConversionPlan) -> str:
    """What the output bytes depend on, hashed: equal fingerprints, equal shards."""
    facts = {
        "source": remote.repo_id,
        "commit": remote.commit,
        "options": options.describe(plan),
        "fp8fix": __version__,
        "shards": [(s.name, s.nbytes) for s in plan.shards],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]

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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fp8fix import __version__
from fp8fix.conversion import ConvertOptions, ConvertResult, record_stats, write_repo_files
from fp8fix.errors import UsageError
from fp8fix.io.checkpoint import open_checkpoint
from fp8fix.io.hub import bounded_session, hub_errors, retried
from fp8fix.io.progress import progress_bar
from fp8fix.io.remote_source import RemoteRepo, fetch, fill_values, mirror, open_remote
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.io.writer import WriteStats, shard_file_bytes, shard_inputs, write_shard
from fp8fix.model import CheckpointModel, describe_checkpoint
from fp8fix.numerics.dtypes import E4M3FNUZ
from fp8fix.numerics.requantize import RoundingStats
from fp8fix.plan.pieces import ConversionPlan, OutputShard
from fp8fix.plan.planner import plan_for_target
from fp8fix.registry.architectures import Registry
from fp8fix.report.model_card import commit_title

#: Where the records of committed shards live on the pull request until the last commit removes them.
RECORDS = ".fp8fix-stream"
#: The pull request's description: what it is while the conversion runs.
PR_DESCRIPTION = (
    "Converted by fp8fix, shard by shard: each output shard is committed here as it is made; the index, "
    "config.json and model card come last, and the pull request is then merged (or left for review)."
)
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


def stream_convert(
    repo_id: str,
    dest: str,
    options: ConvertOptions,
    registry: Registry,
    *,
    max_disk: int | None = None,
    token: str | None = None,
    private: bool = False,
    create_pr: bool = False,
    commit_message: str | None = None,
    part: tuple[int, int] | None = None,
    finalize: bool = False,
) -> StreamResult:
    """Convert the Hub repo `repo_id` into the Hub repo `dest` shard by shard (see the module docstring).

    With `part` (K, N): only the K-th of N shares of the output shards (balanced by bytes, the same in
    every part), no final commit. `finalize`: nothing converted; every output shard must be on the pull
    request already, and the final commit is made."""
    remote = open_remote(repo_id, options.revision, token)
    work = Path(tempfile.mkdtemp(prefix="fp8fix-stream-"))
    try:
        return _stream(
            remote, dest, options, registry, work, max_disk, private, create_pr, commit_message, part, finalize
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stream(
    remote: RemoteRepo,
    dest: str,
    options: ConvertOptions,
    registry: Registry,
    work: Path,
    max_disk: int | None,
    private: bool,
    create_pr: bool,
    commit_message: str | None,
    part: tuple[int, int] | None,
    finalize: bool,
) -> StreamResult:
    source = work / "source"
    source.mkdir()
    headers = mirror(remote, source)
    ckpt = open_checkpoint(source)
    ckpt.has_data = False  # headers only: which tensors are scales, before their values are there
    fill_values(remote, source, _scales(describe_checkpoint(ckpt, registry)))
    ckpt = open_checkpoint(source)
    model = describe_checkpoint(ckpt, registry)
    if options.to == "e4m3fn" and any(w.tensor.dtype == E4M3FNUZ for w in model.module_weights()):
        raise UsageError(
            "--to e4m3fn from e4m3fnuz depends on every code of every weight (whether code 0x7F occurs), which a "
            "streamed conversion plans without: give an OUTPUT folder"
        )
    plan = plan_for_target(
        model, options.layout, options.to, options.target, options.output_format, options.tp, options.tp_bf16
    )
    edits = [edit for _, file_edits in plan.config_files.values() for edit in file_edits]
    result = ConvertResult(plan, Path(dest), written=False, config_edits=edits)
    result.copied_files = ckpt.copied_files(plan.config_files)
    result.warnings += ckpt.warnings
    sizes = {source / name: size for name, size in remote.files.items()}
    needs = [(shard, sorted(shard_inputs(shard))) for shard in plan.shards]
    base = _disk_bytes(work)  # held throughout: the stand-ins (headers, scales) and the small files
    bound = _bound(max_disk, needs, sizes, base)
    streamed = StreamResult(result, max_disk=bound)
    name = remote.repo_id + (f"@{options.revision}" if options.revision else "")
    fingerprint = _fingerprint(remote, options, plan)
    title = f"{commit_message or commit_title(name, options.describe(plan))} [fp8fix {fingerprint}]"
    hub = _PullRequest(dest, title, fingerprint, remote.token, private)
    stats = WriteStats()
    todo = []
    for i, (shard, inputs) in enumerate(needs):
        record = hub.records.get(shard.name)
        if record is None:
            todo.append((i, shard, inputs))
        else:
            stats.merge(_stats_from_json(record["stats"]))
            streamed.skipped.append(shard.name)
    owners = parts_of(plan.shards, part[1]) if part else {}
    if part is not None:
        todo = [t for t in todo if owners[t[1].name] == part[0]]
    if finalize and todo:
        raise UsageError(
            f"--finalize: {len(todo)} output shards are not on the pull request yet ({todo[0][1].name}...): run every "
            "--part K/N (again), or the command without --part or --finalize, which converts what is missing"
        )
    streamed.part = part
    out = work / "output"
    out.mkdir()
    with progress_bar(plan.total_bytes, "fp8fix convert", options.quiet) as bar:
        bar.update(sum(shard.nbytes for shard, _ in needs if shard.name in hub.records))
        loop = _ShardLoop(todo, sizes, bound, lambda name: fetch(remote, source, name, headers), source)
        loop.base = base
        for shard, path in loop.run(out):
            shard_stats = write_shard(plan, shard, path, bar)
            stats.merge(shard_stats)
            loop.upload(shard.name, path, partial(hub.commit_shard, shard, path, shard_stats))
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
    streamed.url = hub.finish(final, merge=not create_pr)
    result.written = True
    return streamed


class _ShardLoop:
    """Output shards one after another, with the next one's source shards downloading while this one is
    written and the last one uploading: whatever the disk bound allows, the three overlap.

    The working folder's bytes are counted here, in the one thread that decides: source shards from the
    moment their download starts, an output shard from the moment it is about to be written until its
    upload is collected. A download starts only when it fits beside all that; when the next shard's
    inputs do not fit, the loop waits for the upload, then releases source shards kept for later ones
    (the latest needed first): the bound holds at every moment, whatever finishes first."""

    def __init__(
        self,
        todo: list[tuple[int, OutputShard, list[Path]]],
        sizes: dict[Path, int],
        bound: int,
        download: Callable[[str], None],
        source: Path,
    ) -> None:
        self.todo, self.sizes, self.bound, self.download, self.source = todo, sizes, bound, download, source
        self.last_use = {path: i for i, _, inputs in todo for path in inputs}
        self.sources: dict[Path, int] = {}  # source shards on disk or downloading
        self.outputs: dict[str, int] = {}  # output shards being written or uploaded
        self.prefetch: dict[int, Background] = {}
        self.uploading: tuple[str, Background] | None = None
        self.base = 0  # bytes the working folder holds throughout
        self.peak = 0

    def run(self, out: Path) -> Iterator[tuple[OutputShard, Path]]:
        """(shard, where to write it) once its source shards are on disk; the caller writes it, then
        calls `upload`."""
        for k, (i, shard, inputs) in enumerate(self.todo):
            size = shard_file_bytes(shard)
            if k not in self.prefetch:
                self._make_room(inputs, size)
                self._start(k)
            self.prefetch.pop(k).result()
            self.outputs[shard.name] = size
            self._note()
            self._prefetch(k + 1)
            yield shard, out / shard.name
            for path in [p for p in self.sources if self.last_use[p] <= i]:
                path.unlink(missing_ok=True)
                del self.sources[path]
            self._prefetch(k + 1)
        self._collect_upload()

    def upload(self, name: str, path: Path, commit: Callable[[], None]) -> None:
        """Upload the shard just written (`commit`, then delete it) in the background, once the previous
        one is up."""
        self._collect_upload()

        def send() -> None:
            commit()
            path.unlink()

        self.uploading = (name, Background(send))

    def _collect_upload(self) -> None:
        if self.uploading is not None:
            name, task = self.uploading
            task.result()
            del self.outputs[name]
            self.uploading = None

    def _fits(self, inputs: list[Path], extra: int) -> bool:
        new = sum(self.sizes[p] for p in inputs if p not in self.sources)
        return self._used() + new + extra <= self.bound

    def _make_room(self, inputs: list[Path], size: int) -> None:
        if not self._fits(inputs, size):
            self._collect_upload()
        for path in sorted(self.sources, key=lambda p: self.last_use[p], reverse=True):
            if self._fits(inputs, size):
                return
            if path not in inputs:
                path.unlink(missing_ok=True)
                del self.sources[path]

    def _prefetch(self, k: int) -> None:
        if k < len(self.todo) and k not in self.prefetch and self._fits(self.todo[k][2], 0):
            self._start(k)

    def _start(self, k: int) -> None:
        missing = [p for p in self.todo[k][2] if p not in self.sources]
        for path in missing:
            self.sources[path] = self.sizes[path]
        self._note()
        names = [p.relative_to(self.source).as_posix() for p in missing]
        self.prefetch[k] = Background(lambda: [self.download(name) for name in names])

    def _used(self) -> int:
        return self.base + sum(self.sources.values()) + sum(self.outputs.values())

    def _note(self) -> None:
        self.peak = max(self.peak, self._used())


def _disk_bytes(folder: Path) -> int:
    """Bytes the files under `folder` take on disk (a sparse stand-in: what it holds)."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


class Background:
    """`work()` in a daemon thread (an interrupted run does not wait for a download to end); `result()`
    waits for it and raises what it raised."""

    def __init__(self, work: Callable[[], object]) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as e:  # handed to result(), in the thread that decides
                self._error = e

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


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
    """Every weight's scale and input scale, and the KV-cache scales: all a plan reads of the data."""
    found = {s.name: s for w in model.weights.values() for s in (w.scale, w.input_scale) if s is not None}
    found.update((s.name, s) for s in model.kv_cache_scales)
    return list(found.values())


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


class _PullRequest:
    """The pull request on `dest` a streamed conversion commits to: found by title or opened by the
    first commit; its shard records read once at the start."""

    def __init__(self, dest: str, title: str, fingerprint: str, token: str | None, private: bool) -> None:
        from huggingface_hub import HfApi

        self.dest, self.title, self.fingerprint, self.token = dest, title, fingerprint, token
        self.api = HfApi(token=token)
        self.num: int | None = None
        self.url = ""
        self.records: dict[str, dict[str, Any]] = {}
        with hub_errors(dest, action="write"):
            bounded_session(write=True)
            retried(self.api.create_repo, dest, private=private or None, exist_ok=True)
            pr = self._find()
            if pr is not None:
                self.num, self.url = pr.num, str(pr.url)
                self.records = self._read_records()

    def _find(self) -> Any:
        """The open pull request of this plan: the lowest-numbered one of its title (parts that opened one at
        the same moment all settle on it), or None."""
        discussions = retried(
            lambda: list(
                self.api.get_repo_discussions(self.dest, discussion_type="pull_request", discussion_status="open")
            )
        )
        mine = [d for d in discussions if d.title == self.title and d.status == "open"]
        return min(mine, key=lambda d: d.num, default=None)

    def open(self) -> None:
        """Open the pull request unless it is open: one with no commits, then the lowest-numbered of its
        title is the one (another part may have opened one meanwhile: the extra one is closed)."""
        if self.num is not None:
            return
        with hub_errors(self.dest, action="write"):
            created = retried(self.api.create_pull_request, self.dest, self.title, description=PR_DESCRIPTION)
            pr = self._find()
            self.num, self.url = pr.num, str(pr.url)
            if created.num != pr.num:
                retried(
                    self.api.change_discussion_status,
                    self.dest,
                    created.num,
                    "closed",
                    comment=f"Duplicate of #{pr.num}",
                )

    @property
    def ref(self) -> str | None:
        return f"refs/pr/{self.num}" if self.num is not None else None

    def _read_records(self) -> dict[str, dict[str, Any]]:
        """Records of shards this pull request holds as recorded (same fingerprint, same sha256)."""
        from huggingface_hub.hf_api import RepoFile

        entries = retried(lambda: list(self.api.list_repo_tree(self.dest, revision=self.ref, recursive=True)))
        files = {e.path: e for e in entries if isinstance(e, RepoFile)}
        repo = RemoteRepo(self.dest, self.ref or "main", {p: e.size for p, e in files.items()}, self.token)
        records = {}
        for path in files:
            if not path.startswith(RECORDS + "/") or files[path].size > 1 << 20:
                continue
            try:
                record = json.loads(repo.read_range(path, 0, files[path].size))
                shard = files.get(record["shard"])
                lfs = getattr(shard, "lfs", None)
                _stats_from_json(record["stats"])  # readable, or the shard is made again
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a record this version wrote: its shard is made again
            if record.get("fingerprint") == self.fingerprint and lfs is not None and lfs.sha256 == record["sha256"]:
                records[record["shard"]] = record
        return records

    def commit_shard(self, shard: OutputShard, path: Path, stats: WriteStats) -> None:
        """The shard and its record, in one commit (the first opens the pull request)."""
        from huggingface_hub import CommitOperationAdd

        record = {
            "fingerprint": self.fingerprint,
            "shard": shard.name,
            "size": path.stat().st_size,
            "sha256": _sha256(path),
            "stats": _stats_to_json(stats),
        }
        operations = [
            CommitOperationAdd(path_in_repo=shard.name, path_or_fileobj=path),
            CommitOperationAdd(f"{RECORDS}/{shard.name}.json", json.dumps(record).encode()),
        ]
        self._commit(operations, shard.name)

    def _commit(self, operations: list[Any], message: str) -> None:
        self.open()
        with hub_errors(self.dest, action="write"):
            retried(self.api.create_commit, self.dest, operations, commit_message=message, revision=self.ref)

    def finish(self, folder: Path, merge: bool) -> str:
        """Index, config files, copies and card in one commit that removes the records; then merged."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        operations: list[Any] = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=folder / f) for f in files]
        operations.append(CommitOperationDelete(path_in_repo=f"{RECORDS}/", is_folder=True))
        self._commit(operations, "config, index and model card")
        if merge:
            assert self.num is not None
            with hub_errors(self.dest, action="write"):
                retried(self.api.merge_pull_request, self.dest, self.num)
            return f"{self.api.endpoint}/{self.dest}"
        return self.url


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _stats_to_json(stats: WriteStats) -> dict[str, Any]:
    return {
        "requantized": {k: [v.max_abs, v.max_steps] for k, v in stats.requantized.items()},
        "dequantized": {k: [v.max_abs, v.max_steps] for k, v in stats.dequantized.items()},
        "inexact_codes": stats.inexact_codes,
    }


def _stats_from_json(data: dict[str, Any]) -> WriteStats:
    return WriteStats(
        requantized={k: RoundingStats(*v) for k, v in data["requantized"].items()},
        dequantized={k: RoundingStats(*v) for k, v in data["dequantized"].items()},
        inexact_codes=int(data["inexact_codes"]),
    )

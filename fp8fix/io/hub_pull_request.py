"""The pull request a streamed conversion commits to, shard by shard, with a record of each shard.

A record (a small JSON file under RECORDS) names the plan's fingerprint, the shard's sha256 and what
writing it revealed (requantization errors): a rerun, another part or `--finalize` trusts a shard the
pull request holds only when its record matches, and the model card is the one a single run writes.
The last commit removes the records; the pull request is then merged, or left open for review.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fp8fix.io.hub import bounded_session, hub_errors, retried
from fp8fix.io.remote_source import RemoteRepo
from fp8fix.io.writer import WriteStats
from fp8fix.numerics.nvfp4_shared import SharedStats
from fp8fix.numerics.requantize import RoundingStats
from fp8fix.plan.pieces import OutputShard

#: Where the records of committed shards live on the pull request until the last commit removes them.
RECORDS = ".fp8fix-stream"
#: The pull request's description: what it is while the conversion runs.
PR_DESCRIPTION = (
    "Converted by fp8fix, shard by shard: each output shard is committed here as it is made; the index, "
    "config.json and model card come last, and the pull request is then merged (or left for review)."
)


class StreamPullRequest:
    """The pull request on `dest` a streamed conversion commits to: found by title or opened by the
    first commit; its shard records read once at the start."""

    def __init__(
        self, dest: str, title: str, fingerprint: str, token: str | None, private: bool, description: str | None = None
    ) -> None:
        from huggingface_hub import HfApi

        self.dest, self.title, self.fingerprint, self.token = dest, title, fingerprint, token
        self.description = description  # the user's, for the pull request and the final commit
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
            text = PR_DESCRIPTION + (f"\n\n{self.description}" if self.description else "")
            created = retried(self.api.create_pull_request, self.dest, self.title, description=text)
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
                stats_from_json(record["stats"])  # readable, or the shard is made again
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a record this version wrote: its shard is made again
            if record.get("fingerprint") == self.fingerprint and lfs is not None and lfs.sha256 == record["sha256"]:
                records[record["shard"]] = record
        return records

    def send_shard(self, shard: OutputShard, path: Path, stats: WriteStats) -> list[Any]:
        """The shard's bytes to the Hub's LFS storage (the first opens the pull request); nothing is
        committed yet, and the file may be deleted. Returns the commit's operations: the shard and its record."""
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
        self.open()
        with hub_errors(self.dest, action="write"):
            retried(self.api.preupload_lfs_files, self.dest, operations, revision=self.ref)
        return operations

    def commit_shard(self, operations: list[Any]) -> None:
        """One commit of what `send_shard` sent: the shard appears on the pull request with its record."""
        self._commit(operations, operations[0].path_in_repo)

    def _commit(self, operations: list[Any], message: str, description: str | None = None) -> None:
        self.open()
        with hub_errors(self.dest, action="write"):
            retried(
                self.api.create_commit,
                self.dest,
                operations,
                commit_message=message,
                commit_description=description,
                revision=self.ref,
            )

    def finish(self, folder: Path, merge: bool) -> str:
        """Index, config files, copies and card in one commit that removes the records; then merged."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        operations: list[Any] = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=folder / f) for f in files]
        operations.append(CommitOperationDelete(path_in_repo=f"{RECORDS}/", is_folder=True))
        self._commit(operations, "config, index and model card", self.description)
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
        "shared": {k: [v.groups, v.groups_exact, v.max_abs, v.max_steps] for k, v in stats.shared.items()},
    }


def stats_from_json(data: dict[str, Any]) -> WriteStats:
    return WriteStats(
        requantized={k: RoundingStats(*v) for k, v in data["requantized"].items()},
        dequantized={k: RoundingStats(*v) for k, v in data["dequantized"].items()},
        inexact_codes=int(data["inexact_codes"]),
        shared={k: SharedStats(*v) for k, v in data.get("shared", {}).items()},  # (records before it: none)
    )

"""A tiny stand-in for the Hub's HTTP API, on 127.0.0.1, for testing the real HfApi client.

Implements just what `create_repo`, `repo_info`, `list_repo_tree`, `get_repo_discussions`,
`preupload`, `commit` and `merge_pull_request` call, and records every commit with its files.
`*.safetensors` go through the LFS protocol (the batch API, then a PUT of the bytes, counted in
`uploads`; the client needs HF_HUB_DISABLE_XET=1), other files inline. Served repos' files
(`files`) answer HEAD and ranged GETs without reading more than asked. It can be told to fail
with a status code, once for the next N requests (`fail_next`), or to answer slowly.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub's tree API, as `oid`) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(name: str, data: bytes | Path) -> dict[str, Any]:
    """A tree entry as the Hub lists it: LFS files (stored on disk, as `Path`) with their sha256."""
    if isinstance(data, Path):
        return {**_served_entry(data), "path": name}
    entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
    if name.endswith(".safetensors"):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _sha256_of(data: bytes | Path) -> str:
    return str(_served_entry(data)["lfs"]["oid"]) if isinstance(data, Path) else hashlib.sha256(data).hexdigest()


_SERVED: dict[tuple[Path, int, int], dict[str, Any]] = {}


def _served_entry(path: Path) -> dict[str, Any]:
    """`_entry` of a served file, hashed in pieces and once per (size, mtime): shards may be gigabytes."""
    stat = path.stat()
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _SERVED:
        blob, sha = hashlib.sha1(b"blob %d\0" % stat.st_size), hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                blob.update(chunk)
                sha.update(chunk)
        entry: dict[str, Any] = {"type": "file", "path": path.name, "size": stat.st_size, "oid": blob.hexdigest()}
        if path.name.endswith(".safetensors") or path.parent.name == "lfs-store":
            entry["lfs"] = {"oid": sha.hexdigest(), "size": stat.st_size, "pointerSize": 134}
        _SERVED[key] = entry
    return _SERVED[key]


@dataclass
class Commit:
    repo_id: str
    revision: str
    summary: str
    description: str
    create_pr: bool
    files: dict[str, bytes | Path]  # an LFS file of 64 MiB or more as its file in the store


@dataclass
class FakeHub:
    commits: list[Commit] = field(default_factory=list)
    repos: dict[str, dict[str, Any]] = field(default_factory=dict)  # repo id -> {"private", "sha"}
    pull_requests: list[dict[str, Any]] = field(default_factory=list)
    merges: list[tuple[str, int]] = field(default_factory=list)  # (repo, pull request) merged
    branches: list[tuple[str, str]] = field(default_factory=list)  # (repo, branch) created
    requests: list[str] = field(default_factory=list)
    fail_with: int | str | None = None  # answer every request with this status, or "gated"
    authorization: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)  # repo id -> folder served by /{repo}/resolve/...
    trees: dict[tuple[str, str], dict[str, bytes | Path]] = field(default_factory=dict)  # (repo, revision) -> files
    fail_commit_after: int | None = None  # answer HTTP 500 to commits once this many have landed
    fail_next: list[int] = field(default_factory=list)  # statuses for the next requests, one each (429, 500...)
    fail_path: str = ""  # ...of those whose path starts with this
    delay: float = 0.0  # seconds to wait before answering each request (a slow link)
    #: Called with (method, path, Range header) before each request is answered; True drops the request
    #: unanswered (the kill tests stop the client there).
    hook: Callable[[str, str, str], bool] | None = None
    lfs: dict[str, Path] = field(default_factory=dict)  # sha256 -> its file in `store`, uploaded through LFS
    store: Path = Path()  # where LFS uploads go: a temporary folder of the server's
    uploads: list[str] = field(default_factory=list)  # sha256 of every LFS upload (PUT), in order
    reads: list[tuple[str, str]] = field(default_factory=list)  # (repo/path, Range header or "") of each file GET
    url: str = ""

    def open_pull_request(self, repo: str, title: str, description: str | None, base: str = "main") -> dict[str, Any]:
        """A new open pull request on `repo`, as the discussions API lists it."""
        entry = {
            "num": len(self.pull_requests) + 1,
            "title": title,
            "status": "open",
            "isPullRequest": True,
            "author": {"name": "me"},
            "createdAt": "2026-11-29T00:00:00.000Z",
            "repo": {"name": repo, "type": "model"},
        }
        self.pull_requests.append({"repo": repo, "entry": entry, "description": description, "base": base})
        return entry

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status >= 400:
                    self.send_header("X-Error-Message", body.get("error", "error"))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_GET(self) -> None:
                self._route("GET")

            def do_HEAD(self) -> None:
                self._route("HEAD")

            def do_POST(self) -> None:
                self._route("POST")

            def do_PUT(self) -> None:
                self._route("PUT")

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                hub.requests.append(f"{method} {url.path}")
                if not url.path.startswith("/lfs-upload/"):  # presigned upload URLs carry no token
                    hub.authorization.append(self.headers.get("Authorization", ""))
                upload = method == "PUT" and url.path.startswith("/lfs-upload/")
                body = self._body() if method in ("POST", "PUT") and not upload else b""
                parts = url.path.strip("/").split("/")
                if hub.delay:
                    time.sleep(hub.delay)
                if hub.hook is not None and hub.hook(method, url.path, self.headers.get("Range", "")):
                    self.close_connection = True
                    return
                if hub.fail_next and url.path.startswith(hub.fail_path):
                    status = hub.fail_next.pop(0)
                    return self._send(status, {"error": f"injected {status}"})
                if upload:
                    return self._store(parts[1])
                if len(parts) == 6 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
                    return self._lfs_batch(json.loads(body))
                if len(parts) > 4 and parts[2] == "resolve" and not hub.fail_with:
                    repo, revision = f"{parts[0]}/{parts[1]}", unquote(parts[3])
                    return self._resolve(method, repo, revision, unquote("/".join(parts[4:])))
                if hub.fail_with:
                    if hub.fail_with in (404, "gated"):
                        self.send_response(404 if hub.fail_with == 404 else 403)
                        self.send_header("X-Error-Code", "RepoNotFound" if hub.fail_with == 404 else "GatedRepo")
                        self.send_header("Content-Length", "2")
                        self.end_headers()
                        self.wfile.write(b"{}")
                        return
                    return self._send(hub.fail_with, {"error": "denied"})
                if url.path == "/api/repos/create":
                    data = json.loads(body)
                    repo = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                    # huggingface_hub >= 1.x sends visibility, 1.0 the older boolean `private`: the Hub takes both
                    private = data.get("visibility") == "private" or data.get("private") is True
                    hub.repos.setdefault(repo, {"private": private, "sha": "0" * 40})
                    return self._send(200, {"url": f"{hub.url}/{repo}", "name": repo})
                if url.path == "/api/validate-yaml":  # the client checks a model card's metadata first
                    return self._send(200, {"errors": [], "warnings": []})
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = f"{parts[2]}/{parts[3]}"
                    rest = parts[4:]
                    if not rest or rest[0] == "revision":
                        folder = hub.files.get(repo)
                        siblings = [{"rfilename": p.name} for p in sorted(folder.iterdir())] if folder else []
                        sha = hub.repos.get(repo, {}).get("sha") or ("f" * 40 if folder else None)
                        return self._send(200, {"id": repo, "sha": sha, "siblings": siblings})
                    if rest[0] == "tree":  # snapshot_download lists the files first; a push, what is there
                        folder = hub.files.get(repo)
                        if folder:
                            return self._send(200, [_served_entry(p) for p in sorted(folder.iterdir())])
                        revision = unquote(rest[1]) if len(rest) > 1 else "main"
                        content = {**hub.trees.get((repo, "main"), {}), **hub.trees.get((repo, revision), {})}
                        return self._send(200, [_entry(name, data) for name, data in sorted(content.items())])
                    if rest[0] == "discussions" and len(rest) == 3 and rest[2] == "status" and method == "POST":
                        pr = next(
                            p for p in hub.pull_requests if p["repo"] == repo and p["entry"]["num"] == int(rest[1])
                        )
                        pr["entry"]["status"] = json.loads(body)["status"]
                        event = {
                            "id": f"status-{rest[1]}",
                            "type": "status-change",
                            "createdAt": "2026-11-29T00:00:00.000Z",
                            "author": {"name": "me"},
                            "data": {"status": pr["entry"]["status"]},
                        }
                        return self._send(200, {"newStatus": event})
                    if rest[0] == "discussions" and len(rest) == 3 and rest[2] == "merge" and method == "POST":
                        pr = next(
                            p for p in hub.pull_requests if p["repo"] == repo and p["entry"]["num"] == int(rest[1])
                        )
                        merged = hub.trees.get((repo, f"refs/pr/{rest[1]}"), {})
                        hub.trees.setdefault((repo, "main"), {}).update(merged)
                        pr["entry"]["status"] = "merged"
                        hub.merges.append((repo, int(rest[1])))
                        return self._send(200, {})
                    if rest[0] == "discussions" and method == "POST":  # a pull request opened on its own
                        data = json.loads(body)
                        entry = hub.open_pull_request(repo, data.get("title", ""), data.get("description"))
                        return self._send(200, {**entry, "url": f"{hub.url}/{repo}/discussions/{entry['num']}"})
                    if rest[0] == "discussions" and len(rest) == 2:
                        pr = next(
                            p for p in hub.pull_requests if p["repo"] == repo and p["entry"]["num"] == int(rest[1])
                        )
                        details = {"events": [], "changes": {"base": "refs/heads/main"}, "filesWithConflicts": []}
                        return self._send(200, {**pr["entry"], **details})
                    if rest[0] == "discussions":
                        wanted = re.search(r"status=(\w+)", url.query or "")
                        prs = [
                            p
                            for p in hub.pull_requests
                            if p["repo"] == repo and (not wanted or wanted.group(1) in ("all", p["entry"]["status"]))
                        ]
                        return self._send(
                            200,
                            {
                                "discussions": [p["entry"] for p in prs],
                                "count": len(prs),
                                "start": 0,
                                "numClosedDiscussions": 0,
                            },
                        )
                    if rest[0] == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(
                            200,
                            {
                                "files": [
                                    {
                                        "path": f["path"],
                                        "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                                        "shouldIgnore": False,
                                    }
                                    for f in files
                                ],
                                "commitOid": hub.repos.get(repo, {}).get("sha"),
                            },
                        )
                    if rest[0] == "branch" and method == "POST":  # create_branch: from main
                        branch = unquote("/".join(rest[1:]))
                        if (repo, branch) in hub.trees:
                            return self._send(409, {"error": "Reference already exists"})
                        hub.trees[(repo, branch)] = dict(hub.trees.get((repo, "main"), {}))
                        hub.branches.append((repo, branch))
                        return self._send(200, {})
                    if rest[0] == "commit":
                        create_pr = "create_pr=1" in (url.query or "")
                        return self._commit(repo, unquote("/".join(rest[1:])), body, create_pr)
                self._send(404, {"error": f"not implemented: {method} {url.path}"})

            def _resolve(self, method: str, repo: str, revision: str, name: str) -> None:
                """A file of a served repo: HEAD for metadata, GET with an optional Range (header reads),
                streamed from disk in pieces (a 2 GB shard is never held in memory)."""
                if method == "GET":
                    hub.reads.append((f"{repo}/{name}", self.headers.get("Range", "")))
                if repo not in hub.files:  # a file committed to the repo
                    data = hub.tree(repo, revision).get(name)
                    if data is not None:
                        return self._send_bytes(method, data)
                path = hub.files.get(repo, Path("/nonexistent")) / name
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._send_file(method, path)

            def _send_file(self, method: str, path: Path) -> None:
                """`path`, or the Range asked for, streamed from disk in pieces."""
                size = path.stat().st_size
                status, first, last = 200, 0, size - 1
                ranged = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if ranged:
                    first = int(ranged.group(1))
                    last = min(int(ranged.group(2)), size - 1) if ranged.group(2) else size - 1
                    status = 206
                self.send_response(status)
                self.send_header("Content-Length", str(last + 1 - first))
                self.send_header("ETag", f'"{_served_entry(path)["oid"]}"')
                self.send_header("X-Repo-Commit", "f" * 40)
                self.end_headers()
                if method == "GET":
                    with open(path, "rb") as f:
                        f.seek(first)
                        left = last + 1 - first
                        while left > 0:
                            chunk = f.read(min(left, 1 << 20))
                            if not chunk:
                                break
                            self.wfile.write(chunk)
                            left -= len(chunk)

            def _send_bytes(self, method: str, data: bytes | Path) -> None:
                if isinstance(data, Path):  # an LFS object of the store
                    return self._send_file(method, data)
                ranged = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                status = 200
                if ranged:
                    last = int(ranged.group(2)) if ranged.group(2) else len(data) - 1
                    data, status = data[int(ranged.group(1)) : last + 1], 206
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{git_blob_id(data)}"')
                self.end_headers()
                if method == "GET":
                    self.wfile.write(data)

            def _store(self, oid: str) -> None:
                """An LFS upload, streamed to a file of the store (checked against its oid), never held whole."""
                left = int(self.headers.get("Content-Length") or 0)
                part = hub.store / f"{oid}.{threading.get_ident()}.part"
                digest = hashlib.sha256()
                with open(part, "wb") as f:
                    while left > 0:
                        chunk = self.rfile.read(min(left, 1 << 20))
                        if not chunk:
                            break
                        digest.update(chunk)
                        f.write(chunk)
                        left -= len(chunk)
                if digest.hexdigest() != oid or left:
                    part.unlink()
                    return self._send(400, {"error": "content does not match its oid"})
                part.replace(hub.store / oid)
                hub.lfs[oid] = hub.store / oid
                hub.uploads.append(oid)
                self._send(200, {})

            def _lfs_batch(self, request: dict[str, Any]) -> None:
                """Upload actions for the objects the store lacks; none for those it holds (not sent again)."""
                objects = []
                for obj in request["objects"]:
                    entry = {"oid": obj["oid"], "size": obj["size"]}
                    if obj["oid"] not in hub.lfs:
                        entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"}}
                    objects.append(entry)
                self._send(200, {"transfer": "basic", "objects": objects})

            def _commit(self, repo: str, revision: str, body: bytes, open_pr: bool = False) -> None:
                """A commit to `revision`; with `open_pr` (the client's create_pr=1) a pull request opened
                with it, titled by the commit, its commit on refs/pr/N."""
                if hub.fail_commit_after is not None and len(hub.commits) >= hub.fail_commit_after:
                    return self._send(500, {"error": "interrupted"})
                header: dict[str, Any] = {}
                files: dict[str, bytes | Path] = {}
                deleted: list[str] = []
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        header = item["value"]
                    elif item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    elif item["key"] in ("deletedFile", "deletedFolder"):
                        deleted.append(item["value"]["path"])
                    elif item["key"] == "lfsFile":
                        if item["value"]["oid"] not in hub.lfs:
                            return self._send(422, {"error": f"LFS object {item['value']['oid']} was never uploaded"})
                        files[item["value"]["path"]] = hub.lfs[item["value"]["oid"]]
                pr_url = None
                if open_pr:
                    summary, description = header.get("summary", ""), header.get("description")
                    num = hub.open_pull_request(repo, summary, description, base=revision)["num"]
                    revision, pr_url = f"refs/pr/{num}", f"{hub.url}/{repo}/discussions/{num}"
                create_pr = revision.startswith("refs/pr/")
                tree = hub.trees.setdefault((repo, revision), {})
                for gone in deleted:  # a file, or a folder as "path/"
                    for name in [n for n in tree if n == gone or n.startswith(gone.rstrip("/") + "/")]:
                        del tree[name]
                tree.update(files)
                hub.commits.append(
                    Commit(
                        repo,
                        revision,
                        header.get("summary", ""),
                        header.get("description", ""),
                        create_pr,
                        {
                            k: v.read_bytes() if isinstance(v, Path) and v.stat().st_size < 1 << 26 else v
                            for k, v in files.items()
                        },
                    )
                )
                oid = f"{len(hub.commits):040x}"
                answer: dict[str, Any] = {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid}
                if pr_url:
                    answer["pullRequestUrl"] = pr_url
                if not create_pr:
                    hub.repos.setdefault(repo, {})["sha"] = oid
                self._send(200, answer)

        self.store = Path(tempfile.mkdtemp(prefix="hub-")) / "lfs-store"
        self.store.mkdir()
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def tree(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        """The files committed to `revision` of `repo` (a pull request's on top of main), read whole."""
        return {
            name: data.read_bytes() if isinstance(data, Path) else data
            for name, data in self._files(repo, revision).items()
        }

    def digests(self, repo: str, revision: str = "main") -> dict[str, str]:
        """sha256 of each file of `tree`, hashed in pieces (for checkpoints of gigabytes)."""
        return {name: _sha256_of(data) for name, data in self._files(repo, revision).items()}

    def _files(self, repo: str, revision: str) -> dict[str, bytes | Path]:
        base = self.trees.get((repo, "main"), {})
        return {**base, **self.trees.get((repo, revision), {})} if revision != "main" else dict(base)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        shutil.rmtree(self.store.parent, ignore_errors=True)

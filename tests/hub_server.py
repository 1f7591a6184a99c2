"""A tiny stand-in for the Hub's HTTP API, on 127.0.0.1, for testing the real HfApi client.

Implements just what `create_repo`, `repo_info`, `get_repo_discussions`, `preupload`
(answering `regular` upload mode, so files arrive inline) and `commit` call, and
records every commit with its files. It can also be told to fail with a status code.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub's tree API, as `oid`) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    repo_id: str
    revision: str
    summary: str
    description: str
    create_pr: bool
    files: dict[str, bytes]


@dataclass
class FakeHub:
    commits: list[Commit] = field(default_factory=list)
    repos: dict[str, dict[str, Any]] = field(default_factory=dict)  # repo id -> {"private", "sha"}
    pull_requests: list[dict[str, Any]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    fail_with: int | str | None = None  # answer every request with this status, or "gated"
    authorization: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)  # repo id -> folder served by /{repo}/resolve/...
    trees: dict[tuple[str, str], dict[str, bytes]] = field(default_factory=dict)  # (repo, revision) -> committed
    fail_commit_after: int | None = None  # answer HTTP 500 to commits once this many have landed
    url: str = ""

    def open_pull_request(self, repo: str, title: str, description: str | None) -> dict[str, Any]:
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
        self.pull_requests.append({"repo": repo, "entry": entry, "description": description})
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

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                hub.requests.append(f"{method} {url.path}")
                hub.authorization.append(self.headers.get("Authorization", ""))
                body = self._body() if method == "POST" else b""
                parts = url.path.strip("/").split("/")
                if len(parts) > 4 and parts[2] == "resolve" and not hub.fail_with:
                    return self._resolve(method, f"{parts[0]}/{parts[1]}", "/".join(parts[4:]))
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
                    hub.repos.setdefault(repo, {"private": data.get("visibility") == "private", "sha": "0" * 40})
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
                            content = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
                        else:
                            revision = unquote(rest[1]) if len(rest) > 1 else "main"
                            content = {**hub.trees.get((repo, "main"), {}), **hub.trees.get((repo, revision), {})}
                        entries = [
                            {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
                            for name, data in sorted(content.items())
                        ]
                        return self._send(200, entries)
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
                        prs = [p for p in hub.pull_requests if p["repo"] == repo]
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
                                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                                ],
                                "commitOid": hub.repos.get(repo, {}).get("sha"),
                            },
                        )
                    if rest[0] == "commit":
                        create_pr = "create_pr=1" in (url.query or "")
                        return self._commit(repo, unquote("/".join(rest[1:])), body, create_pr)
                self._send(404, {"error": f"not implemented: {method} {url.path}"})

            def _resolve(self, method: str, repo: str, name: str) -> None:
                """A file of a served repo: HEAD for metadata, GET with an optional Range (header reads)."""
                path = hub.files.get(repo, Path("/nonexistent")) / name
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                status, first = 200, 0
                ranged = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if ranged:
                    first = int(ranged.group(1))
                    last = int(ranged.group(2)) if ranged.group(2) else len(data) - 1
                    data, status = data[first : last + 1], 206
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{hashlib.sha1(path.read_bytes()).hexdigest()}"')
                self.send_header("X-Repo-Commit", "f" * 40)
                self.end_headers()
                if method == "GET":
                    self.wfile.write(data)

            def _commit(self, repo: str, revision: str, body: bytes, open_pr: bool = False) -> None:
                """A commit to `revision`; with `open_pr` (the client's create_pr=1) a pull request opened
                with it, titled by the commit, its commit on refs/pr/N."""
                if hub.fail_commit_after is not None and len(hub.commits) >= hub.fail_commit_after:
                    return self._send(500, {"error": "interrupted"})
                header: dict[str, Any] = {}
                files: dict[str, bytes] = {}
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        header = item["value"]
                    elif item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                pr_url = None
                if open_pr:
                    num = hub.open_pull_request(repo, header.get("summary", ""), header.get("description"))["num"]
                    revision, pr_url = f"refs/pr/{num}", f"{hub.url}/{repo}/discussions/{num}"
                create_pr = revision.startswith("refs/pr/")
                hub.trees.setdefault((repo, revision), {}).update(files)
                hub.commits.append(
                    Commit(repo, revision, header.get("summary", ""), header.get("description", ""), create_pr, files)
                )
                oid = f"{len(hub.commits):040x}"
                answer: dict[str, Any] = {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid}
                if pr_url:
                    answer["pullRequestUrl"] = pr_url
                if not create_pr:
                    hub.repos.setdefault(repo, {})["sha"] = oid
                self._send(200, answer)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

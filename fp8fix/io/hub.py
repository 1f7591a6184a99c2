"""The Hugging Face Hub: resolving a repo id to a local snapshot, and pushing a converted repo.

Everything goes through huggingface_hub, so HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE,
HF_TOKEN and HF_ENDPOINT mean what they mean everywhere else, and its own progress
bars show. Hub failures become one line and exit code 4; the token never appears.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fp8fix.errors import Fp8fixError, HubError, InvalidCheckpoint, RepoNotReached, UsageError
from fp8fix.io.checkpoint import Checkpoint, checkpoint_from_headers
from fp8fix.io.source_tree import SourceTree

#: `org/name`: what a repo id looks like (a local folder of that spelling always wins).
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

#: What a conversion needs from a model repo: weights, configs, tokenizer, card, license, remote code.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.py",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "*.md",
    "LICENSE*",
    "NOTICE*",
]


def looks_local(source: str) -> bool:
    """True when SOURCE names a local path, which is never sent to the Hub: it exists; it starts like a
    path (`./`, `../`, `/`, `~`); it has no `/` (Hub ids here are `org/name`); its parent folder exists
    (`examples/phi3-tiny-fp9`); or huggingface_hub's `validate_repo_id` refuses it."""
    if source in (".", "..") or source.startswith(("./", "../", "/", "~", ".\\")) or Path(source).exists():
        return True
    if "/" not in source or Path(source).parent.exists() or not REPO_ID.match(source):
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # type: ignore[attr-defined]

    try:
        validate_repo_id(source)
    except HFValidationError:
        return True
    return False


def is_repo_id(source: str) -> bool:
    """`org/name` that is not a local path (see `looks_local`)."""
    return not looks_local(source)


def _scrub(text: str) -> str:
    token = os.environ.get("HF_TOKEN")
    return text.replace(token, "***") if token else text


@contextmanager
def hub_errors(
    repo_id: str, revision: str | None = None, action: str = "read", role: str | None = None
) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one clear line (exit code 4). `role` (SOURCE): the repo id
    is a command's argument, which names no local folder either; a repo not found or not reached says so."""
    try:
        with _hub_errors(repo_id, revision, action):
            yield
    except RepoNotReached as e:
        if role is None or revision:  # with --revision, SOURCE is a Hub repo id (a folder takes none)
            raise
        why = str(e).split(": ", 1)[-1]  # without the repo id the message starts with
        raise RepoNotReached(f"{role} {repo_id}: no such folder (here: {Path.cwd()}); as a Hub repo: {why}") from None


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, action: str) -> Iterator[None]:
    from huggingface_hub import errors

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        yield
    except errors.GatedRepoError:
        raise HubError(
            f"{where}: the repo is gated: accept its terms on the Hub, then log in (hf auth login)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise RepoNotReached(
            f"{where}: repo not found, or private and you are not logged in (hf auth login, or set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{where}: revision not found in the repo") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        cause = e.__cause__  # snapshot_download raises this for any failed call, the Hub's answer as its cause
        if isinstance(cause, Exception) and not isinstance(cause, errors.OfflineModeIsEnabled):
            with _hub_errors(repo_id, revision, action):
                raise cause from None
        if action == "write":
            raise HubError(f"{where}: cannot push: {_why_offline()}") from None
        raise RepoNotReached(f"{where}: not in the local Hub cache, and {_why_offline()}") from None
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise HubError(f"{where}: no permission to {action} this repo (HTTP {status}); check your token") from None
        raise HubError(_scrub(f"{where}: the Hub answered HTTP {status}: {e}").splitlines()[0]) from None
    except OSError as e:  # ConnectionError, TimeoutError and the rest
        raise RepoNotReached(_scrub(f"{where}: network error reaching the Hub: {e}").splitlines()[0]) from None
    except Fp8fixError:
        raise
    except Exception as e:  # httpx errors do not derive from OSError; anything else is an answer we did not expect
        if type(e).__module__.startswith(("httpx", "httpcore")):
            raise RepoNotReached(_scrub(f"{where}: network error reaching the Hub: {e}").splitlines()[0]) from None
        raise HubError(_scrub(f"{where}: unexpected answer from the Hub ({type(e).__name__}: {e})")) from None


def _why_offline() -> str:
    """Why huggingface_hub did not reach the Hub: HF_HUB_OFFLINE, or (it is not set) the network."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return "the Hub could not be reached (a network problem: HF_HUB_OFFLINE is not set)"


#: Seconds to wait for the Hub to accept a connection, and for each answer to a read; a push waits
#: WRITE_FACTOR times longer for answers (the Hub processes a commit before it answers). Reads use
#: HF_HUB_DOWNLOAD_TIMEOUT when it is set, as huggingface_hub's own downloads do.
CONNECT_SECONDS = 10.0
WRITE_FACTOR = 6
#: Tries of a read-only Hub call that timed out, lost its connection, or met a rate limit or a server error
#: (RETRY_STATUSES), with RETRY_WAIT seconds doubling between (or the Retry-After the Hub asks for, up to
#: MAX_RETRY_WAIT).
TRIES = 4
RETRY_WAIT = 1.0
MAX_RETRY_WAIT = 60.0
RETRY_STATUSES = {429, 500, 502, 503, 504}


def bounded_session(write: bool = False) -> None:
    """Bound every request of huggingface_hub's shared HTTP client in time: a request that names no
    timeout (huggingface_hub's API calls pass `timeout=None`, which waits forever: an endpoint that
    accepts connections and never answers hung `convert org/name` and `push`) gets CONNECT_SECONDS to
    connect and HF_HUB_DOWNLOAD_TIMEOUT (x WRITE_FACTOR for a push) for each answer. A request hook,
    so a client the caller configured (proxy, certificates) is kept; a request with its own timeout
    keeps it."""
    from huggingface_hub import constants, get_session

    read = float(constants.HF_HUB_DOWNLOAD_TIMEOUT) * (WRITE_FACTOR if write else 1)
    bounds = {"connect": min(CONNECT_SECONDS, read), "read": read, "write": read, "pool": read}

    def fp8fix_timeouts(request: Any) -> None:
        if all(v is None for v in (request.extensions.get("timeout") or {}).values()):
            request.extensions["timeout"] = bounds

    session = get_session()  # httpx's client (huggingface_hub >= 1.0, the declared floor)
    hooks = {kind: list(found) for kind, found in session.event_hooks.items()}
    kept = [h for h in hooks.get("request", []) if getattr(h, "__name__", "") != fp8fix_timeouts.__name__]
    session.event_hooks = {**hooks, "request": [*kept, fp8fix_timeouts]}


def _network_failure(error: BaseException) -> bool:
    """A timeout or a lost connection (httpx's TimeoutException / NetworkError, or OSError's): worth a retry."""
    names = {c.__name__ for c in type(error).__mro__}
    return bool(names & {"TimeoutException", "NetworkError", "TimeoutError", "ConnectionError"})


def retried(call: Any, *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, a Hub call that is safe to repeat, tried up to TRIES times while it times
    out, loses its connection or is answered 429 / 5xx (the Hub's blips and rate limits); the last failure
    is raised. `push`'s commits are not retried (a rerun resumes the push); a streamed conversion's are,
    each one adding the same files to its own pull request."""
    import time

    for attempt in range(TRIES):
        try:
            return call(*args, **kwargs)
        except Exception as e:
            wait = _retry_wait(e, attempt)
            if attempt == TRIES - 1 or wait is None:
                raise
            time.sleep(wait)
    raise AssertionError("unreachable")


def _retry_wait(error: BaseException, attempt: int) -> float | None:
    """Seconds to wait before trying again after `error`, or None when trying again cannot help."""
    if _network_failure(error):
        return RETRY_WAIT * 2.0**attempt
    response = getattr(error, "response", None)
    if getattr(response, "status_code", None) not in RETRY_STATUSES:
        return None
    asked = str(getattr(response, "headers", {}).get("Retry-After", ""))
    wait = float(asked) if asked.isdigit() else RETRY_WAIT * 2.0**attempt
    return min(wait, MAX_RETRY_WAIT)


def resolve_source(
    source: str, revision: str | None, token: str | None = None, role: str = "SOURCE"
) -> tuple[Path, str | None]:
    """The local folder to read, and the repo id when SOURCE named a Hub repo; `role` names the argument
    in errors."""
    if looks_local(source):
        if revision:
            raise UsageError(f"{role} {source}: --revision applies to Hub repo ids, and this is a local path")
        return local_folder(source, role), None
    from huggingface_hub import snapshot_download

    with hub_errors(source, revision, role=role):
        bounded_session()
        snapshot = retried(snapshot_download, source, revision=revision, allow_patterns=ALLOW_PATTERNS, token=token)
    return inside_cache(Path(snapshot), source, role), source


def inside_cache(snapshot: Path, repo_id: str, role: str = "SOURCE") -> Path:
    """`snapshot`, refused unless it is a folder of the repo's own `snapshots/` in the Hub cache: a ref
    (`refs/main`) or a snapshot link of a hostile cache could name any folder of the machine."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    snapshots = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
    real = Path(os.path.realpath(snapshot))
    if real.parent != Path(os.path.realpath(snapshots)) or not real.is_dir():
        raise InvalidCheckpoint(
            f"{role} {repo_id}: the local Hub cache resolves it to {real}, which is not a snapshot folder of that "
            f"repo in the cache ({snapshots}); a ref or link there points elsewhere. fp8fix reads only inside the "
            "cache: delete the repo's cache folder (hf cache delete) and download it again"
        )
    return real


def source_label(folder: Path, repo_id: str | None, revision: str | None) -> str:
    """SOURCE as OUTPUT's card and commit title name it (and verify expects it): the Hub repo (and revision)
    or the folder's name."""
    return repo_id + (f"@{revision}" if revision else "") if repo_id else folder.resolve().name


def local_folder(source: str | os.PathLike[str], role: str = "SOURCE") -> Path:
    """A local SOURCE (or OUTPUT), which must exist: else a usage error naming it and `role`."""
    folder = Path(source).expanduser()
    if not folder.exists():
        raise UsageError(
            f"{role} {source}: no such folder (a local path; a Hub repo is named org/name, and is "
            "looked up only when no local folder or parent folder of that name exists)"
        )
    return folder


#: Bytes per commit when pushing: a 700 GB checkpoint goes out in commits a rerun can resume between.
COMMIT_BYTES = 20 * 1024**3
#: Pushed in the last commit: until they land, a partly pushed repo does not look like a checkpoint.
LAST_FILES = ("config.json", "model.safetensors.index.json", "README.md")


def upload_batches(files: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Files (path, size) in commits of at most `limit` bytes (a larger file alone), `LAST_FILES`
    together in the last one; one commit when all fit."""
    if sum(n for _, n in files) <= limit:
        return [[path for path, _ in files]] if files else []
    batches: list[list[str]] = []
    size = 0
    for path, n in sorted(f for f in files if f[0] not in LAST_FILES):
        if not batches or size + n > limit:
            batches.append([])
            size = 0
        batches[-1].append(path)
        size += n
    last = sorted(path for path, _ in files if path in LAST_FILES)
    return batches + ([last] if last else [])


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool = False,
    create_pr: bool = False,
    commit_message: str,
    commit_description: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    commit_bytes: int = COMMIT_BYTES,
) -> str:
    """Upload `folder` to `repo_id` (or to one pull request); return the last commit's or the PR's URL.

    Files go out in commits of at most `commit_bytes` (config, index and card last), and files
    the Hub already holds with the same content are skipped: an interrupted push, run again,
    resumes where it stopped. With `create_pr`, an open pull request with the same title (which
    names the parent commit) is continued instead of opening a second one. `revision`: the branch
    the commits go to (made from main when missing, as `hf upload --revision` does), or, with
    `create_pr`, the one the pull request is opened against.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    message = commit_message
    local = {name: folder / name for name in pushed_files(folder)}  # refused before anything is sent
    base = revision
    with hub_errors(repo_id, base, action="write"):
        bounded_session(write=True)
        api.create_repo(repo_id, private=private or None, exist_ok=True)  # None: the owner's default
        if base is not None and not base.startswith("refs/pr/"):
            retried(api.create_branch, repo_id, branch=base, exist_ok=True)
        revision, url = (None if create_pr else base), ""
        if create_pr:
            parent = retried(api.repo_info, repo_id, revision=base).sha
            message = f"{message} (parent {parent[:12]})" if parent else message
            discussions = retried(
                lambda: list(
                    api.get_repo_discussions(repo_id, discussion_type="pull_request", discussion_status="open")
                )
            )
            pr = next((pr for pr in discussions if pr.title == message), None)
            if pr is not None:  # continue it: its commits go to refs/pr/N
                revision, url = pr.git_reference, str(pr.url)
        present = _remote_files(api, repo_id, revision or base)
        todo = [(name, path.stat().st_size) for name, path in local.items() if not _same(path, present.get(name))]
        batches = upload_batches(todo, commit_bytes)
        for i, batch in enumerate(batches):
            opens_pr = create_pr and revision is None  # the first commit opens the pull request, titled `message`
            info = api.create_commit(
                repo_id,
                [CommitOperationAdd(path_in_repo=name, path_or_fileobj=local[name]) for name in batch],
                commit_message=message if opens_pr or len(batches) == 1 else f"{message} ({i + 1}/{len(batches)})",
                commit_description=commit_description,
                create_pr=opens_pr,
                revision=base if opens_pr else revision,
            )
            if opens_pr:
                revision, url = info.pr_revision, str(info.pr_url)
            elif not create_pr:
                url = str(info.commit_url)
    return url or f"{api.endpoint}/{repo_id}"


def pushed_files(folder: Path) -> list[str]:
    """The files of `folder` a push uploads: every regular file inside it. A link out of the folder, a
    FIFO or a device is refused (a push must never upload what lies outside what was converted)."""
    files, skipped = SourceTree.of(folder).files()
    if skipped:
        raise UsageError(
            f"FOLDER {folder}: {skipped[0].split('; ')[0]}; fp8fix push uploads only regular files inside FOLDER"
        )
    return files


def _remote_files(api: Any, repo_id: str, revision: str | None) -> dict[str, Any]:
    """The files the repo holds at `revision` (main by default), by path: none for a new repo."""
    from huggingface_hub import errors
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = retried(lambda: list(api.list_repo_tree(repo_id, revision=revision, recursive=True)))
        return {e.path: e for e in entries if isinstance(e, RepoFile)}
    except (errors.RevisionNotFoundError, errors.EntryNotFoundError):
        return {}


def _same(path: Path, remote: Any) -> bool:
    """True when the Hub's file has `path`'s content: same size, then the same LFS sha256 or git blob id."""
    if remote is None or remote.size != path.stat().st_size:
        return False
    lfs = getattr(remote, "lfs", None)
    if lfs is not None:
        return bool(_digest(path, hashlib.sha256()) == lfs.sha256)
    return bool(_digest(path, hashlib.sha1(f"blob {remote.size}\0".encode())) == remote.blob_id)


def _digest(path: Path, hasher: Any) -> str:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            hasher.update(chunk)
    return str(hasher.hexdigest())


def remote_headers(repo_id: str, revision: str | None, token: str | None = None) -> Checkpoint | None:
    """config.json and every shard header of a Hub repo, without downloading the weights.

    None when the Hub cannot give the headers (offline: use the cache instead).
    """
    from huggingface_hub import HfApi, constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        return None
    with hub_errors(repo_id, revision, role="SOURCE"):
        bounded_session()
        folder = retried(snapshot_download, repo_id, revision=revision, allow_patterns=["*.json", "*.md"], token=token)
        meta = retried(HfApi(token=token).get_safetensors_metadata, repo_id, revision=revision)
    headers = {
        file: (fm.metadata, {n: (t.dtype, t.shape, t.data_offsets) for n, t in fm.tensors.items()})
        for file, fm in meta.files_metadata.items()
    }
    return checkpoint_from_headers(inside_cache(Path(folder), repo_id), headers)

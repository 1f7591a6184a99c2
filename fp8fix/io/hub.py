"""The Hugging Face Hub: resolving a repo id to a local snapshot, and pushing a converted repo.

Everything goes through huggingface_hub, so HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE,
HF_TOKEN and HF_ENDPOINT mean what they mean everywhere else, and its own progress
bars show. Hub failures become one line and exit code 4; the token never appears.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fp8fix.errors import Fp8fixError, HubError, UsageError
from fp8fix.io.checkpoint import Checkpoint, checkpoint_from_headers

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


def is_repo_id(source: str) -> bool:
    """`org/name` that is not a local path (a local folder of that spelling always wins)."""
    return not Path(source).exists() and bool(REPO_ID.match(source))


def _scrub(text: str) -> str:
    token = os.environ.get("HF_TOKEN")
    return text.replace(token, "***") if token else text


@contextmanager
def hub_errors(repo_id: str, revision: str | None = None, action: str = "read") -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one clear line (exit code 4)."""
    from huggingface_hub import errors

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        yield
    except errors.GatedRepoError:
        raise HubError(
            f"{where}: the repo is gated: accept its terms on the Hub, then log in (hf auth login)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"{where}: repo not found, or private and you are not logged in (hf auth login, or set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{where}: revision not found in the repo") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        raise HubError(
            f"{where}: not in the local Hub cache, and the Hub is unreachable or HF_HUB_OFFLINE is set"
        ) from None
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise HubError(f"{where}: no permission to {action} this repo (HTTP {status}); check your token") from None
        raise HubError(_scrub(f"{where}: the Hub answered HTTP {status}: {e}").splitlines()[0]) from None
    except OSError as e:  # ConnectionError, TimeoutError and the rest
        raise HubError(_scrub(f"{where}: network error reaching the Hub: {e}").splitlines()[0]) from None
    except Fp8fixError:
        raise
    except Exception as e:  # httpx errors do not derive from OSError; anything else is an answer we did not expect
        if type(e).__module__.startswith(("httpx", "httpcore")):
            raise HubError(_scrub(f"{where}: network error reaching the Hub: {e}").splitlines()[0]) from None
        raise HubError(_scrub(f"{where}: unexpected answer from the Hub ({type(e).__name__}: {e})")) from None


def resolve_source(source: str, revision: str | None) -> tuple[Path, str | None]:
    """The local folder to read, and the repo id when SOURCE named a Hub repo."""
    if not is_repo_id(source):
        if revision:
            raise UsageError(f"{source}: --revision applies to Hub repo ids, and this is a local path")
        return Path(source), None
    from huggingface_hub import snapshot_download

    with hub_errors(source, revision):
        folder = snapshot_download(source, revision=revision, allow_patterns=ALLOW_PATTERNS)
    return Path(folder), source


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool = False,
    create_pr: bool = False,
    commit_message: str,
) -> str:
    """Upload `folder` to `repo_id` in one commit (or one pull request); return the commit or PR URL.

    With `create_pr`, an open pull request with the same title (which names the
    parent commit) is reused instead of opening an identical second one.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    message = commit_message
    with hub_errors(repo_id, action="write"):
        api.create_repo(repo_id, private=private or None, exist_ok=True)  # None: the owner's default
        if create_pr:
            parent = api.repo_info(repo_id).sha
            message = f"{message} (parent {parent[:12]})" if parent else message
            for pr in api.get_repo_discussions(repo_id, discussion_type="pull_request", discussion_status="open"):
                if pr.title == message:
                    return str(pr.url)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=message,
            create_pr=create_pr,
        )
    return str(info.pr_url if create_pr and info.pr_url else info.commit_url)


def remote_headers(repo_id: str, revision: str | None) -> Checkpoint | None:
    """config.json and every shard header of a Hub repo, without downloading the weights.

    None when the Hub cannot give the headers (offline: use the cache instead).
    """
    from huggingface_hub import HfApi, constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        return None
    with hub_errors(repo_id, revision):
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=["*.json", "*.md"])
        meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)
    headers = {
        file: (fm.metadata, {n: (t.dtype, t.shape, t.data_offsets) for n, t in fm.tensors.items()})
        for file, fm in meta.files_metadata.items()
    }
    return checkpoint_from_headers(Path(folder), headers)

"""The Hub, without a network: reads through a real huggingface_hub cache with HF_HUB_OFFLINE=1, writes
through the real HfApi client to a small server on 127.0.0.1 (tests/hub_server.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.builders import build, phi3
from tests.conftest import folder_digest, load_tensors, raw
from tests.hub_server import FakeHub

SHA = "1234567890abcdef1234567890abcdef12345678"
TOKEN = "hf_test_token_that_must_never_be_printed"


def fp8fix(*args: str | Path, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fp8fix", *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True
    )


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    # the test Hub speaks LFS, not Xet (tests/hub_server.py)
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", **extra)
    return env


@pytest.fixture
def hub_cache(tmp_path: Path) -> Path:
    return make_hub_cache(tmp_path)


def make_hub_cache(tmp_path: Path) -> Path:
    """A Hub cache as huggingface_hub lays it out: refs/main -> snapshots/<sha>/..."""
    cache = tmp_path / "cache"
    repo = cache / "models--org--tiny-fp8"
    snapshot = build(repo / "snapshots" / SHA, phi3())
    (snapshot / "README.md").write_text("---\nlicense: mit\n---\n# tiny\nThe original card.\n")
    (repo / "blobs").mkdir()
    for file in list(snapshot.iterdir()):  # as huggingface_hub stores them: blobs, linked from the snapshot
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(blob)
        file.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    return cache


def offline_env(tmp_path: Path, cache: Path) -> dict[str, str]:
    return base_env(tmp_path, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))


def card_metadata(text: str) -> dict:
    return yaml.safe_load(text.split("---")[1])


def test_convert_a_repo_id_from_the_cache(tmp_path: Path, hub_cache: Path) -> None:
    env = offline_env(tmp_path, hub_cache)
    proc = fp8fix("convert", "org/tiny-fp8", tmp_path / "out", "--format", "keep", "-q", "--verify", env=env)
    assert proc.returncode == 0, proc.stderr
    snapshot = hub_cache / "models--org--tiny-fp8" / "snapshots" / SHA
    assert "model.layers.0.self_attn.q_proj.weight" in load_tensors(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    meta = card_metadata(card)
    assert meta["base_model"] == "org/tiny-fp8" and meta["base_model_relation"] == "quantized"
    assert {"fp8", "fp8fix"} <= set(meta["tags"]) and meta["license"] == "mit"
    assert "The original card." in card and "Converted from `org/tiny-fp8`" in card
    # inspect and verify take the repo id too
    inspected = fp8fix("inspect", "org/tiny-fp8", "--json", env=env)
    assert inspected.returncode == 0 and '"single-scale-fused"' in inspected.stdout
    assert fp8fix("verify", "org/tiny-fp8", tmp_path / "out", "-q", env=env).returncode == 0
    assert folder_digest(snapshot) == folder_digest(snapshot)  # the cache is read, never written


def test_revision_and_its_errors(tmp_path: Path, hub_cache: Path) -> None:
    env = offline_env(tmp_path, hub_cache)
    proc = fp8fix("convert", "org/tiny-fp8", tmp_path / "out", "--revision", SHA, "-q", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Converted from `org/tiny-fp8@" + SHA in (tmp_path / "out" / "README.md").read_text()
    proc = fp8fix("convert", "org/tiny-fp8", tmp_path / "out2", "--revision", "no-such-branch", env=env)
    assert proc.returncode == 4 and proc.stderr.startswith("Error: org/tiny-fp8@no-such-branch")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out2").exists()


def test_a_repo_that_is_not_cached_offline(tmp_path: Path, hub_cache: Path) -> None:
    proc = fp8fix("convert", "org/other", tmp_path / "out", env=offline_env(tmp_path, hub_cache))
    assert proc.returncode == 4
    assert "not in the local Hub cache" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_local_folder_wins_over_a_repo_id(tmp_path: Path, hub_cache: Path) -> None:
    work = tmp_path / "work"
    build(work / "org" / "tiny-fp8", phi3(layers=1))
    proc = fp8fix(
        "convert",
        "org/tiny-fp8",
        tmp_path / "out",
        "--format",
        "keep",
        "-q",
        env=offline_env(tmp_path, hub_cache),
        cwd=work,
    )
    assert proc.returncode == 0, proc.stderr
    assert "base_model" not in card_metadata((tmp_path / "out" / "README.md").read_text())
    assert "model.layers.1.self_attn.q_proj.weight" not in load_tensors(tmp_path / "out")


def online_env(tmp_path: Path, hub: FakeHub) -> dict[str, str]:
    return base_env(tmp_path, HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_CACHE=str(tmp_path / "cache"))


def test_convert_and_push(tmp_path: Path, fake_hub: FakeHub) -> None:
    src = build(tmp_path / "src", phi3())
    env = online_env(tmp_path, fake_hub)
    proc = fp8fix(
        "convert",
        src,
        tmp_path / "out",
        "--format",
        "keep",
        "--to",
        "e4m3fnuz",
        "--push-to-hub",
        "me/tiny-mi300",
        "--private",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert fake_hub.repos["me/tiny-mi300"]["private"] is True
    (commit,) = fake_hub.commits
    assert commit.repo_id == "me/tiny-mi300" and commit.revision == "main" and not commit.create_pr
    out = tmp_path / "out"
    assert set(commit.files) == {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    for name, data in commit.files.items():
        assert data == (out / name).read_bytes(), name
    assert commit.summary == "fp8fix: convert src (--layout unfused --to e4m3fnuz)"
    meta = card_metadata(commit.files["README.md"].decode())
    assert {"fp8", "fp8fix", "e4m3fnuz", "rocm"} <= set(meta["tags"])
    assert f"pushed: {fake_hub.url}/me/tiny-mi300/commit/" in proc.stdout
    assert TOKEN not in proc.stdout + proc.stderr
    assert all(a == f"Bearer {TOKEN}" for a in fake_hub.authorization)


def test_push_as_a_pull_request_once(tmp_path: Path, fake_hub: FakeHub) -> None:
    src = build(tmp_path / "src", phi3())
    env = online_env(tmp_path, fake_hub)
    assert fp8fix("convert", src, tmp_path / "out", "--format", "keep", "-q", env=env).returncode == 0
    first = fp8fix("push", "org/tiny", tmp_path / "out", "--create-pr", "--commit-message", "Fix FP8 scales", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"pushed: {fake_hub.url}/org/tiny/discussions/1"
    (commit,) = fake_hub.commits
    assert commit.create_pr and commit.revision == "refs/pr/1" and commit.summary.startswith("Fix FP8 scales (parent ")
    again = fp8fix("push", "org/tiny", tmp_path / "out", "--create-pr", "--commit-message", "Fix FP8 scales", env=env)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert len(fake_hub.commits) == 1 and len(fake_hub.pull_requests) == 1


@pytest.mark.parametrize(
    "failure,message",
    [(404, "repo not found"), (403, "no permission"), ("gated", "gated"), (500, "HTTP 500")],
)
def test_hub_failures_are_one_line_and_exit_4(
    tmp_path: Path, fake_hub: FakeHub, failure: int | str, message: str
) -> None:
    src = build(tmp_path / "src", phi3())
    fake_hub.fail_with = failure
    env = online_env(tmp_path, fake_hub)
    proc = fp8fix("convert", src, tmp_path / "out", "--push-to-hub", "me/x", "-q", env=env)
    assert proc.returncode == 4, proc.stderr
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"retry with `fp8fix push me/x {tmp_path / 'out'}`" in proc.stderr
    assert (tmp_path / "out" / "config.json").exists(), "a failed push must leave OUTPUT intact"
    assert TOKEN not in proc.stderr
    read = fp8fix("inspect", "org/remote", env=env)
    # a repo id that names no folder: a repo not found says no folder of that name exists either
    expected = "Error: SOURCE org/remote: no such folder" if failure == 404 else "Error: org/remote"
    assert read.returncode == 4 and read.stderr.startswith(expected), read.stderr


def test_network_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = base_env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_TOKEN=TOKEN, HF_HUB_ETAG_TIMEOUT="2")
    proc = fp8fix("convert", "org/tiny", tmp_path / "out", env=env)
    assert proc.returncode == 4 and proc.stderr.startswith("Error: SOURCE org/tiny: no such folder")
    assert "network error reaching the Hub" in proc.stderr and TOKEN not in proc.stderr


def test_push_to_a_branch_with_a_description(tmp_path: Path, fake_hub: FakeHub) -> None:
    """push --revision BRANCH: the branch is made (from main) and the commit lands there, main untouched;
    --commit-description goes with the commit; a second push to the same branch finds it there."""
    src = build(tmp_path / "src", phi3())
    env = online_env(tmp_path, fake_hub)
    assert fp8fix("convert", src, tmp_path / "out", "-q", env=env).returncode == 0
    args = ["push", "org/tiny", tmp_path / "out", "--revision", "fp8-fixed", "--commit-description", "Why: scales"]
    first = fp8fix(*args, env=env)
    assert first.returncode == 0, first.stderr
    (commit,) = fake_hub.commits
    assert (commit.revision, commit.description, commit.create_pr) == ("fp8-fixed", "Why: scales", False)
    assert fake_hub.branches == [("org/tiny", "fp8-fixed")]
    assert set(fake_hub.tree("org/tiny", "fp8-fixed")) == {p.name for p in (tmp_path / "out").iterdir()}
    assert fake_hub.tree("org/tiny") == {}
    again = fp8fix(*args, env=env)
    assert again.returncode == 0 and len(fake_hub.commits) == 1, again.stderr  # everything is there already
    # --create-pr with --revision: the pull request is opened against that branch
    pr = fp8fix("push", "org/other", tmp_path / "out", "--create-pr", "--revision", "dev", env=env)
    assert pr.returncode == 0, pr.stderr
    assert fake_hub.pull_requests[-1]["base"] == "dev" and fake_hub.commits[-1].revision == "refs/pr/1"


def test_push_refuses_a_folder_that_is_not_a_checkpoint(tmp_path: Path, fake_hub: FakeHub) -> None:
    (tmp_path / "empty").mkdir()
    proc = fp8fix("push", "me/x", tmp_path / "empty", env=online_env(tmp_path, fake_hub))
    assert proc.returncode == 3 and fake_hub.requests == []


def test_revision_with_a_local_folder_is_refused(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    proc = fp8fix("convert", src, tmp_path / "out", "--revision", "main", env=base_env(tmp_path))
    assert proc.returncode == 2 and "--revision" in proc.stderr  # a usage error


def test_source_card_content_is_kept_unchanged_in_cache(tmp_path: Path, hub_cache: Path) -> None:
    snapshot = hub_cache / "models--org--tiny-fp8" / "snapshots" / SHA
    before = folder_digest(snapshot)
    assert (
        fp8fix("convert", "org/tiny-fp8", tmp_path / "out", "-q", env=offline_env(tmp_path, hub_cache)).returncode == 0
    )
    assert folder_digest(snapshot) == before
    s, o = load_tensors(snapshot), load_tensors(tmp_path / "out")
    assert raw(o["model.norm.weight"]) == raw(s["model.norm.weight"])
    shutil.rmtree(tmp_path / "out")


def test_inspect_a_repo_id_reads_headers_not_weights(tmp_path: Path, fake_hub: FakeHub) -> None:
    fake_hub.files["org/remote"] = build(tmp_path / "served", phi3(), scale="shard")
    env = base_env(tmp_path, HF_ENDPOINT=fake_hub.url)
    proc = fp8fix("inspect", "org/remote", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    import json

    report = json.loads(proc.stdout)
    assert report["source"] == "org/remote" and len(report["modules"]) == 8
    # headers only: the split's q / k / v scales are unread, so every vLLM packing them may requantize (rounded):
    # the default conversion makes no row outside the target load exactly (no row-improved)
    assert {f["code"] for f in report["findings"] if f["loaders"]} == {"row-fails", "row-loads-wrong"}
    assert {f["code"] for f in report["findings"] if not f["loaders"]} == {
        "per-shard-scales-on-fused",
        "raw-codes-in-transformers",
        "kv-cache-scales-dropped",  # headers say it (vLLM refuses the per-shard scales: no kv verdict there)
    }
    assert any("headers read from the Hub" in n for n in report["notes"])
    assert not list((tmp_path / "hf-home").rglob("*.safetensors")), "inspect downloaded weights"
    assert any(r.startswith("GET /org/remote/resolve/") and r.endswith(".safetensors") for r in fake_hub.requests)


def test_convert_a_repo_id_online(tmp_path: Path, fake_hub: FakeHub) -> None:
    fake_hub.files["org/remote"] = build(tmp_path / "served", phi3())
    env = base_env(tmp_path, HF_ENDPOINT=fake_hub.url)
    proc = fp8fix("convert", "org/remote", tmp_path / "out", "-q", "--verify", env=env)
    assert proc.returncode == 0, proc.stderr
    assert card_metadata((tmp_path / "out" / "README.md").read_text())["base_model"] == "org/remote"


@pytest.mark.parametrize(
    "source",
    ["examples/phi3-tiny-fp9", "./org/model", "~/nowhere/model", "phi3-tiny-fp9", "org/bad--name", "org/x/y"],
)
def test_a_source_that_looks_local_is_never_sent_to_the_hub(tmp_path: Path, fake_hub: FakeHub, source: str) -> None:
    """A mistyped local folder (its parent exists), a path-like name, a bare name or a name the Hub would refuse
    (huggingface_hub's validate_repo_id) is a local path: a usage error naming SOURCE, no Hub request."""
    (tmp_path / "examples").mkdir()
    env = online_env(tmp_path, fake_hub)
    for command in ("inspect", "convert"):
        args = [command, source] + ([str(tmp_path / "out")] if command == "convert" else [])
        proc = fp8fix(*args, env=env, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"Error: SOURCE {source}: no such folder"), proc.stderr
    assert fake_hub.requests == []


def test_verify_errors_say_which_argument(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    (tmp_path / "half").mkdir()
    proc = fp8fix("verify", src, tmp_path / "half", env=base_env(tmp_path))
    assert proc.returncode == 3 and proc.stderr.startswith(f"Error: OUTPUT {tmp_path / 'half'}: config.json: missing")


def test_pushing_offline_says_so(tmp_path: Path, fake_hub: FakeHub) -> None:
    src = build(tmp_path / "src", phi3())
    env = {**online_env(tmp_path, fake_hub), "HF_HUB_OFFLINE": "1"}
    proc = fp8fix("push", "me/x", src, env=env)
    assert proc.returncode == 4 and "cannot push: HF_HUB_OFFLINE is set" in proc.stderr


def test_a_large_push_goes_out_in_commits_that_a_rerun_resumes(tmp_path: Path, fake_hub: FakeHub) -> None:
    """With a commit size below each file's, every file is a commit of its own (config, index and card in
    the last); a push cut off after two commits, run again, sends only what the Hub does not have."""
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    env = online_env(tmp_path, fake_hub)
    assert fp8fix("convert", src, out, "--format", "keep", "-q", env=env).returncode == 0
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    fake_hub.fail_commit_after = 2
    cut = fp8fix("push", "me/big", out, "--commit-size", "1KB", "--commit-message", "Upload", env=env)
    assert cut.returncode == 4 and "HTTP 500" in cut.stderr
    first = [c.files for c in fake_hub.commits]
    assert len(first) == 2
    fake_hub.fail_commit_after = None
    again = fp8fix("push", "me/big", out, "--commit-size", "1KB", "--commit-message", "Upload", env=env)
    assert again.returncode == 0, again.stderr
    sent = [name for c in fake_hub.commits for name in c.files]
    assert sorted(sent) == sorted(files)  # every file once: the rerun skipped the two commits that landed
    assert set(fake_hub.commits[-1].files) == {"config.json", "model.safetensors.index.json", "README.md"}
    assert all(c.summary.startswith("Upload (") for c in fake_hub.commits)
    for commit in fake_hub.commits:
        assert all(data == (out / name).read_bytes() for name, data in commit.files.items())
    nothing_left = fp8fix("push", "me/big", out, "--commit-size", "1KB", env=env)
    assert nothing_left.returncode == 0 and len(fake_hub.commits) == len(files) - 2


def test_push_takes_a_token_and_the_old_argument_order_with_a_warning(tmp_path: Path, fake_hub: FakeHub) -> None:
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    env = base_env(tmp_path, HF_ENDPOINT=fake_hub.url, HF_HUB_CACHE=str(tmp_path / "cache"))  # no HF_TOKEN
    assert fp8fix("convert", src, out, "--format", "keep", "-q", env=env).returncode == 0
    proc = fp8fix("push", out, "me/old-order", "--token", TOKEN, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "deprecated" in proc.stderr and "fp8fix push me/old-order" in proc.stderr
    pushed = json.loads(proc.stdout)
    assert pushed["schema_version"] == 2 and pushed["repo_id"] == "me/old-order"
    assert pushed["url"].startswith(f"{fake_hub.url}/me/old-order/commit/")
    assert fake_hub.authorization and all(a == f"Bearer {TOKEN}" for a in fake_hub.authorization)
    assert TOKEN not in proc.stdout + proc.stderr


def test_convert_json_keeps_the_record_when_the_push_fails(tmp_path: Path, fake_hub: FakeHub) -> None:
    src = build(tmp_path / "src", phi3())
    fake_hub.fail_with = 403
    proc = fp8fix(
        "convert", src, tmp_path / "out", "--push-to-hub", "me/x", "--json", env=online_env(tmp_path, fake_hub)
    )
    assert proc.returncode == 4
    record = json.loads(proc.stdout)
    assert record["schema_version"] == 2 and record["written"] and record["output"] == str(tmp_path / "out")
    assert record["pushed"] is None and record["push_error"]["exit_code"] == 4
    assert "no permission" in record["push_error"]["message"] and "retry with" in record["push_error"]["message"]
    assert proc.stderr.startswith("Error: me/x: no permission")


def test_a_large_pull_request_is_one_pull_request_a_rerun_continues(tmp_path: Path, fake_hub: FakeHub) -> None:
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    env = online_env(tmp_path, fake_hub)
    assert fp8fix("convert", src, out, "--format", "keep", "-q", env=env).returncode == 0
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    args = ("push", "org/big", out, "--create-pr", "--commit-size", "1KB", "--commit-message", "Fix")
    fake_hub.fail_commit_after = 2
    assert fp8fix(*args, env=env).returncode == 4
    fake_hub.fail_commit_after = None
    again = fp8fix(*args, env=env)
    assert again.returncode == 0 and again.stdout.strip() == f"pushed: {fake_hub.url}/org/big/discussions/1"
    assert len(fake_hub.pull_requests) == 1 and fake_hub.pull_requests[0]["entry"]["title"].startswith("Fix (parent ")
    assert all(c.revision == "refs/pr/1" for c in fake_hub.commits)
    assert sorted(n for c in fake_hub.commits for n in c.files) == sorted(files)

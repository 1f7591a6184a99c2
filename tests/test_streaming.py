"""Hub to Hub without an OUTPUT folder (issue 26): `convert ORG/SRC --push-to-hub ORG/DST`.

Against the test Hub (tests/hub_server.py: ranged reads, LFS uploads, pull requests and merges):
the files that land on DST's main are byte for byte those of a local `convert ORG/SRC OUTPUT`;
the working folder's disk use, sampled every few milliseconds, stays under --max-disk; a bound no
output shard fits is refused before any shard is downloaded; an interrupted run, rerun, uploads
no shard twice; the Hub cache is not used; main never shows a half checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import (
    block_fp8_shards,
    build,
    deepseek_v4,
    fp4_compressed_tensors,
    gpt_oss,
    llama,
    modelopt_nvfp4,
    mxfp8_compressed_tensors,
    phi3,
)
from tests.disk_sampler import disk_sampler
from tests.hub_server import FakeHub

#: Minutes of subprocesses against the test Hub: CI runs them once, in its first pass.
pytestmark = pytest.mark.heavy

TOKEN = "hf_streaming_test_token"


@pytest.fixture
def hub(fake_hub: FakeHub) -> FakeHub:
    return fake_hub


def env_for(tmp_path: Path, hub: FakeHub) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_ENDPOINT=hub.url,
        HF_TOKEN=TOKEN,
        HF_HUB_DISABLE_XET="1",  # the test Hub speaks LFS
        TMPDIR=str(tmp_path / "tmp"),  # where the working folder goes
    )
    return env


def fp8fix(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fp8fix", *map(str, args)], env=env, capture_output=True, text=True)


def served(tmp_path: Path, hub: FakeHub, files: int = 3, **sizes: int) -> Path:
    folder = build(tmp_path / "served", phi3(**sizes) if sizes else phi3(layers=4), files=files)
    hub.files["org/src"] = folder
    return folder


def local_reference(tmp_path: Path, env: dict[str, str], *options: str) -> dict[str, bytes]:
    """What `convert org/src OUTPUT` writes, read from the same test Hub: the files streaming must push."""
    out = tmp_path / "reference"
    proc = fp8fix("convert", "org/src", out, "-q", *options, env={**env, "HF_HOME": str(tmp_path / "ref-home")})
    assert proc.returncode == 0, proc.stderr
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--format", "keep", "--layout", "unfused"],
        ["--to", "e4m3fnuz"],
        ["--to", "bf16"],  # the scales read as the rows are written, one of them from another shard
        ["--dequantize", "*.layers.3.*"],
    ],
)
def test_hub_to_hub_lands_what_a_local_conversion_writes(tmp_path: Path, hub: FakeHub, options: list[str]) -> None:
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", *options, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"pushed: {hub.url}/me/dst" in proc.stdout
    assert "3 output shards converted and uploaded, 0 already on the Hub" in proc.stdout
    # each source shard read whole once, planning having read only headers and scales (ranges)
    whole = sorted(path for path, ranged in hub.reads if path.endswith(".safetensors") and not ranged)
    assert whole == sorted(f"org/src/{p.name}" for p in hub.files["org/src"].glob("*.safetensors"))
    assert not list((tmp_path / "hf-home").rglob("*.safetensors")), "the Hub cache was used"
    assert not any((tmp_path / "tmp").iterdir()), "the working folder was left behind"
    assert hub.tree("me/dst") == local_reference(tmp_path, env, *options)
    assert hub.merges == [("me/dst", 1)]  # one merge: main never held a part of it


def assert_streams_as_local(tmp_path: Path, hub: FakeHub, folder: Path, options: list[str]) -> None:
    """`folder`, served as org/src, converted with `options` Hub to Hub under a --max-disk of three pairs of its
    largest shard, lands what a local conversion writes."""
    bound = 3 * 2 * max(p.stat().st_size for p in folder.glob("*.safetensors"))
    env = env_for(tmp_path, hub)
    proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", *options, "--max-disk", str(bound), env=env)
    assert proc.returncode == 0, proc.stderr
    assert hub.tree("me/dst") == local_reference(tmp_path, env, *options)


@pytest.mark.parametrize("options", [["--to", "bf16"], ["--blocks", "128x128"]])
def test_an_mxfp8_checkpoint_streams(tmp_path: Path, hub: FakeHub, options: list[str]) -> None:
    """MX weights written in BF16 or as 128 x 128 block FP8 (issue 49) read their E8M0 scales as the rows are
    written, from whichever shard holds them (here mostly another): Hub to Hub in bounded disk lands what a local
    conversion writes (projections of whole 128-blocks: a grid of one block reads like one scale, whose value a
    stream cannot know before the codes are there)."""
    model = llama(hidden=256, heads=2, kv_heads=1, intermediate=256, layers=2)
    folder = mxfp8_compressed_tensors(tmp_path / "served", model, files=3)
    hub.files["org/src"] = folder
    assert_streams_as_local(tmp_path, hub, folder, options)


def test_block_fp8_streams_as_mxfp8(tmp_path: Path, hub: FakeHub) -> None:
    """`--blocks mx` (issue 49): each block row's scales are read as its codes are written, from whichever shard
    holds them (here the other); Hub to Hub lands what a local conversion writes."""
    folder = build(tmp_path / "served", llama(hidden=256, heads=2, kv_heads=1, intermediate=256), fmt="block-fp8",
                   kv_scales=False, files=3)  # fmt: skip
    hub.files["org/src"] = folder
    assert_streams_as_local(tmp_path, hub, folder, ["--blocks", "mx"])


#: The bound counts the stand-ins (headers, scales) and the small files too; the only slack is the file
#: system's own: blocks rounded up, and those ext4 reserves ahead of a file being written (seen: 256 KiB
#: over, with 3 files of 277 MB in flight).
SLACK = 4 * 2**20


def test_disk_stays_under_the_bound(tmp_path: Path, hub: FakeHub) -> None:
    folder = served(tmp_path, hub, files=6, hidden=256, intermediate=1024, layers=6)
    bound = 3 * max(p.stat().st_size for p in folder.glob("*.safetensors"))
    env = env_for(tmp_path, hub)
    with disk_sampler(tmp_path / "tmp") as samples:
        proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "--max-disk", str(bound), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["streamed"]["max_disk"] == bound and report["streamed"]["peak_disk"] <= bound
    assert max(samples) > 0, "the sampler saw nothing"
    assert max(samples) <= bound + SLACK, (max(samples), bound)
    assert hub.tree("me/dst")["config.json"]


def test_two_gigabytes_stream_in_three_shards_of_disk(tmp_path: Path, hub: FakeHub) -> None:
    """Issue 26's scale test: over 2 GiB in 8 shards, Hub to Hub with --max-disk at 3 shards. The working
    folder never holds more; what lands is what a local conversion of the same files writes."""
    src = block_fp8_shards(tmp_path / "served", shards=8, shard_mib=264)
    hub.files["org/src"] = src
    assert sum(p.stat().st_size for p in src.iterdir()) > 2 * 2**30
    bound = 3 * max(p.stat().st_size for p in src.glob("*.safetensors"))
    env = env_for(tmp_path, hub)
    with disk_sampler(tmp_path / "tmp") as samples:
        proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "-q", "--max-disk", str(bound), env=env)
    assert proc.returncode == 0, proc.stderr
    assert max(samples) <= bound + SLACK, (max(samples), bound)
    local = tmp_path / "local"
    assert fp8fix("convert", src, local, "-q", env=env).returncode == 0
    landed = hub.digests("me/dst")
    for path in local.iterdir():  # the card names its source (a folder here, the repo there): the rest is equal
        if path.name != "README.md":
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            assert landed[path.name] == digest.hexdigest(), path.name
    assert set(landed) == {p.name for p in local.iterdir()}


def test_a_bound_no_shard_fits_is_refused_before_any_download(tmp_path: Path, hub: FakeHub) -> None:
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "--max-disk", "10KB", env=env)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("Error: --max-disk 10000: output shard model-0000") and "give --max-disk" in line
    assert "me/dst" not in hub.repos and not hub.uploads
    assert not [path for path, ranged in hub.reads if path.endswith(".safetensors") and not ranged]


def test_an_interrupted_stream_resumes_without_uploading_a_shard_twice(tmp_path: Path, hub: FakeHub) -> None:
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    hub.fail_commit_after = 2  # two shards land on the pull request, then the Hub fails
    cut = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", env=env)
    assert cut.returncode == 4 and "HTTP 500" in cut.stderr, cut.stderr
    assert not hub.tree("me/dst").get("config.json"), "main shows a half checkpoint"
    uploaded = list(hub.uploads)
    hub.fail_commit_after = None
    again = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", env=env)
    assert again.returncode == 0, again.stderr
    assert "1 output shards converted and uploaded, 2 already on the Hub" in again.stdout
    # the third shard's bytes went up before its commit failed: rebuilt, its upload is not repeated
    assert len(uploaded) == 3 and hub.uploads == uploaded
    main = hub.tree("me/dst")
    assert main == local_reference(tmp_path, env)  # the card of a resumed run is a single run's
    assert not any(name.startswith(".fp8fix-stream") for name in main)


def test_create_pr_leaves_main_alone(tmp_path: Path, hub: FakeHub) -> None:
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    proc = fp8fix(
        "convert", "org/src", "--push-to-hub", "me/dst", "--create-pr", "--commit-description", "Why: MI300", env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f"pushed: {hub.url}/me/dst/discussions/1")
    assert hub.merges == [] and not hub.tree("me/dst")
    # the description: the pull request's (below what it is) and the final commit's
    assert hub.pull_requests[0]["description"].endswith("\n\nWhy: MI300")
    assert hub.commits[-1].description == "Why: MI300"
    assert set(hub.tree("me/dst", "refs/pr/1")) == set(local_reference(tmp_path, env))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "OUTPUT is missing"),
        (["--push-to-hub", "me/dst", "--verify"], "--verify checks OUTPUT"),
        (["--push-to-hub", "me/dst", "--dry-run"], "--dry-run applies to a conversion into OUTPUT"),
        (["--push-to-hub", "me/dst", "--commit-size", "1GB"], "--commit-size applies"),
        (["out", "--push-to-hub", "me/dst", "--max-disk", "1GB"], "--max-disk applies to a streamed conversion"),
        (["out", "--push-to-hub", "me/dst", "--part", "1/2"], "--part applies to a streamed conversion"),
        (["--push-to-hub", "me/dst", "--part", "3/2"], "is not K/N"),
    ],
)
def test_what_a_stream_cannot_do_is_refused(tmp_path: Path, hub: FakeHub, args: list[str], message: str) -> None:
    served(tmp_path, hub)
    proc = fp8fix("convert", "org/src", *args, env=env_for(tmp_path, hub))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert hub.requests == []


@pytest.mark.parametrize("where", ["/org/src/resolve/", "/api/models/me/dst/"])
def test_rate_limits_and_server_errors_are_retried(tmp_path: Path, hub: FakeHub, where: str) -> None:
    """A 429 and two 5xx on the source's file reads, or on the destination's pull request and commits, are
    waited out; the conversion lands as if none happened."""
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    hub.fail_next, hub.fail_path = [429, 503, 500], where
    proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "-q", env=env)
    assert proc.returncode == 0, proc.stderr
    assert hub.fail_next == [] and hub.tree("me/dst") == local_reference(tmp_path, env)


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_refusal_is_one_line_and_exit_4(tmp_path: Path, hub: FakeHub, status: int) -> None:
    served(tmp_path, hub)
    hub.fail_with = status
    proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "-q", env=env_for(tmp_path, hub))
    assert proc.returncode == 4, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    # a repo not found: no folder of that name either, it says (issue 27); any other refusal names the repo
    assert line.startswith("Error: SOURCE org/src: no such folder" if status == 404 else "Error: org/src"), line
    assert TOKEN not in line


def _kill_points() -> dict[str, Callable[[FakeHub, str, str, str], bool]]:
    """Where the kill tests stop the streamed conversion: (hub, method, path, Range) -> this request is it."""

    def shard(method: str, path: str) -> bool:
        return method == "GET" and path.startswith("/org/src/resolve/") and path.endswith(".safetensors")

    return {
        "header reads": lambda hub, method, path, ranged: shard(method, path) and bool(ranged),
        "first download": lambda hub, method, path, ranged: shard(method, path) and not ranged,
        "an upload": lambda hub, method, path, ranged: method == "PUT",
        "between shards": lambda hub, method, path, ranged: len(hub.commits) == 1 and "/commit/" in path,
        "before the final commit": lambda hub, method, path, ranged: len(hub.commits) == 3 and "/commit/" in path,
    }


@pytest.mark.parametrize("point", sorted(_kill_points()))
def test_killed_anywhere_a_rerun_finishes(tmp_path: Path, hub: FakeHub, point: str) -> None:
    """SIGKILL at five points (the test Hub kills the client as the request arrives, leaving it unanswered):
    the same command run again finishes, uploads no shard more than once more than needed, and main never
    holds an index naming a missing file (main changes only by the final merge)."""
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    is_point = _kill_points()[point]
    args = [sys.executable, "-m", "fp8fix", "convert", "org/src", "--push-to-hub", "me/dst", "-q"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: list[str] = []

    def hook(method: str, path: str, ranged: str) -> bool:
        if killed or not is_point(hub, method, path, ranged):
            return False
        os.kill(proc.pid, signal.SIGKILL)
        killed.append(f"{method} {path}")
        return True

    hub.hook = hook
    proc.communicate(timeout=120)
    hub.hook = None
    assert killed and proc.returncode == -signal.SIGKILL, (point, proc.returncode)
    assert "config.json" not in hub.tree("me/dst"), "main shows a half checkpoint"
    again = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "-q", env=env)
    assert again.returncode == 0, again.stderr
    main = hub.tree("me/dst")
    assert main == local_reference(tmp_path, env)
    counts = {sha: hub.uploads.count(sha) for sha in hub.uploads}
    assert max(counts.values()) <= 2 and len(counts) == 3, counts
    index = json.loads(main["model.safetensors.index.json"])
    assert set(index["weight_map"].values()) <= set(main)


def _shard_bytes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}


def test_parts_share_the_shards_by_bytes_and_finalize_lands_one_checkpoint(tmp_path: Path, hub: FakeHub) -> None:
    """Four parts at the same time, each its share of six output shards (a part run twice is harmless);
    --finalize refuses while a share is missing, then makes the final commit: the result is a single
    run's, byte for byte, in one merge."""
    served(tmp_path, hub, files=6, hidden=128, intermediate=512, layers=6)
    env = env_for(tmp_path, hub)
    early = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "--finalize", "-q", env=env)
    assert early.returncode == 2 and "--finalize: 6 output shards are not on the pull request yet" in early.stderr
    base = [sys.executable, "-m", "fp8fix", "convert", "org/src", "--push-to-hub", "me/dst", "--json"]
    procs = [
        subprocess.Popen(
            [*base, "--part", f"{k}/4"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for k in range(1, 5)
    ]
    shares = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        shares.append(json.loads(out)["streamed"]["converted"])
    assert sorted(sum(shares, [])) == sorted(hub.tree("me/dst", "refs/pr/1").keys() & _shard_names(6))
    assert all(shares) and len(hub.uploads) == len(set(hub.uploads)) == 6
    again = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "--part", "2/4", "--json", env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["streamed"]["converted"] == []
    assert [p["entry"]["status"] for p in hub.pull_requests].count("open") == 1  # parts settled on one
    assert hub.merges == [] and not hub.tree("me/dst")
    done = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "--finalize", "-q", env=env)
    assert done.returncode == 0, done.stderr
    assert hub.tree("me/dst") == local_reference(tmp_path, env)
    assert len(hub.merges) == 1 and len(hub.uploads) == 6


def _shard_names(files: int) -> set[str]:
    return {f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)}


def test_parts_balance_bytes(tmp_path: Path) -> None:
    """Largest first, each to the lightest part: a share is never more than the largest shard over another."""
    from fp8fix.plan.pieces import Fill as FillPiece
    from fp8fix.plan.pieces import OutputShard, OutputTensor
    from fp8fix.streaming import parts_of

    sizes = [7, 3, 9, 1, 4, 4, 8, 2]
    shards = [
        OutputShard(f"s{i}", {}, [OutputTensor("t", "U8", (n,), [FillPiece(b"\0", n)], "t")])
        for i, n in enumerate(sizes)
    ]
    for n in (1, 2, 3, 4, 8, 10):
        owner = parts_of(shards, n)
        loads = [
            sum(size for s, size in zip(shards, sizes, strict=True) if owner[s.name] == k) for k in range(1, n + 1)
        ]
        assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
        assert owner == parts_of(list(reversed(shards)), n)  # the plan's order does not matter


@pytest.mark.parametrize("change", ["grown", "rewritten"])
def test_a_source_shard_that_changed_since_planning_is_refused(tmp_path: Path, hub: FakeHub, change: str) -> None:
    """The served shard changes between planning and its download (longer than listed, or another header of
    the same size): one line, exit 4, nothing merged; the download stops at the listed size."""
    folder = served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    changed: list[str] = []

    def hook(method: str, path: str, ranged: str) -> bool:
        if not changed and method == "GET" and path.endswith(".safetensors") and not ranged:
            shard = folder / path.rsplit("/", 1)[1]
            data = bytearray(shard.read_bytes())
            if change == "grown":
                data += b"\0" * (8 << 20)
            else:
                data[9] ^= 0x01  # one header byte, the same size
            shard.write_bytes(bytes(data))
            changed.append(shard.name)
        return False

    hub.hook = hook
    proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "-q", env=env)
    assert proc.returncode == 4, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert changed and changed[0] in line and ("the repo lists" in line or "not the file planned from" in line), line
    assert hub.merges == [] and not hub.tree("me/dst")


RECIPES = Path(__file__).resolve().parent.parent / "examples" / "hub-to-hub"


def _finalized_like_one_run(tmp_path: Path, hub: FakeHub, env: dict[str, str]) -> None:
    assert hub.tree("me/dst") == local_reference(tmp_path, env)
    assert len(hub.merges) == 1 and len(hub.uploads) == len(set(hub.uploads))


def test_the_github_actions_recipe_runs(tmp_path: Path, hub: FakeHub) -> None:
    """examples/hub-to-hub/github-actions.yml is a valid workflow whose matrix matches its --part N, and its
    fp8fix commands, with the inputs filled in, convert and finalize against the test Hub."""
    import shlex

    import yaml

    workflow = yaml.safe_load((RECIPES / "github-actions.yml").read_text())
    jobs = workflow["jobs"]
    assert jobs["finalize"]["needs"] == "convert" and workflow[True]["workflow_dispatch"]["inputs"].keys() == {
        "source",
        "dest",
    }
    parts = jobs["convert"]["strategy"]["matrix"]["part"]
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)

    def commands(job: str, part: int | None = None) -> list[list[str]]:
        found = []
        for step in jobs[job]["steps"]:
            run = step.get("run", "")
            if run.startswith("fp8fix "):
                assert step["env"]["HF_TOKEN"] == "${{ secrets.HF_TOKEN }}"
                text = run.replace("${{ inputs.source }}", "org/src").replace("${{ inputs.dest }}", "me/dst")
                found.append(shlex.split(text.replace("${{ matrix.part }}", str(part))))
        assert found, job
        return found

    for part in parts:
        for argv in commands("convert", part):
            assert f"{part}/{len(parts)}" in argv
            proc = subprocess.run([sys.executable, "-m", *argv, "-q"], env=env, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr
    for argv in commands("finalize"):
        assert subprocess.run([sys.executable, "-m", *argv, "-q"], env=env).returncode == 0
    _finalized_like_one_run(tmp_path, hub, env)


def test_the_slurm_recipe_runs(tmp_path: Path, hub: FakeHub) -> None:
    """examples/hub-to-hub/slurm.sh, run as each task of its --array would run it, then finalized."""
    script = (RECIPES / "slurm.sh").read_text()
    first, last = map(int, script.split("#SBATCH --array=")[1].split()[0].split("-"))
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "fp8fix").write_text(f'#!/bin/sh\nexec {sys.executable} -m fp8fix "$@" -q\n')
    (shim / "fp8fix").chmod(0o755)
    for task in range(first, last + 1):
        task_env = {**env, "SLURM_ARRAY_TASK_ID": str(task), "PATH": f"{shim}:{env['PATH']}"}
        proc = subprocess.run(
            ["bash", RECIPES / "slurm.sh", "org/src", "me/dst"], env=task_env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
    finalize = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "--finalize", "-q", env=env)
    assert finalize.returncode == 0, finalize.stderr
    _finalized_like_one_run(tmp_path, hub, env)


def test_the_ray_recipe_runs_without_ray(tmp_path: Path, hub: FakeHub) -> None:
    """examples/hub-to-hub/ray_parts.py's task and finalize functions, called as Ray would call them."""
    served(tmp_path, hub)
    env = env_for(tmp_path, hub)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import ray_parts as r; "
        "[r.convert_part('org/src', 'me/dst', k, 3) for k in (1, 2, 3)]; print(r.finalize('org/src', 'me/dst'))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(RECIPES)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{hub.url}/me/dst"
    _finalized_like_one_run(tmp_path, hub, env)


def test_verify_of_two_repos_streams_and_catches_a_changed_code(tmp_path: Path, hub: FakeHub) -> None:
    """`verify ORG/SRC ORG/DST`: shard by shard under --max-disk (two shards, the least it takes),
    nothing in the Hub cache; faithful after a streamed convert, and one code changed on the Hub is found."""
    folder = served(tmp_path, hub, files=4, hidden=256, intermediate=1024, layers=4)
    env = env_for(tmp_path, hub)
    assert fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "-q", "--to", "e4m3fnuz", env=env).returncode == 0
    largest = max(p.stat().st_size for p in folder.glob("*.safetensors"))
    out_largest = max(len(d) for n, d in hub.tree("me/dst").items() if n.endswith(".safetensors"))
    bound = 2 * max(largest, out_largest)
    with disk_sampler(tmp_path / "tmp") as samples:
        good = fp8fix("verify", "org/src", "me/dst", "--max-disk", str(bound), "--json", env=env)
    assert good.returncode == 0, good.stderr + good.stdout
    report = json.loads(good.stdout)
    assert report["ok"] and report["source"] == "org/src" and report["output"] == "me/dst"
    stand_ins = 64 * 1024 * 8  # headers and small floats of the 8 stand-ins, rounded up
    assert 0 < max(samples) <= bound + stand_ins + SLACK, (max(samples), bound)
    assert not list((tmp_path / "hf-home").rglob("*.safetensors")), "the Hub cache was used"
    # one code of one pushed shard changed on the Hub
    name = sorted(n for n in hub.tree("me/dst") if n.endswith(".safetensors"))[0]
    stored = hub.trees[("me/dst", "main")][name]
    data = bytearray(stored.read_bytes() if isinstance(stored, Path) else stored)
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    weight = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F8_E4M3FNUZ")
    data[8 + header_len + header[weight]["data_offsets"][0]] ^= 0x01
    hub.trees[("me/dst", "main")][name] = bytes(data)
    bad = fp8fix("verify", "org/src", "me/dst", "--max-disk", str(bound), env=env)
    assert bad.returncode == 1 and weight.rsplit(".", 1)[0] in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    # in two parts: the one that holds the changed code fails, each downloads only some of the shards whole
    parts, whole_reads = [], []
    for k in (1, 2):
        hub.reads.clear()
        parts.append(fp8fix("verify", "org/src", "me/dst", "--part", f"{k}/2", "--json", env=env))
        whole_reads.append({p for p, ranged in hub.reads if p.endswith(".safetensors") and not ranged})
    assert sorted(p.returncode for p in parts) == [0, 1], [p.stderr for p in parts]
    failed = json.loads(next(p.stdout for p in parts if p.returncode == 1))
    assert any(weight.rsplit(".", 1)[0] in problem for problem in failed["problems"])
    assert all(0 < len(reads) < 8 for reads in whole_reads), whole_reads
    small = fp8fix("verify", "org/src", "me/dst", "--max-disk", "1000", env=env)
    assert small.returncode == 2 and "verify reads two shards at once" in small.stderr


def test_parts_one_after_another_one_killed_and_rerun(tmp_path: Path, hub: FakeHub) -> None:
    """Three parts in turn, the second SIGKILLed as its first commit arrives and run again; then --finalize:
    the result is a single run's, and no shard went up more than once more than needed."""
    served(tmp_path, hub, files=6, hidden=128, intermediate=512, layers=6)
    env = env_for(tmp_path, hub)
    base = [sys.executable, "-m", "fp8fix", "convert", "org/src", "--push-to-hub", "me/dst", "-q"]
    for k in (1, 2, 3):
        if k == 2:
            _kill_at_first_commit(hub, [*base, "--part", "2/3"], env)
        proc = subprocess.run([*base, "--part", f"{k}/3"], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    done = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "--finalize", "-q", env=env)
    assert done.returncode == 0, done.stderr
    assert hub.tree("me/dst") == local_reference(tmp_path, env)
    counts = {sha: hub.uploads.count(sha) for sha in hub.uploads}
    assert len(counts) == 6 and max(counts.values()) <= 2, counts


def _kill_at_first_commit(hub: FakeHub, args: list[str], env: dict[str, str]) -> None:
    """Run `args`, SIGKILLed by the test Hub as its first commit arrives (left unanswered)."""
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    killed: list[str] = []

    def hook(method: str, path: str, ranged: str) -> bool:
        if killed or "/commit/" not in path:
            return False
        os.kill(proc.pid, signal.SIGKILL)
        killed.append(path)
        return True

    hub.hook = hook
    proc.communicate(timeout=120)
    hub.hook = None
    assert killed and proc.returncode == -signal.SIGKILL


def test_a_header_length_past_the_shard_is_refused_before_any_download(tmp_path: Path, hub: FakeHub) -> None:
    """A served shard whose first 8 bytes give a header of 2^40 bytes: one line, exit 3, nothing but the
    8 bytes read from it, nothing pushed."""
    folder = served(tmp_path, hub)
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    shard.write_bytes(bytes(data))
    proc = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", "-q", env=env_for(tmp_path, hub))
    assert proc.returncode == 3, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert shard.name in line and "header length 1099511627776" in line, line
    assert [r for p, r in hub.reads if p.endswith(shard.name)] == ["bytes=0-7"]
    assert "me/dst" not in hub.repos


def test_modelopt_nvfp4_streams(tmp_path: Path, hub: FakeHub) -> None:
    """ModelOpt NVFP4 (issue 49), whose weight_scale_2 multiplies its scales (read at write time, from the Hub):
    Hub to Hub under --max-disk lands what a local conversion writes."""
    model = llama(hidden=256, heads=2, kv_heads=1, intermediate=256)
    hub.files["org/src"] = folder = modelopt_nvfp4(tmp_path / "served", model, shared_global=False)
    assert_streams_as_local(tmp_path, hub, folder, ["--to", "bf16"])


def test_gpt_oss_experts_stream(tmp_path: Path, hub: FakeHub) -> None:
    """gpt-oss's MXFP4 experts (issue 49), written transposed one expert at a time: Hub to Hub under --max-disk,
    their scales in other shards, lands what a local conversion writes."""
    hub.files["org/src"] = folder = gpt_oss(tmp_path / "served", experts=8, hidden=128, intermediate=128, files=3)
    assert_streams_as_local(tmp_path, hub, folder, ["--to", "bf16"])


@pytest.mark.parametrize(
    "schemes, options",
    [
        (
            {**dict.fromkeys(["q_proj", "k_proj", "v_proj", "o_proj"], "fp8"), "mlp.gate_proj": "nvfp4"},
            ["--to", "bf16"],
        ),
        ({"proj": "mxfp4"}, ["--blocks", "128x128"]),
        (
            {**dict.fromkeys(["q_proj", "k_proj", "v_proj", "o_proj"], "mxfp4"), "_proj": "fp8"},  # (first key wins)
            ["--to", "e4m3fnuz"],
        ),
    ],
    ids=["fp8-nvfp4-to-bf16", "mxfp4-to-block128", "mxfp4-passes-through-fnuz"],
)
def test_fp4_modules_stream(tmp_path: Path, hub: FakeHub, schemes: dict[str, str], options: list[str]) -> None:
    """FP4 modules (issue 49), their scales and global scales mostly in other shards than their packed weights:
    Hub to Hub under --max-disk lands what a local conversion writes."""
    model = llama(hidden=256, heads=2, kv_heads=1, intermediate=256)
    hub.files["org/src"] = folder = fp4_compressed_tensors(tmp_path / "served", schemes, model, files=3)
    assert_streams_as_local(tmp_path, hub, folder, options)


@pytest.mark.parametrize("options", [["--to", "bf16"], ["--to", "e4m3fnuz"]])
def test_deepseek_v4_streams(tmp_path: Path, hub: FakeHub, options: list[str]) -> None:
    """DeepSeek-V4 (issue 49): its experts written in BF16, or passed through beside e4m3fnuz block FP8, their
    `.scale` tensors in other shards: Hub to Hub under --max-disk lands what a local conversion writes."""
    hub.files["org/src"] = folder = deepseek_v4(tmp_path / "served", layers=2, files=3)
    assert_streams_as_local(tmp_path, hub, folder, options)


@pytest.mark.parametrize("modelopt", [False, True], ids=["compressed-tensors", "modelopt"])
def test_nvfp4_shared_global_scales_stream(tmp_path: Path, hub: FakeHub, modelopt: bool) -> None:
    """NVFP4 q / k / v and gate / up whose global scales differ (issue 49), given one per packed layer by the
    default conversion, their scales and the shared global scale in other shards than their packed weights: Hub to
    Hub under --max-disk lands what a local conversion writes."""
    model = llama(hidden=256, heads=2, kv_heads=1, intermediate=256)
    if modelopt:
        folder = modelopt_nvfp4(tmp_path / "served", model, shared_global=False)
    else:
        folder = fp4_compressed_tensors(tmp_path / "served", {"proj": "nvfp4"}, model, files=3, shared_global=False)
    hub.files["org/src"] = folder
    assert_streams_as_local(tmp_path, hub, folder, [])


def test_a_resumed_nvfp4_shared_stream_reports_as_one_run(tmp_path: Path, hub: FakeHub) -> None:
    """The figures of NVFP4 modules moved to a shared global scale (issue 49) in the shards a cut run uploaded
    are read back from its records: the resumed run's card is a single run's."""
    model = llama(hidden=256, heads=2, kv_heads=1, intermediate=256)
    folder = fp4_compressed_tensors(tmp_path / "served", {"proj": "nvfp4"}, model, files=3, shared_global=False)
    hub.files["org/src"] = folder
    env = env_for(tmp_path, hub)
    hub.fail_commit_after = 2
    cut = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", env=env)
    assert cut.returncode == 4, cut.stderr
    hub.fail_commit_after = None
    again = fp8fix("convert", "org/src", "--push-to-hub", "me/dst", env=env)
    assert again.returncode == 0 and "2 already on the Hub" in again.stdout, again.stdout + again.stderr
    main = hub.tree("me/dst")
    assert main == local_reference(tmp_path, env) and b"groups of 16 keep every value exactly" in main["README.md"]

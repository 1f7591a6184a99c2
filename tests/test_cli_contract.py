"""What the command line promises a CI script: exit statuses that survive pipes, JSON on every outcome,
options that do something or are refused, error lines that name the argument (issue 27)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import build, phi3
from tests.conftest import patch_bytes, read_raw_header, run_cli, shard_files


def closed_stdout(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m fp8fix ARGS` whose stdout is a pipe closed before the first write: what `| head` does
    to a command whose output comes after the reader left."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "fp8fix", *map(str, args)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            cwd=cwd,
        )
    finally:
        os.close(write)


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, Path]:
    """A conversion with one changed code: verify must fail."""
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--format", "keep", "-q").exit_code == 0
    name = "model.layers.0.mlp.down_proj.weight"
    header, data = read_raw_header(out / shard_files(out)[name])
    patch_bytes(out, name, {5: data[header[name]["data_offsets"][0] + 5] ^ 1})
    return src, out


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_failing_verify_fails_through_a_closed_pipe(damaged: tuple[Path, Path], json_flag: list[str]) -> None:
    result = closed_stdout("verify", *damaged, *json_flag)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_a_passing_verify_passes_through_a_closed_pipe(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "-q").exit_code == 0
    result = closed_stdout("verify", src, out)
    assert result.returncode == 0 and result.stderr == ""


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_inspect_strict_fails_through_a_closed_pipe(tmp_path: Path, json_flag: list[str]) -> None:
    src = build(tmp_path / "src", phi3())  # single-scale fused modules: a finding convert fixes
    assert closed_stdout("inspect", src, "--strict", *json_flag).returncode == 1


def test_an_error_keeps_its_code_through_a_closed_pipe(tmp_path: Path) -> None:
    result = closed_stdout("inspect", tmp_path / "missing", "--json")
    assert result.returncode not in (0, 70), result.stderr
    assert "Traceback" not in result.stderr


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "phi3-tiny-fp8"


def fp8fix(*args: str | Path, cwd: Path | None = None, **env_vars: str) -> subprocess.CompletedProcess[str]:
    """`python -m fp8fix ARGS`, its Hub a closed port on 127.0.0.1 (and HF_HUB_OFFLINE only if given)."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "fp8fix", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "args",
    [
        ["convert", EXAMPLE, "OUT", "--layout", "fuzed"],
        ["convert", EXAMPLE, "OUT", "--no-such-option"],
        ["inspect", EXAMPLE, "--tp", "zero"],
        ["verify", EXAMPLE],
        ["convert", EXAMPLE, "OUT", "--private"],
        ["inspect", EXAMPLE, "-q", "-v"],
    ],
)
def test_json_on_every_usage_error(tmp_path: Path, args: list[str | Path]) -> None:
    """One JSON document on stdout, exit 2, whatever found the mistake (click's parsing or fp8fix)."""
    args = [tmp_path / "out" if a == "OUT" else a for a in args]
    result = fp8fix(*args, "--json")
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["exit_code"] == 2 and error["message"] and error["message"] in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--private"], "--private"),
        (["--create-pr"], "--create-pr"),
        (["--commit-size", "1GB"], "--commit-size"),
        (["--commit-message", "hello"], "--commit-message"),
        (["--private", "--create-pr"], "--private, --create-pr"),
    ],
)
def test_push_options_without_a_push_are_refused(tmp_path: Path, flags: list[str], named: str) -> None:
    result = fp8fix("convert", EXAMPLE, tmp_path / "out", *flags)
    assert result.returncode == 2 and named in result.stderr and "--push-to-hub" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["inspect", EXAMPLE], ["convert", EXAMPLE, "OUT"], ["verify", EXAMPLE, EXAMPLE]])
def test_quiet_and_verbose_together_are_refused(tmp_path: Path, command: list[str | Path]) -> None:
    result = fp8fix(*[tmp_path / "out" if a == "OUT" else a for a in command], "-q", "-v")
    assert result.returncode == 2 and "-q and -v" in result.stderr


def test_errors_about_output_name_output(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    result = fp8fix("convert", EXAMPLE, tmp_path / "out")
    assert result.returncode == 2 and result.stderr.startswith(f"Error: OUTPUT {tmp_path / 'out'}: exists")


def test_push_of_a_missing_folder_is_no_such_folder(tmp_path: Path) -> None:
    result = fp8fix("push", "me/model", "nofolder", cwd=tmp_path)
    assert result.returncode == 2 and "FOLDER nofolder: no such folder" in result.stderr


@pytest.mark.parametrize("offline", [False, True])
def test_a_relative_source_from_elsewhere_says_no_such_folder(tmp_path: Path, offline: bool) -> None:
    """`inspect examples/phi3-tiny-fp8` run from another folder: could be a Hub repo id too; the error says
    there is no such folder, and why the Hub did not answer (HF_HUB_OFFLINE only when it is set)."""
    offline_env = {"HF_HUB_OFFLINE": "1"} if offline else {}
    result = fp8fix("inspect", "examples/phi3-tiny-fp8", cwd=tmp_path, **offline_env)
    assert result.returncode == 4, result.stderr
    line = result.stderr.strip()
    assert line.startswith("Error: SOURCE examples/phi3-tiny-fp8: no such folder") and "\n" not in line
    assert ("HF_HUB_OFFLINE is set" in line) == offline  # named only when it is set
    assert ("network error reaching the Hub" in line) == (not offline)


@pytest.mark.parametrize(
    "args, message",
    [
        (["verify", EXAMPLE, "me/dst", "--jobs", "2"], "--jobs applies to a local OUTPUT"),
        (
            ["convert", "org/src", "--push-to-hub", "me/dst", "--jobs", "2"],
            "--jobs applies to a conversion into OUTPUT",
        ),
    ],
)
def test_jobs_where_one_process_runs_is_refused(args: list[str | Path], message: str) -> None:
    """A Hub OUTPUT is verified, and a stream written, one shard at a time: --jobs given there did nothing
    (issue 27, options without effect); refused before any Hub request (the Hub here is a closed port)."""
    result = fp8fix(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr

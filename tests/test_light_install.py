"""`pip install fp8fix` brings no torch, and every command works without it (issue 26).

The wheel is built with setuptools' backend and installed into a fresh venv with pip, its
dependencies resolved from the package index as a new user gets them. In that venv: torch cannot
be imported, the venv stays small, and convert (layouts, `--to`, requantization), inspect, verify
and a conversion of a Hub repo (from the test Hub server) all work, writing the same bytes as this
environment's fp8fix with torch. The one path that uses torch, verify's float check of rows no
byte map explains, says in one line which extra to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import build, phi3
from tests.conftest import folder_digest, patch_bytes, read_raw_header, shard_files
from tests.distributions import ROOT, build_distributions
from tests.hub_server import FakeHub
from tests.test_experts import build_llama4

pytestmark = pytest.mark.heavy

#: The core install's size on disk, pip and the venv's own files included.
VENV_LIMIT = 200 * 1024**2


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the built wheel and its declared dependencies, nothing else; its bin folder."""
    out, tree_copy = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("src")
    _, wheel = build_distributions(out, tree_copy)
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    return venv / "bin"


def light(venv_bin: Path, *args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """fp8fix, as the light venv's console script runs it."""
    environment = env or {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(
        [venv_bin / "fp8fix", *map(str, args)], capture_output=True, text=True, env=environment, cwd=ROOT
    )


def test_the_core_install_has_no_torch_and_is_small(light_venv: Path) -> None:
    probe = subprocess.run([light_venv / "python", "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    size = sum(p.stat().st_size for p in light_venv.parent.rglob("*") if p.is_file() and not p.is_symlink())
    assert size < VENV_LIMIT, f"the core install takes {size / 1024**2:.0f} MB"


@pytest.mark.parametrize(
    "options",
    [
        [],  # the default: the shipped example as compressed-tensors
        ["--format", "keep", "--layout", "unfused"],
        ["--format", "keep", "--to", "e4m3fnuz"],
        ["--layout", "fused", "--to", "e4m3fnuz"],
    ],
)
def test_convert_inspect_and_verify_without_torch(light_venv: Path, tmp_path: Path, options: list[str]) -> None:
    example = ROOT / "examples" / "phi3-tiny-fp8"
    out = tmp_path / "out"
    proc = light(light_venv, "convert", example, out, "-q", "--verify", *options)
    assert proc.returncode == 0, proc.stderr
    assert light(light_venv, "inspect", out).returncode == 0
    assert light(light_venv, "verify", example, out, "-q").returncode == 0
    # the bytes fp8fix writes do not depend on torch being there
    with_torch = subprocess.run(
        [sys.executable, "-m", "fp8fix", "convert", example, tmp_path / "ref", "-q", "--verify", *options],
        capture_output=True,
        text=True,
    )
    assert with_torch.returncode == 0, with_torch.stderr
    assert folder_digest(out) == folder_digest(tmp_path / "ref")


def test_requantized_shards_convert_and_verify_without_torch(light_venv: Path, tmp_path: Path) -> None:
    """Per-shard scales written as one fused scale: every shard but the largest is requantized, and
    verify checks those rows as bytes against the requantization map, no floats."""
    src = build(tmp_path / "src", phi3(), scale="shard")
    proc = light(light_venv, "convert", src, tmp_path / "out", "-q", "--layout", "fused", "--format", "keep")
    assert proc.returncode == 0, proc.stderr
    check = light(light_venv, "verify", src, tmp_path / "out", "--json")
    assert check.returncode == 0, check.stderr
    assert '"requantized"' in check.stdout


def test_the_float_check_asks_for_the_torch_extra(light_venv: Path, tmp_path: Path) -> None:
    """A requantized code one step off fp8fix's rounding (another tool's, or a corruption) is checked in
    floats with torch: without torch that is one line naming the extra, exit 3, no traceback; with
    torch the same check reports the mismatch (exit 1)."""
    src = build(tmp_path / "src", phi3(), scale="shard")
    out = tmp_path / "out"
    assert light(light_venv, "convert", src, out, "-q", "--layout", "fused", "--format", "keep").returncode == 0
    weight = "model.layers.0.self_attn.qkv_proj.weight"
    header, data = read_raw_header(out / shard_files(out)[weight])
    begin, _ = header[weight]["data_offsets"]
    code = data[begin]  # q_proj's first row: requantized (the builder gives q the smallest scale)
    patch_bytes(out, weight, {0: code ^ 0x01 if code & 0x7F not in (0x7E, 0x7F) else code - 1})
    proc = light(light_venv, "verify", src, out)
    assert proc.returncode == 5, proc.stderr  # environment: an extra to install
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("Error: verify: checking 'model.layers.0.self_attn.qkv_proj.weight'") and (
        "pip install 'fp8fix[torch]'" in line
    ), line
    with_torch = subprocess.run([sys.executable, "-m", "fp8fix", "verify", src, out], capture_output=True, text=True)
    assert with_torch.returncode == 1 and "qkv_proj" in with_torch.stdout + with_torch.stderr


def test_a_hub_repo_converts_without_torch(light_venv: Path, tmp_path: Path) -> None:
    hub = FakeHub().start()
    try:
        hub.files["org/remote"] = build(tmp_path / "served", phi3())
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_XET="1", HF_ENDPOINT=hub.url)
        proc = light(light_venv, "convert", "org/remote", tmp_path / "out", "-q", "--verify", env=env)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "out" / "config.json").is_file()
    finally:
        hub.stop()


@pytest.mark.parametrize("scale", ["channel", "shard", "expert"])
def test_stacked_experts_verify_without_torch(light_venv: Path, tmp_path: Path, scale: str) -> None:
    """Llama-4's stacked experts: every (expert, column) scale grid is compared with numpy, and the codes
    as bytes; torch was needed for the grids before."""
    src = build_llama4(tmp_path / "src", scale)
    proc = light(light_venv, "convert", src, tmp_path / "out", "-q", "--to", "e4m3fnuz", "--verify")
    assert proc.returncode == 0, proc.stderr
    assert light(light_venv, "verify", src, tmp_path / "out", "-q").returncode == 0

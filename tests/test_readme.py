"""The README's "Use in CI" and "Use from Python" examples, run as they stand: every fenced block that
follows a `<!-- readme-test: bash|python -->` marker, in a fresh folder holding the shipped example."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- readme-test: (bash|python) -->\n```(?:bash|python)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_the_readme_has_its_tested_examples() -> None:
    kinds = [kind for kind, _ in blocks()]
    assert kinds.count("bash") >= 1 and kinds.count("python") >= 2


@pytest.mark.parametrize("index", range(len(blocks())))
def test_a_readme_example_runs(tmp_path: Path, index: int) -> None:
    kind, code = blocks()[index]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `fp8fix` and `python`
    env["HF_HUB_OFFLINE"] = "1"
    command = ["bash", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README {kind} example {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"

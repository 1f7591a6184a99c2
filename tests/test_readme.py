"""The README's and docs/' examples, run as they stand, in a fresh folder holding the shipped example: every fenced
block that follows a `<!-- readme-test: bash|python -->` marker runs and exits 0; every `console` block
after `<!-- readme-test: console [SETUP] -->` is output its `$ ` commands really print (issue 27: samples
had drifted from the tool), compared line by line after the folder's path is taken out, a `...` line
standing for lines left out. SETUP names a checkpoint the block's command reads, built first."""

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


CONSOLE = re.compile(r"<!-- readme-test: console ?([\w-]*) -->\n```console\n(.*?)```", re.S)


#: The README and the reference pages (docs/, built by MkDocs).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(text())


def console_blocks() -> list[tuple[str, str]]:
    return CONSOLE.findall(text())


def _deepseek_r1_shaped(folder: Path) -> None:
    from tests.test_parallel import deepseek_dense

    deepseek_dense(folder / "DeepSeek-R1-shaped")


#: Checkpoints a console block's command reads, besides the shipped example.
SETUPS = {"deepseek-r1-shaped": _deepseek_r1_shaped}


def readme_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "COLUMNS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `fp8fix` and `python`
    env["HF_HUB_OFFLINE"] = "1"
    return env


def printed(commands: list[str], folder: Path) -> list[str]:
    """What the commands print (stdout and stderr), each line without trailing spaces, `folder` left out."""
    lines = []
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", command], cwd=folder, env=readme_env(), capture_output=True, text=True, timeout=600
        )
        lines.append(f"$ {command}")
        lines += (proc.stdout + proc.stderr).replace(f"{folder}/", "").replace(str(folder), ".").splitlines()
    return [line.rstrip() for line in lines]


def matches(expected: list[str], actual: list[str]) -> bool:
    """`expected`'s runs of lines between `...` lines appear in `actual` in order, each run contiguous;
    without a `...` at an end, the first (last) run is where `actual` starts (ends)."""
    runs, run = [], []
    for line in expected:
        if line == "...":
            runs.append(run)
            run = []
        else:
            run.append(line)
    runs.append(run)
    at = 0
    for i, run in enumerate(runs):
        if not run:
            continue
        found = next((j for j in range(at, len(actual) - len(run) + 1) if actual[j : j + len(run)] == run), None)
        if found is None or (i == 0 and found != 0):
            return False
        at = found + len(run)
    return not runs[-1] or at == len(actual)


def test_the_readme_has_its_tested_examples() -> None:
    kinds = [kind for kind, _ in blocks()]
    assert kinds.count("bash") >= 1 and kinds.count("python") >= 2
    # every console sample is compared with what its commands print
    assert text().count("```console") == len(console_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(console_blocks())))
def test_a_readme_console_sample_is_what_the_commands_print(tmp_path: Path, index: int) -> None:
    setup, sample = console_blocks()[index]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    if setup:
        SETUPS[setup](tmp_path)
    expected = [line.rstrip() for line in sample.splitlines()]
    commands = [line[2:] for line in expected if line.startswith("$ ")]
    actual = printed(commands, tmp_path)
    assert matches(expected, actual), "README sample:\n" + "\n".join(expected) + "\n\nprinted:\n" + "\n".join(actual)


def test_the_sample_matcher() -> None:
    assert matches(["a", "...", "c"], ["a", "b", "c"]) and matches(["a", "..."], ["a", "b"])
    assert not matches(["a", "c"], ["a", "b", "c"]) and not matches(["b", "..."], ["a", "b"])
    assert not matches(["...", "b"], ["b", "c"]) and matches(["...", "b", "..."], ["a", "b", "c"])


@pytest.mark.parametrize("index", range(len(blocks())))
def test_a_readme_example_runs(tmp_path: Path, index: int) -> None:
    kind, code = blocks()[index]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    command = ["bash", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
    proc = subprocess.run(command, cwd=tmp_path, env=readme_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README {kind} example {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    """The README says what fp8fix fixes, the two commands, the common uses, and links to the reference
    (issue 27: it was 994 lines); every page of docs/ is in MkDocs' nav, every README link exists."""
    import yaml

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and all((ROOT / link).exists() for link in links if not link.startswith("http")), links
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = {page for entry in nav for page in entry.values()}
    assert pages == {p.name for p in (ROOT / "docs").glob("*.md")}

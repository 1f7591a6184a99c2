"""Building fp8fix's sdist and wheel with setuptools' own PEP 517 backend, for the packaging tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The folder is read before building: setuptools' backend rewrites sys.argv while it builds.
BUILD = "import sys; from setuptools import build_meta as b; out = sys.argv[1]; b.build_sdist(out); b.build_wheel(out)"


def build_distributions(out: Path, tree_copy: Path) -> tuple[Path, Path]:
    """(sdist, wheel) built into `out` from a copy of the tree in `tree_copy`: setuptools builds in
    ./build, whose stale files would otherwise reach the wheel."""
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "mkdocs.yml"):
        shutil.copy(ROOT / name, tree_copy / name)
    for folder in ("fp8fix", "tests", "examples", "scripts", "docs"):
        shutil.copytree(ROOT / folder, tree_copy / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=tree_copy, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(out.glob("*.tar.gz")), next(out.glob("*.whl"))

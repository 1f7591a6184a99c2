#!/usr/bin/env python3
"""The lowest version of each runtime dependency pyproject.toml declares, as pins for pip (issue 27).

    pip install $(python scripts/lowest_versions.py) torch==2.13.0 pytest && pip install --no-deps .

CI installs the sdist with these and runs its tests: a bound that no longer holds fails there, not at a
user's. Every dependency must be declared `name>=version` (a bound CI can test).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
LOWER_BOUND = re.compile(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)")


def lowest_pins(pyproject: Path = PYPROJECT) -> list[str]:
    pins = []
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        found = LOWER_BOUND.fullmatch(requirement.strip())
        if found is None:
            raise SystemExit(f"{requirement!r}: declare runtime dependencies as name>=version (CI tests the bound)")
        pins.append(f"{found.group(1)}=={found.group(2)}")
    return pins


if __name__ == "__main__":
    print("\n".join(lowest_pins()))
    sys.exit(0)

"""Conversions where the platform lacks `os.copy_file_range` (macOS, Windows, an old glibc) or `os.preadv`,
or where the kernel refuses the copy at run time (across file systems): the same bytes, by plain reads
and writes (issue 27)."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import build, phi3
from tests.conftest import folder_digest

WITHOUT = """
import os, sys
for name in sys.argv[1].split(","):
    if name:
        delattr(os, name)
sys.argv = ["fp8fix", *sys.argv[2:]]
from fp8fix.entry import run
run()
"""

CONVERSIONS = [
    ["--format", "keep"],  # bytes copied as they are, scales split
    ["--to", "e4m3fnuz", "--layout", "fused"],  # codes recoded, fused shards requantized
    [],  # compressed-tensors: the same codes, new names
]


def fp8fix_without(missing: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, missing, *map(str, args)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("options", CONVERSIONS, ids=["keep", "fnuz", "compressed-tensors"])
@pytest.mark.parametrize("missing", ["copy_file_range", "preadv", "copy_file_range,preadv"])
def test_the_same_output_without_the_calls(tmp_path: Path, options: list[str], missing: str) -> None:
    src = build(tmp_path / "src", phi3(hidden=256, intermediate=1024), scale="shard", files=2)
    reference = fp8fix_without("", "convert", src, tmp_path / "ref", "-q", *options)
    assert reference.returncode == 0, reference.stderr
    result = fp8fix_without(missing, "convert", src, tmp_path / "out", "-q", *options)
    assert result.returncode == 0, result.stderr
    assert folder_digest(tmp_path / "out") == folder_digest(tmp_path / "ref")
    checked = fp8fix_without(missing, "verify", src, tmp_path / "out", "-q")
    assert checked.returncode == 0, checked.stderr + checked.stdout


@pytest.mark.parametrize("code", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_copy_the_kernel_refuses_is_done_by_reads(tmp_path: Path, code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_file_range present but failing at run time, as across file systems: the bytes still arrive."""
    from fp8fix import api
    from fp8fix.io import writer

    calls: list[int] = []

    def refuses(src: int, dst: int, count: int, offset: int) -> int:
        calls.append(count)
        raise OSError(code, "refused")

    src = build(tmp_path / "src", phi3(hidden=256, intermediate=1024), files=2)
    api.convert(src, tmp_path / "ref", output_format="keep")
    monkeypatch.setattr(writer, "COPY_FILE_RANGE", refuses)
    api.convert(src, tmp_path / "out", output_format="keep")
    assert calls, "the copy was never tried"
    assert folder_digest(tmp_path / "out") == folder_digest(tmp_path / "ref")

"""Mutation testing of fp8fix's numerics and of verify: how many planted bugs do the tests catch?

Issue 25: three properties verify did not establish were found by changing its code and seeing no
test fail. This runs mutmut (`pip install mutmut==3.8.1`) over `fp8fix/numerics/` and/or
`fp8fix/verification/` in a copy of the tracked tree (mutmut writes `mutants/` beside the code), with
the tests that exercise them, and prints the score and every mutant that survived, to be justified
(README "Mutation testing") or killed by a new test.

    python scripts/mutation_score.py numerics              # about 10 minutes on 2 cores
    python scripts/mutation_score.py verification --max-children 2
    python scripts/mutation_score.py numerics --keep /tmp/mut   # keep the copy (mutmut show NAME there)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The tests that exercise each package (mutmut runs, for each mutant, those of them that reach it).
TESTS = {
    "numerics": [
        "tests/test_transforms.py",
        "tests/test_verify.py",
        "tests/test_verify_witness.py",
        "tests/test_rocm.py",
        "tests/test_convert_layouts.py",
        "tests/test_padding.py",  # --tp-bf16: numerics/dequantize.py
        "tests/test_channel.py",
        "tests/test_experts.py",
    ],
    "verification": [
        "tests/test_verify.py",
        "tests/test_verify_witness.py",
        "tests/test_hostile_repos.py",
        "tests/test_rocm.py",
        "tests/test_padding.py",
        "tests/test_experts.py",
        "tests/test_channel.py",
        "tests/test_compressed_tensors.py",
        "tests/test_convert_layouts.py",
        "tests/test_grouped.py",
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", choices=sorted(TESTS))
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--timeout-multiplier", type=float, default=3.0)
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="fp8fix-mutants-"))
    try:
        _copy_tree(work)
        config = (
            "\n[tool.mutmut]\n"
            'source_paths = ["fp8fix/"]\n'
            f'only_mutate = ["fp8fix/{args.package}/*"]\n'
            f"pytest_add_cli_args_test_selection = {json.dumps(TESTS[args.package])}\n"
            # A mutant whose tests run over 3x their clean time counts as caught (timed out): mutmut's
            # default, 15x, spends a minute or more on each of the loops a mutant makes endless.
            f"timeout_multiplier = {args.timeout_multiplier}\n"
        )
        with open(work / "pyproject.toml", "a", encoding="utf-8") as f:
            f.write(config)
        mutmut = [sys.executable, "-m", "mutmut"]
        subprocess.run([*mutmut, "run", "--max-children", str(args.max_children)], cwd=work, check=False)
        subprocess.run([*mutmut, "export-cicd-stats"], cwd=work, check=True)
        stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
        survivors = subprocess.run([*mutmut, "results"], cwd=work, capture_output=True, text=True).stdout
        killed, total = stats["killed"], stats["total"]
        print(f"\nfp8fix/{args.package}: {killed} of {total} mutants killed ({100 * killed / max(total, 1):.1f}%)")
        print(json.dumps(stats))
        print("not killed:\n" + survivors)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _copy_tree(work: Path) -> None:
    """The tracked files of this checkout, as they are in the working tree."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in files.splitlines():
        target = work / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


if __name__ == "__main__":
    sys.exit(main())

"""Mutation testing of fp8fix's numerics and of verify: how many planted bugs do the tests catch?

Issue 25: three properties verify did not establish were found by changing its code and seeing no
test fail. This runs mutmut (`pip install mutmut==3.8.1`) over `fp8fix/numerics/` and/or
`fp8fix/verification/` in a copy of the tracked tree (mutmut writes `mutants/` beside the code), with
the tests that exercise them, and prints the score and every mutant that survived, to be justified
(docs/development.md, "Mutation testing") or killed by a new test.

    python scripts/mutation_score.py numerics --recheck-timeouts   # an hour or more on 2 cores
    python scripts/mutation_score.py verification --max-children 2
    python scripts/mutation_score.py numerics --keep /tmp/mut   # keep the copy (mutmut show NAME there)
    python scripts/mutation_score.py numerics --recheck-only /tmp/mut   # recheck a kept run's timeouts
    python scripts/mutation_score.py verification --sample 200 --seed 0   # a random draw: an estimate
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
        "tests/test_verify_records.py",  # records, summary and exit code from what was measured
        "tests/test_verify_card.py",  # the model card's facts, --accept-edits
        "tests/test_verify_measures.py",  # errors, counts and names verify reports, stated from the files
        "tests/test_quark_layer_settings.py",  # Quark's layer_quant_config keys
        "tests/test_ue8m0.py",  # --scales ue8m0 (verification/ue8m0.py)
        "tests/test_formats.py",  # name lists of every format, ModelOpt's side config renamed
        "tests/test_hostile_repos.py",
        "tests/test_rocm.py",
        "tests/test_padding.py",
        "tests/test_experts.py",
        "tests/test_channel.py",
        "tests/test_compressed_tensors.py",
        "tests/test_convert_layouts.py",
        "tests/test_grouped.py",
        "tests/test_output.py",  # progress lines
        "tests/test_streaming.py",  # verify of Hub repos (verification/remote.py)
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", choices=sorted(TESTS))
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--timeout-multiplier", type=float, default=3.0)
    parser.add_argument(
        "--timeout-constant", type=float, default=60.0, help="seconds added to each mutant's estimated test time"
    )
    parser.add_argument("--recheck-timeouts", action="store_true", help="run each timed-out mutant again alone")
    parser.add_argument("--recheck-limit", type=float, default=600.0, help="wall seconds per recheck")
    parser.add_argument("--recheck-only", type=Path, help="recheck the timeouts of a kept run in this folder; no run")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument("--sample", type=int, help="test this many mutants drawn at random, not all of them")
    parser.add_argument("--seed", type=int, default=0, help="of the --sample draw")
    args = parser.parse_args()
    if args.recheck_only:
        recheck_timeouts(args.recheck_only, TESTS[args.package], args.recheck_limit)
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="fp8fix-mutants-"))
    try:
        _copy_tree(work)
        config = (
            "\n[tool.mutmut]\n"
            'source_paths = ["fp8fix/"]\n'
            'also_copy = ["examples/"]\n'  # the shipped example some tests convert
            f'only_mutate = ["fp8fix/{args.package}/*"]\n'
            f"pytest_add_cli_args_test_selection = {json.dumps(TESTS[args.package])}\n"
            # A mutant whose tests run over 3x their clean time counts as caught (timed out): mutmut's
            # default, 15x, spends a minute or more on each of the loops a mutant makes endless.
            f"timeout_multiplier = {args.timeout_multiplier}\n"
            # mutmut estimates a mutant's test time from the tests' call phases only: the checkpoints
            # their fixtures build and convert are not in it, so a small estimate made runs that would
            # have failed or passed time out instead. The constant covers that setup.
            f"timeout_constant = {args.timeout_constant}\n"
        )
        with open(work / "pyproject.toml", "a", encoding="utf-8") as f:
            f.write(config)
        mutmut = [sys.executable, "-m", "mutmut"]
        run = [*mutmut, "run", "--max-children", str(args.max_children)]
        if args.sample:
            # mutants and per-test coverage, no mutant tested (mutmut stops at a name no mutant has)
            if not (work / "mutants" / "mutmut-stats.json").exists():
                subprocess.run([*run, "fp8fix.no_such_mutant"], cwd=work, check=False, capture_output=True)
            everyone = sorted(exit_codes(work))
            names = random.Random(args.seed).sample(everyone, min(args.sample, len(everyone)))
            verdicts = run_sample(work, names, args.recheck_limit, args.max_children)
            report_sample(verdicts, len(everyone), args)
            return 0
        subprocess.run(run, cwd=work, check=False)
        subprocess.run([*mutmut, "export-cicd-stats"], cwd=work, check=True)
        stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
        survivors = subprocess.run([*mutmut, "results"], cwd=work, capture_output=True, text=True).stdout
        killed, total = stats["killed"], stats["total"]
        print(f"\nfp8fix/{args.package}: {killed} of {total} mutants killed ({100 * killed / max(total, 1):.1f}%)")
        print(json.dumps(stats))
        print("not killed:\n" + survivors)
        if args.recheck_timeouts:
            recheck_timeouts(work, TESTS[args.package], args.recheck_limit)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def exit_codes(work: Path) -> dict[str, int | None]:
    """Every mutant's exit code from mutmut's per-file results (None: not tested yet)."""
    codes: dict[str, int | None] = {}
    for meta in sorted((work / "mutants").rglob("*.meta")):
        codes.update(json.loads(meta.read_text()).get("exit_code_by_key", {}))
    return codes


def timed_out(work: Path) -> list[str]:
    """The mutants mutmut stopped at its CPU-time limit (SIGXCPU), from its per-file results."""
    return [name for name, code in exit_codes(work).items() if code in (-24, 24, 152)]


def run_sample(work: Path, names: list[str], limit: float, workers: int) -> dict[str, str]:
    """Each mutant's verdict: its covering tests (from mutmut's stats) run fastest first with `pytest -x`,
    `workers` mutants at a time, each within `limit` wall seconds: killed (a test failed), survived (all
    passed), timeout, or no tests. Faster than `mutmut run` here: it runs a mutant's tests in no useful
    order and stops them at a CPU-time limit that leaves out fixture setup, so a mutant of verify, whose
    tests convert checkpoints in fixtures, often ran minutes before timing out."""
    from concurrent.futures import ThreadPoolExecutor

    stats = json.loads((work / "mutants" / "mutmut-stats.json").read_text())
    tests_of, durations = stats["tests_by_mangled_function_name"], stats["duration_by_test"]

    def verdict(name: str) -> str:
        tests = sorted(tests_of.get(name.rsplit("__mutmut_", 1)[0], []), key=lambda t: (durations.get(t, 0.0), t))
        if not tests:
            return "no tests"
        env = {**os.environ, "MUTANT_UNDER_TEST": name}
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
        try:
            done = subprocess.run(command, cwd=work / "mutants", env=env, capture_output=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return "timeout"
        return "survived" if done.returncode == 0 else "killed"

    with ThreadPoolExecutor(workers) as pool:
        verdicts = dict(zip(names, pool.map(verdict, names), strict=True))
    for name, found in verdicts.items():
        print(f"{name}: {found}", flush=True)
    return verdicts


def report_sample(verdicts: dict[str, str], population: int, args: argparse.Namespace) -> None:
    """The sample's verdicts, the score they estimate with a 95% Wilson interval, and every mutant not
    killed. A package of thousands of mutants, each running conversions for seconds, takes hours on two
    cores: a uniform random draw estimates its score without bias, and its survivors are a fair sample of
    the tests' gaps. "no tests" (code only `--jobs` workers run, which mutmut's in-process coverage does
    not see) and timeouts count as not killed."""
    by_verdict: dict[str, list[str]] = {}
    for name, found in verdicts.items():
        by_verdict.setdefault(found, []).append(name)
    killed, n = len(by_verdict.get("killed", [])), len(verdicts)
    low, high = _wilson(killed, n)
    print(
        f"\nfp8fix/{args.package}: a sample of {n} of {population} mutants (seed {args.seed}): {killed} killed, "
        f"score {100 * killed / max(n, 1):.1f}% (95% interval {100 * low:.1f}-{100 * high:.1f}%)"
    )
    print(json.dumps({found: len(names) for found, names in sorted(by_verdict.items())}))
    for found, names in sorted(by_verdict.items()):
        if found != "killed":
            print("\n".join(f"{found}: {name}" for name in names))


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)


def recheck_timeouts(work: Path, tests: list[str], limit: float) -> None:
    """Run each timed-out mutant's tests again, alone, in file order, stopping at the first failure.

    mutmut stops a mutant's test run at a CPU-time limit it derives from the clean run. Here some runs
    hit it before reaching a test that fails: `steps_at` made to raise TypeError on its first call timed
    out at 96 s, and `pytest -x tests/test_transforms.py` kills it in 5 s. So a timeout is not counted
    as caught: each is run again alone, in the selection's file order, and becomes killed or survived
    (or stays a timeout past `limit` wall seconds)."""
    verdicts: dict[str, list[str]] = {"killed": [], "survived": [], "timeout": []}
    for name in timed_out(work):
        env = {**os.environ, "MUTANT_UNDER_TEST": name}
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        try:
            code = subprocess.run(command, cwd=work / "mutants", env=env, capture_output=True, timeout=limit).returncode
            verdicts["survived" if code == 0 else "killed"].append(name)
        except subprocess.TimeoutExpired:
            verdicts["timeout"].append(name)
        print(f"{name}: {next(k for k, v in verdicts.items() if name in v)}", flush=True)
    print(json.dumps({k: len(v) for k, v in verdicts.items()}))
    for name in verdicts["survived"] + verdicts["timeout"]:
        print(f"not killed on recheck: {name}")


def _copy_tree(work: Path) -> None:
    """The tracked files of this checkout, as they are in the working tree."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in files.splitlines():
        target = work / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


if __name__ == "__main__":
    sys.exit(main())

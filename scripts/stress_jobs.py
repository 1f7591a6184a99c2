"""Stress `--jobs`: run the forked-worker paths of convert and verify many times and count hangs.

Issue 25 H6: `convert --jobs 2 --verify --to e4m3fnuz` hung in multiprocessing.Pool's terminate
about once in 650 runs. This runs that conversion (and a `verify --jobs 2` of its output) RUNS times
in one process that never imports torch (as the CLI does, so the workers really fork), each under
a watchdog: a run that takes longer than --limit seconds dumps every thread's stack and exits 1.

    python scripts/stress_jobs.py --runs 10000            # the issue's figure
    python scripts/stress_jobs.py --runs 200 --limit 30   # a quick look

It prints the runs done, the hangs (0, or it would have stopped) and the time per run.
"""

from __future__ import annotations

import argparse
import faulthandler
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fp8fix import api  # noqa: E402

EXAMPLE = ROOT / "examples" / "phi3-tiny-fp8"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="conversions to run (each also verified)")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds one run may take before it is a hang")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fp8fix-stress-"))
    try:
        source = Path(shutil.copytree(EXAMPLE, work / "src"))
        started = time.monotonic()
        for run in range(1, args.runs + 1):
            faulthandler.dump_traceback_later(args.limit, exit=True)  # a hang: stacks, then exit 1
            out = work / "out"
            result = api.convert(source, out, to="e4m3fnuz", jobs=args.jobs, verify=True, overwrite=True)
            assert result.verification is not None and result.verification.ok, result.verification
            assert api.verify(source, out, jobs=args.jobs).ok
            faulthandler.cancel_dump_traceback_later()
            if run % 500 == 0 or run == args.runs:
                elapsed = time.monotonic() - started
                print(f"{run} runs, 0 hangs, {elapsed:.0f} s ({1000 * elapsed / run:.0f} ms a run)", flush=True)
        assert "torch" not in sys.modules, "torch was imported: --jobs would not have forked"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

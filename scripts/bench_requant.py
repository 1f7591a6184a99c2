#!/usr/bin/env python3
"""Requantization speed per core: `numerics.requantize` (byte map + worst-error statistic) on realistic codes.

    python scripts/bench_requant.py                                  # this checkout
    python scripts/bench_requant.py --baseline /tmp/fp8fix-main      # and another, alternately, in one run

The codes are normal weights quantized to e4m3fn with an absmax scale (median |code| small, as exporters
write them), requantized from one scale to another; each checkout runs in its own process, alternately,
round by round (these machines are noisy): medians of the time for the whole call and for the statistic
alone, in GB/s of codes rewritten.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time
from fp8fix.numerics.requantize import requantize, requantize_map
codes = open(sys.argv[1], "rb").read()
table = requantize_map("F8_E4M3", 0.001, 0.0013, "F8_E4M3")
t = time.perf_counter(); requantize(codes, "F8_E4M3", 0.001, 0.0013); whole = time.perf_counter() - t
t = time.perf_counter(); table.worst(codes); worst = time.perf_counter() - t
print(whole, worst)
"""


def realistic_codes(path: Path, megabytes: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(megabytes << 20, generator=gen)
    path.write_bytes((w * (448 / w.abs().max())).to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another fp8fix checkout to time in the same run")
    args = parser.parse_args()
    checkouts = {"this": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "codes.bin"
        realistic_codes(data, args.megabytes)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in checkouts}
        for _ in range(args.repeats):
            for name, checkout in checkouts.items():
                env = {**os.environ, "PYTHONPATH": str(checkout)}
                child = [sys.executable, "-c", CHILD, str(data)]
                out = subprocess.run(child, env=env, cwd=tmp, capture_output=True, text=True, check=True).stdout.split()
                runs[name].append((float(out[0]), float(out[1])))
    gb = args.megabytes * (1 << 20) / 1e9
    print("| checkout | requantize GB/s (median) | worst-error statistic alone GB/s |")
    print("|---|---|---|")
    for name, found in runs.items():
        whole, worst = (statistics.median(r[i] for r in found) for i in range(2))
        print(f"| {name} | {gb / whole:.2f} | {gb / worst:.2f} |")


if __name__ == "__main__":
    main()

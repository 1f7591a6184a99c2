#!/usr/bin/env python3
"""Planning time against tensor count (issue 25 H5): header-only commands on one shard of N tensors.

    python scripts/bench_tensor_count.py                            # 10k, 20k, 40k tensors, this checkout
    python scripts/bench_tensor_count.py --baseline ../fp8fix-main   # and another checkout, in the same run
    python scripts/bench_tensor_count.py --counts 10000 40000 --repeats 5

Each checkpoint is one safetensors file of N/2 tiny e4m3fn weights with their F32 scales (a real header,
real bytes), so the time is fp8fix's own per-tensor work: `inspect --json` and `convert --dry-run`.
Checkouts run alternately, round by round (these machines are noisy); the table gives medians and the
ratio baseline / this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def checkpoint(root: Path, tensors: int) -> Path:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    body = bytearray()
    for i in range(tensors // 2):
        start = len(body)
        body += bytes(16) + struct.pack("<f", 0.01)
        header[f"model.layers.{i}.mlp.down_proj.weight"] = {
            "dtype": "F8_E4M3",
            "shape": [4, 4],
            "data_offsets": [start, start + 16],
        }
        header[f"model.layers.{i}.mlp.down_proj.weight_scale"] = {
            "dtype": "F32",
            "shape": [],
            "data_offsets": [start + 16, start + 20],
        }
    root.mkdir(parents=True)
    text = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bytes(body))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4,
        "num_hidden_layers": tensors // 2,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


def timed(checkout: Path, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()  # cwd too: `python -m` puts the working folder first on sys.path
    proc = subprocess.run(
        [sys.executable, "-m", "fp8fix", *args], env=env, cwd=checkout, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: fp8fix {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[10_000, 20_000, 40_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another fp8fix checkout to time in the same run")
    args = parser.parse_args()
    checkouts = {"this": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory() as tmp:
        print("| tensors | command | " + " | ".join(f"{k} (s, median)" for k in checkouts) + " | ratio |")
        print("|---|---|" + "---|" * len(checkouts) + "---|")
        for count in args.counts:
            src = checkpoint(Path(tmp) / f"n{count}", count)
            commands = {
                "inspect --json": ["inspect", str(src), "--json", "-q"],
                "convert --dry-run": ["convert", str(src), str(src) + "-out", "--dry-run", "-q"],
            }
            for label, command in commands.items():
                times: dict[str, list[float]] = {k: [] for k in checkouts}
                for _ in range(args.repeats):
                    for name, checkout in checkouts.items():  # alternately, round by round
                        times[name].append(timed(checkout, command))
                medians = {k: statistics.median(v) for k, v in times.items()}
                ratio = f"{medians['baseline'] / medians['this']:.1f}x" if "baseline" in medians else "-"
                cells = " | ".join(f"{m:.2f}" for m in medians.values())
                print(f"| {count:,} | {label} | {cells} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()

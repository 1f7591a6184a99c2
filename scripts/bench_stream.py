#!/usr/bin/env python3
"""Hub-to-Hub streaming against huggingface_hub moving the same bytes (issue 26).

    python scripts/bench_stream.py                          # 8 shards of 64 MiB, 3 rounds
    python scripts/bench_stream.py --shards 16 --shard-mib 128 --rounds 5 --max-disk-shards 4
    python scripts/bench_stream.py --latency 0.05          # every request answered 50 ms late (a far Hub)

A block-FP8 checkpoint (real headers, real e4m3fn codes, F32 128x128 scale grids) is served by the
test Hub (tests/hub_server.py) on 127.0.0.1, in this process. Each round, in turn:
- stream: `fp8fix convert org/src --push-to-hub me/dst --max-disk N` in a subprocess (default
  options: the same codes written as compressed-tensors), its wall time, peak RSS, and the peak
  disk of its working folder (sampled every 2 ms: st_blocks, so sparse stand-ins count as what
  they hold);
- baseline: huggingface_hub alone in a subprocess: every shard downloaded (hf_hub_download into a
  folder) and the same bytes uploaded (upload_folder) to another repo: the transfer floor.
The table gives medians and the ratio stream / baseline (issue 26's goal: <= 1.15).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from tests.builders import block_fp8_shards  # noqa: E402
from tests.disk_sampler import disk_sampler  # noqa: E402
from tests.hub_server import FakeHub  # noqa: E402

RSS_WRAPPER = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(code)
"""
BASELINE = """
import sys, tempfile
from pathlib import Path
from huggingface_hub import HfApi, hf_hub_download
api = HfApi()
files = [e.path for e in api.list_repo_tree("org/src", recursive=True)]
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as folder:
    for name in files:
        hf_hub_download("org/src", name, local_dir=folder)
    api.create_repo(sys.argv[2], exist_ok=True)
    api.upload_folder(repo_id=sys.argv[2], folder_path=folder, ignore_patterns=[".cache/*"])
"""


def timed(command: list[str], env: dict[str, str], watch: Path) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, peak bytes under `watch`) of `command`."""
    start = time.perf_counter()
    # Through a small wrapper, whose children's peak RSS is theirs alone: a child forked from this process
    # (which holds the test Hub's uploads) would report this process's pages as its own.
    wrapped = [sys.executable, "-c", RSS_WRAPPER, *command]
    with disk_sampler(watch) as samples:
        proc = subprocess.run(wrapped, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{command[:4]} failed:\n{proc.stderr[-2000:]}")
    return wall, int(proc.stdout.split()[-1]) * 1024, max(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-disk-shards", type=float, default=3.0, help="--max-disk in largest source shards")
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds the test Hub waits before each answer (a far Hub)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = block_fp8_shards(work / "src", args.shards, args.shard_mib, hidden=2048, random_codes=True)
        largest = max(p.stat().st_size for p in src.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in src.iterdir())
        hub = FakeHub().start()
        hub.delay = args.latency
        hub.files["org/src"] = src
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(
            HF_ENDPOINT=hub.url,
            HF_TOKEN="hf_bench",
            HF_HUB_DISABLE_XET="1",
            HF_HOME=str(work / "home"),
            HF_HUB_DISABLE_PROGRESS_BARS="1",
        )
        (work / "tmp").mkdir()
        env["TMPDIR"] = str(work / "tmp")
        rows: dict[str, list[tuple[float, int, int]]] = {"stream": [], "baseline": []}
        for r in range(args.rounds):
            hub.lfs.clear()
            hub.trees.clear()
            hub.pull_requests.clear()
            order = ["stream", "baseline"] if r % 2 == 0 else ["baseline", "stream"]
            for kind in order:
                if kind == "stream":
                    command = [
                        sys.executable,
                        "-m",
                        "fp8fix",
                        "convert",
                        "org/src",
                        "--push-to-hub",
                        f"me/dst{r}",
                        "-q",
                        "--max-disk",
                        str(int(args.max_disk_shards * largest)),
                    ]
                else:
                    command = [sys.executable, "-c", BASELINE, str(work / "tmp"), f"me/base{r}"]
                rows[kind].append(timed(command, env, work / "tmp"))
        hub.stop()
    print(
        f"{args.shards} shards, {total / 2**20:.0f} MiB; --max-disk {args.max_disk_shards:g} x largest shard "
        f"({args.max_disk_shards * largest / 2**20:.0f} MiB); {args.latency * 1000:g} ms per request; "
        f"medians of {args.rounds} rounds, alternating"
    )
    print(f"{'':10} {'wall s':>8} {'peak RSS MB':>12} {'peak disk MB':>13}")
    med = {}
    for kind, values in rows.items():
        med[kind] = [statistics.median(v[i] for v in values) for i in range(3)]
        w, rss, disk = med[kind]
        print(f"{kind:10} {w:8.2f} {rss / 1e6:12.0f} {disk / 1e6:13.0f}")
    print(f"ratio stream / baseline (wall): {med['stream'][0] / med['baseline'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

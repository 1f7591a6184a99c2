#!/usr/bin/env python3
"""Benchmark `fp8fix convert` against `cp -r` and a naive load_file/save_file baseline, side by side.

Builds a synthetic multi-shard Phi-3-shaped FP8 checkpoint (real headers, normal
weights quantized to FP8 as exporters do, single-scale fused modules), then runs each contender
in turn, round-robin, `--repeats` times, and reports the median wall time, the
ratio to `cp -r` and the peak RSS of each (from the child's own rusage). The order
is shuffled each round; the page cache is warm (the source was just written) and
`sync` runs before each timed command, so no run pays for another's write-back.

    python scripts/bench_convert.py                      # 2 GB, default layout
    python scripts/bench_convert.py --size-gb 0.5 --repeats 3 --layout fused
    python scripts/bench_convert.py --baseline /tmp/fp8fix-main   # also time another checkout, same run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Phi-3-mini dimensions
HIDDEN, HEADS, INTERMEDIATE, VOCAB = 3072, 32, 8192, 32064

NAIVE = """
import json, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
for p in sorted(src.iterdir()):
    if p.suffix == ".safetensors":
        save_file(load_file(p), out / p.name, metadata={"format": "pt"})
    else:
        (out / p.name).write_bytes(p.read_bytes())
"""


def fp8_codes(rows: int, cols: int, gen):  # type: ignore[no-untyped-def]
    """Weights as exporters write them: normal values quantized with a per-tensor absmax scale."""
    import torch

    w = torch.randn(rows, cols, generator=gen)
    return (w * (448 / w.abs().max())).clamp(-448, 448).to(torch.float8_e4m3fn)


def layer(i: int, gen):  # type: ignore[no-untyped-def]
    import torch

    p = f"model.layers.{i}."
    out = {}
    for module, rows, cols in (
        ("self_attn.qkv_proj", 3 * HIDDEN, HIDDEN),
        ("self_attn.o_proj", HIDDEN, HIDDEN),
        ("mlp.gate_up_proj", 2 * INTERMEDIATE, HIDDEN),
        ("mlp.down_proj", HIDDEN, INTERMEDIATE),
    ):
        out[p + module + ".weight"] = fp8_codes(rows, cols, gen)
        out[p + module + ".weight_scale"] = torch.tensor(0.001 + i * 1e-5)
        out[p + module + ".input_scale"] = torch.tensor(0.02)
    out[p + "self_attn.k_scale"] = torch.tensor(0.06)
    out[p + "self_attn.v_scale"] = torch.tensor(0.06)
    out[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    out[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return out


def build_checkpoint(root: Path, size_gb: float, shard_gb: float = 0.5) -> None:
    """Runs in its own process (see main): the parent must stay small, since a forked child's
    peak RSS counts the parent's pages until exec."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    per_layer = (3 * HIDDEN * HIDDEN) + HIDDEN * HIDDEN + 2 * INTERMEDIATE * HIDDEN + HIDDEN * INTERMEDIATE
    embeddings = 2 * VOCAB * HIDDEN * 2
    layers = max(1, round((size_gb * 1e9 - embeddings) / per_layer))
    root.mkdir(parents=True)
    shards: list[dict] = [{"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)}]
    for i in range(layers):
        if sum(t.numel() * t.element_size() for t in shards[-1].values()) > shard_gb * 1e9:
            shards.append({})
        shards[-1].update(layer(i, gen))
    shards[-1]["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    shards[-1]["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        shards[k] = {}
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layout", default=None, help="fp8fix --layout (default: the architecture's)")
    parser.add_argument("--to", default=None, help="fp8fix --to (encoding conversion), when supported")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument(
        "--baseline", type=Path, help="another fp8fix checkout (a git worktree) to time beside this one"
    )
    parser.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_only:
        build_checkpoint(args.build_only, args.size_gb)
        return

    work = Path(tempfile.mkdtemp(prefix="fp8fix-bench-", dir=args.workdir))
    try:
        src = work / "src"
        build = [sys.executable, __file__, "--build-only", str(src), "--size-gb", str(args.size_gb)]
        subprocess.run(build, check=True)
        size = sum(p.stat().st_size for p in src.iterdir())
        fp8fix = [sys.executable, "-m", "fp8fix", "convert", str(src), str(work / "out"), "-q"]
        if args.layout:
            fp8fix += ["--layout", args.layout]
        if args.to:
            fp8fix += ["--to", args.to]
        contenders = {"fp8fix convert": fp8fix, "cp -r": ["cp", "-r", str(src), str(work / "out")]}
        envs: dict[str, dict[str, str]] = {}
        if args.baseline:  # the same command, importing fp8fix from the other checkout first
            contenders["fp8fix convert (baseline)"] = fp8fix
            envs["fp8fix convert (baseline)"] = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
        if not args.skip_naive:
            contenders["naive load_file/save_file"] = [sys.executable, "-c", NAIVE, str(src), str(work / "out")]
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        order = list(contenders)
        for round_ in range(args.repeats):
            random.Random(round_).shuffle(order)  # no contender always runs after the same one
            for name in order:
                cmd = contenders[name]
                shutil.rmtree(work / "out", ignore_errors=True)
                subprocess.run(["sync"], check=False)
                results[name].append(timed(cmd, envs.get(name)))
        shutil.rmtree(work / "out", ignore_errors=True)
        base = statistics.median(w for w, _ in results["cp -r"])
        print(
            f"checkpoint: {size / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards; "
            f"{args.repeats} runs each, shuffled round-robin; fp8fix args: {' '.join(fp8fix[3:])}"
        )
        print(f"{'contender':<28} {'median s':>9} {'x cp -r':>8} {'peak RSS MB':>12}")
        for name, runs in results.items():
            wall = statistics.median(w for w, _ in runs)
            rss = max(r for _, r in runs)
            print(f"{name:<28} {wall:>9.2f} {wall / base:>8.2f} {rss:>12.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

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
    python scripts/bench_convert.py --codes random --to e4m3fnuz --jobs 1 --baseline /tmp/fp8fix-main
    python scripts/bench_convert.py --suite --size-gb 1.3 --repeats 3   # every row of docs/benchmarks.md's table
    python scripts/bench_convert.py --suite --baseline /tmp/fp8fix-main  # and the planning series, both checkouts
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


def fp8_codes(rows: int, cols: int, gen, codes: str = "normal"):  # type: ignore[no-untyped-def]
    """Weights as exporters write them: normal values quantized with a per-tensor absmax scale;
    or (codes="random") uniformly random finite e4m3fn codes, 1 in 256 of them 0x80."""
    import torch

    if codes == "random":
        raw = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        return raw.view(torch.float8_e4m3fn)
    w = torch.randn(rows, cols, generator=gen)
    return (w * (448 / w.abs().max())).clamp(-448, 448).to(torch.float8_e4m3fn)


def layer(i: int, gen, codes: str = "normal", per_shard: bool = False):  # type: ignore[no-untyped-def]
    import torch

    p = f"model.layers.{i}."
    out = {}
    for module, rows, cols, shards in (
        ("self_attn.qkv_proj", 3 * HIDDEN, HIDDEN, 3),
        ("self_attn.o_proj", HIDDEN, HIDDEN, 1),
        ("mlp.gate_up_proj", 2 * INTERMEDIATE, HIDDEN, 2),
        ("mlp.down_proj", HIDDEN, INTERMEDIATE, 1),
    ):
        out[p + module + ".weight"] = fp8_codes(rows, cols, gen, codes)
        if per_shard and shards > 1:  # vLLM <= 0.5.0 layout: one scale per shard, all different
            out[p + module + ".weight_scale"] = torch.tensor([0.001 * (k + 1) + i * 1e-5 for k in range(shards)])
        else:
            out[p + module + ".weight_scale"] = torch.tensor(0.001 + i * 1e-5)
        out[p + module + ".input_scale"] = torch.tensor(0.02)
    out[p + "self_attn.k_scale"] = torch.tensor(0.06)
    out[p + "self_attn.v_scale"] = torch.tensor(0.06)
    out[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    out[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return out


def build_checkpoint(
    root: Path, size_gb: float, shard_gb: float = 0.5, codes: str = "normal", per_shard: bool = False
) -> None:
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
        shards[-1].update(layer(i, gen, codes, per_shard))
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


def build_sparse(root: Path, size_gb: float, shards: int = 8) -> None:
    """A checkpoint of `size_gb` whose weights are holes (zero codes): real headers, no disk blocks.
    Enough to show memory does not grow with the checkpoint, without writing 20 GB to build it."""
    root.mkdir(parents=True)
    rows, cols = 8192, HIDDEN
    per_tensor = rows * cols
    tensors_per_shard = max(1, int(size_gb * 1e9 / shards / per_tensor))
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for j in range(tensors_per_shard):
            module = f"model.layers.{k * tensors_per_shard + j}.mlp.down_proj"
            header[module + ".weight"] = {
                "dtype": "F8_E4M3",
                "shape": [rows, cols],
                "data_offsets": [offset, offset + per_tensor],
            }
            offset += per_tensor
            header[module + ".weight_scale"] = {"dtype": "F32", "shape": [], "data_offsets": [offset, offset + 4]}
            offset += 4
            weight_map.update(dict.fromkeys([module + ".weight", module + ".weight_scale"], name))
        body = json.dumps(header).encode()
        body += b" " * (-len(body) % 8)
        with open(root / name, "wb") as f:
            f.write(len(body).to_bytes(8, "little") + body)
            for j in range(tensors_per_shard):  # the scales: 1.0; the weights stay holes
                f.seek(8 + len(body) + (j + 1) * per_tensor + j * 4)
                f.write(b"\x00\x00\x80\x3f")
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    }
    (root / "config.json").write_text(json.dumps(config))


#: Children run with bytecode caches, as an installed fp8fix does (pip compiles at install); a
#: PYTHONDONTWRITEBYTECODE left in the environment would time the compiling of every module.
BASE_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def compile_sources(*roots: Path) -> None:
    """Write the bytecode caches of fp8fix's checkouts before anything is timed."""
    for root in roots:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "fp8fix")], check=True, env=BASE_ENV)


#: This checkout; and the checkout each contender name runs from, where it is another (`with_before`).
ROOT = Path(__file__).resolve().parent.parent
CHECKOUT_OF: dict[str, Path] = {}


def timed(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[float, float, float, float]:
    """Wall seconds, peak RSS (MB), user and system CPU seconds (its worker processes included) of one child,
    run in `cwd`: `python -m fp8fix` puts the working folder first on sys.path, so a baseline's PYTHONPATH
    alone would still import this checkout from here."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env or BASE_ENV, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime, usage.ru_stime


def run_group(
    title: str,
    src: Path,
    work: Path,
    contenders: dict[str, list[str]],
    repeats: int,
    envs: dict[str, dict[str, str]],
    rewritten: dict[str, int] | None = None,
) -> list[str]:
    """Time each contender `repeats` times, shuffled round-robin; markdown rows with medians, spreads, ratios.

    "GB/s" divides SOURCE's bytes by the time; "rewritten GB/s" the bytes a contender rewrites (`rewritten`,
    by contender name; absent: "-"), the figure a per-core rewriting speed is about."""
    results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in contenders}
    order = list(contenders)
    for round_ in range(repeats):
        random.Random(round_).shuffle(order)  # no contender always runs after the same one
        for name in order:
            shutil.rmtree(work / "out", ignore_errors=True)
            subprocess.run(["sync"], check=False)
            results[name].append(timed(contenders[name], envs.get(name), CHECKOUT_OF.get(name, ROOT)))
    shutil.rmtree(work / "out", ignore_errors=True)
    size = sum(p.stat().st_size for p in src.iterdir())
    shards = len(list(src.glob("*.safetensors")))
    base = statistics.median(r[0] for r in results["cp -r"]) if "cp -r" in results else None
    rows = []
    for name, runs in results.items():
        walls = [r[0] for r in runs]
        wall = statistics.median(walls)
        ratio = f"{wall / base:.2f}" if base else "-"
        rate = f"{size / wall / 1e9:.2f}"
        done = (rewritten or {}).get(name.removesuffix(BEFORE))
        rewrite_rate = f"{done / wall / 1e9:.2f} ({done / 1e9:.2f} GB)" if done else "-"
        rss = max(r[1] for r in runs)
        user, system = (statistics.median(r[i] for r in runs) for i in (2, 3))
        rows.append(
            f"| {title} ({size / 1e9:.2f} GB, {shards} shards) | {name} | {wall:.2f} "
            f"| {min(walls):.2f}-{max(walls):.2f} | {ratio} | {rate} | {rewrite_rate} | {rss:.0f} "
            f"| {user:.2f} / {system:.2f} |"
        )
    return rows


HEADER = [
    "| checkpoint | command | median s | min-max s | x cp -r | GB/s of SOURCE | rewritten GB/s (bytes) | peak RSS MB "
    "| CPU s: user / system |",
    "|---|---|---|---|---|---|---|---|---|",
]
#: The suffix of a contender run from `--baseline`'s checkout.
BEFORE = " [before]"


def tensor_bytes(root: Path, wanted) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the tensors of `root`'s shards for which `wanted(name, dtype)` is true (headers only)."""
    total = 0
    for path in root.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__" and wanted(name, entry["dtype"]):
                total += entry["data_offsets"][1] - entry["data_offsets"][0]
    return total


def fp8_bytes(root: Path) -> int:
    return tensor_bytes(root, lambda name, dtype: dtype.startswith("F8"))


def fused_bytes(root: Path) -> int:
    return tensor_bytes(
        root,
        lambda name, dtype: (
            dtype.startswith("F8") and "_proj.weight" in name and ("qkv_proj" in name or "gate_up_proj" in name)
        ),
    )


def before_after(rows: list[str]) -> list[str]:
    """The README's table: each fp8fix row beside its `[before]` row of the same group (one suite run's
    markdown rows, as printed; runs saved before the CPU column have "-" there)."""
    table = [row for row in rows if row.startswith("| ") and "---" not in row]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in table]
    by_key = {(c[0], c[1]): c for c in cells if len(c) in (8, 9) and " / " not in c[2]}  # not this table
    out = [
        "| checkpoint | command | median s: after / before | after / before | x cp -r (after) "
        "| rewritten GB/s: after / before | user CPU s: after / before | system CPU s: after / before "
        "| peak RSS MB (after) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cpu(cells: list[str], which: int) -> str:
        return cells[8].split(" / ")[which] if len(cells) == 9 else "-"

    for (group, command), after in by_key.items():
        before = by_key.get((group, command + BEFORE))
        if before is None:
            continue
        ratio = float(after[2]) / float(before[2]) if float(before[2]) else float("nan")
        rates = f"{after[6].split(' ')[0]} / {before[6].split(' ')[0]}" if after[6] != "-" else "-"
        times = f"{after[2]} / {before[2]}"
        user, system = (f"{cpu(after, i)} / {cpu(before, i)}" for i in (0, 1))
        out.append(
            f"| {group} | {command} | {times} | {ratio:.2f} | {after[4]} | {rates} | {user} | {system} | {after[7]} |"
        )
    return out


def converts(group: dict[str, list[str]], rewritten: int) -> dict[str, int]:
    """`rewritten` bytes for each of `group`'s fp8fix conversions (not cp -r, verify or naive copies)."""
    return {name: rewritten for name in group if name.startswith("convert")}


def with_before(group: dict[str, list[str]], envs: dict[str, dict[str, str]], baseline: Path | None) -> None:
    """Add each fp8fix contender of `group` again, run from `baseline`'s checkout (same command, same run)."""
    if baseline is None:
        return
    for name, cmd in list(group.items()):
        if name.startswith(("convert", "verify")):
            group[name + BEFORE] = cmd
            envs[name + BEFORE] = {**BASE_ENV, "PYTHONPATH": str(baseline)}
            CHECKOUT_OF[name + BEFORE] = baseline


#: A process that keeps one core busy (the busy-machine group's other user).
SPIN = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end: pass"


def busy_group(args: argparse.Namespace, work: Path, src: Path, envs: dict[str, dict[str, str]]) -> list[str]:
    """`--to e4m3fnuz` with one core kept busy by another process (`--jobs auto` sees it in the kernel's CPU
    time at once): the default `--jobs auto` against `--jobs 1` and `--jobs` of every core (the old default)."""
    cores = len(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", SPIN, "3600"])
    try:
        time.sleep(1)
        py = [sys.executable, "-m", "fp8fix", "convert", str(src), str(work / "out"), "-q", "--to", "e4m3fnuz"]
        group = {
            "convert --to e4m3fnuz (default: --jobs auto)": py,
            "convert --to e4m3fnuz --jobs 1": [*py, "--jobs", "1"],
            f"convert --to e4m3fnuz --jobs {cores} (every core)": [*py, "--jobs", str(cores)],
        }
        title = f"one of {cores} cores busy (another process spins)"
        return run_group(title, src, work, group, args.repeats, envs, converts(group, fp8_bytes(src)))
    finally:
        spinner.kill()
        spinner.wait()


def bf16_group(args: argparse.Namespace, work: Path, envs: dict[str, dict[str, str]]) -> list[str]:
    """Block FP8 -> BF16 (every weight): fp8fix against DeepSeek's fp8_cast_bf16 arithmetic (bench_bf16.py)
    and, with `--peer-python`, compressed-tensors' model-free FP8BlockDequantizer; then `--tp 32 --tp-bf16`
    on attention in heads of 64. In both, `cp -r` copies fp8fix's output: the same bytes written, the floor."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_bf16 import DEEPSEEK

    rows = []
    for attention in (False, True):
        src = work / ("block-fp8-attention" if attention else "block-fp8")
        code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); from pathlib import Path; "
            f"from bench_bf16 import build; build(Path({str(src)!r}), {args.bf16_gb}, 4, {attention})"
        )
        subprocess.run([sys.executable, "-c", code], check=True, env=BASE_ENV)
        out = str(work / "out")
        job = ["--tp", "32", "--tp-bf16"] if attention else ["--to", "bf16"]
        py = [sys.executable, "-m", "fp8fix", "convert", str(src), out, "-q", *job]
        reference = work / "bf16-output"
        subprocess.run([*py[:5], str(reference), *py[6:]], check=True, env=BASE_ENV)
        name = f"convert {' '.join(job)}"
        group = {name: py, f"{name} --jobs 1": [*py, "--jobs", "1"], "cp -r": ["cp", "-r", str(reference), out]}
        if not attention:
            deepseek = "DeepSeek fp8_cast_bf16 arithmetic (torch, CPU, 1 thread)"
            (work / "deepseek.py").write_text(DEEPSEEK)
            group[deepseek] = [sys.executable, str(work / "deepseek.py"), str(src), out]
            envs[deepseek] = {**BASE_ENV, "OMP_NUM_THREADS": "1"}
            if args.peer_python:
                peer = "compressed-tensors FP8BlockDequantizer (convert_checkpoint)"
                group[peer] = [str(args.peer_python), "-c", CT_DEQUANTIZE, str(src), out]
                envs[peer] = {**BASE_ENV, "OMP_NUM_THREADS": "1"}
        with_before(group, envs, args.baseline)
        out_bytes = sum(p.stat().st_size for p in reference.glob("*.safetensors"))
        written = {n: out_bytes for n in group if n != "cp -r"}  # every converter writes them all
        title = "attention in heads of 64 -> --tp-bf16" if attention else "block FP8 -> BF16"
        rows += run_group(title, src, work, group, args.repeats, envs, written)
        shutil.rmtree(src)
        shutil.rmtree(reference)
    return rows


#: compressed-tensors' model-free converter (compressed_tensors.entrypoints.convert), dequantizing every
#: block-FP8 weight to BF16, one worker; run with `--peer-python`, an interpreter that has it.
CT_DEQUANTIZE = """
import sys, torch
torch.set_num_threads(1)
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
convert_checkpoint(sys.argv[1], sys.argv[2], FP8BlockDequantizer(targets=["re:.*"]), max_workers=1)
"""


def suite(args: argparse.Namespace, work: Path) -> None:
    """Every row of the performance table (docs/benchmarks.md), in one run; with `--baseline`, each
    fp8fix row again from that checkout ("[before]"), round-robin with the rest."""
    py = [sys.executable, "-m", "fp8fix"]
    envs: dict[str, dict[str, str]] = {}

    def build(name: str, *extra: str) -> Path:
        root = work / name
        subprocess.run([sys.executable, __file__, "--build-only", str(root), *extra], check=True)
        return root

    def convert(src: Path, *options: str) -> list[str]:
        return [*py, "convert", str(src), str(work / "out"), "-q", *options]

    def cp(src: Path) -> list[str]:
        return ["cp", "-r", str(src), str(work / "out")]

    def group_rows(title: str, src: Path, group: dict[str, list[str]], rewritten: dict[str, int], repeats: int):  # type: ignore[no-untyped-def]
        with_before(group, envs, args.baseline)
        return run_group(title, src, work, group, repeats, envs, rewritten)

    rows = list(HEADER)
    shard_gb = str(args.size_gb / 4)
    real = build("realistic", "--size-gb", str(args.size_gb), "--shard-gb", shard_gb)
    ref_fnuz = work / "ref-fnuz"
    subprocess.run([*py, "convert", str(real), str(ref_fnuz), "-q", "--to", "e4m3fnuz"], check=True)
    fp8 = fp8_bytes(real)
    group = {
        "cp -r": cp(real),
        "convert (byte moves)": convert(real),
        "convert --to e4m3fnuz": convert(real, "--to", "e4m3fnuz"),
        "convert --to e4m3fnuz --jobs 1": convert(real, "--to", "e4m3fnuz", "--jobs", "1"),
        "verify (e4m3fnuz output)": [*py, "verify", str(real), str(ref_fnuz), "-q"],
        "verify (e4m3fnuz output) --jobs 1": [*py, "verify", str(real), str(ref_fnuz), "-q", "--jobs", "1"],
    }
    if not args.skip_naive:
        group["naive load_file/save_file"] = [sys.executable, "-c", NAIVE, str(real), str(work / "out")]
    recoded = {"convert --to e4m3fnuz": fp8, "convert --to e4m3fnuz --jobs 1": fp8}
    rows += group_rows("realistic weights", real, group, recoded, args.repeats)
    shutil.rmtree(ref_fnuz)
    if args.busy and len(os.sched_getaffinity(0)) > 1:
        rows += busy_group(args, work, real, envs)

    rand = build("random", "--size-gb", str(args.size_gb), "--shard-gb", shard_gb, "--codes", "random")
    group = {
        "cp -r": cp(rand),
        "convert --to e4m3fnuz": convert(rand, "--to", "e4m3fnuz"),
        "convert --to e4m3fnuz --jobs 1": convert(rand, "--to", "e4m3fnuz", "--jobs", "1"),
    }
    rows += group_rows("uniformly random codes", rand, group, converts(group, fp8_bytes(rand)), args.repeats)
    shutil.rmtree(rand)

    req = build("per-shard", "--size-gb", str(args.requant_gb), "--shard-gb", str(args.requant_gb / 4), "--per-shard")
    ref_fused = work / "ref-fused"
    subprocess.run([*py, "convert", str(req), str(ref_fused), "-q", "--layout", "fused"], check=True)
    group = {
        "cp -r": cp(req),
        "convert --layout fused (requantizes)": convert(req, "--layout", "fused"),
        "convert --layout fused --jobs 1": convert(req, "--layout", "fused", "--jobs", "1"),
        "verify (requantized output)": [*py, "verify", str(req), str(ref_fused), "-q"],
        "verify (requantized output) --jobs 1": [*py, "verify", str(req), str(ref_fused), "-q", "--jobs", "1"],
    }
    rows += group_rows("per-shard scales, all different", req, group, converts(group, fused_bytes(req)), args.repeats)
    shutil.rmtree(ref_fused)
    shutil.rmtree(req)

    if args.bf16_gb:
        rows += bf16_group(args, work, envs)

    example = Path(__file__).resolve().parent.parent / "examples" / "phi3-tiny-fp8"
    group = {
        "convert (start-up: imports, planning, 0.1 MB)": convert(example),
        "python -c pass": [sys.executable, "-c", "pass"],
    }
    rows += group_rows("shipped example", example, group, {}, args.repeats)

    if args.large_gb:
        large = build("large", "--size-gb", str(args.large_gb), "--shard-gb", str(args.large_gb / 8))
        group = {
            "cp -r": cp(large),
            "convert (byte moves)": convert(large),
            "convert --to e4m3fnuz": convert(large, "--to", "e4m3fnuz"),
        }
        rows += group_rows("large", large, group, {"convert --to e4m3fnuz": fp8_bytes(large)}, args.repeats)
        shutil.rmtree(large)
    if args.flat_gb:
        flat = work / "flat"
        build_sparse(flat, args.flat_gb)
        group = {"convert (byte moves)": convert(flat), "convert --to e4m3fnuz": convert(flat, "--to", "e4m3fnuz")}
        rows += run_group("sparse, memory flatness", flat, work, group, 1, envs)
    print("\n".join(rows), flush=True)
    if args.baseline:
        print("\n" + "\n".join(before_after(rows)), flush=True)
    if args.tensor_counts:  # planning at scale: header-only commands, DeepSeek-V3-shaped, ~625 tensors per shard
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_tensor_count import series

        counts = args.tensor_counts
        checkouts = {"this": Path(__file__).resolve().parent.parent}
        if args.baseline:
            checkouts["baseline"] = args.baseline.resolve()
        shards_of = {n: max(1, n // 625) for n in counts}
        print("\n" + "\n".join(series(counts, shards_of, args.repeats, checkouts, work)))
        # and fused Phi-3 layers at the largest count: `--target auto` judging 8 candidates, against one layout
        largest = max(counts)
        phi3 = series([largest], {largest: max(1, largest // 2800)}, args.repeats, checkouts, work / "phi3", "phi3")
        print("\n" + "\n".join(phi3))


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
    parser.add_argument("--suite", action="store_true", help="every row of docs/benchmarks.md's performance table")
    parser.add_argument("--requant-gb", type=float, default=0.35, help="--suite: the requantizing checkpoint's size")
    parser.add_argument("--large-gb", type=float, default=4.0, help="--suite: the large checkpoint (0: skip)")
    parser.add_argument("--flat-gb", type=float, default=20.0, help="--suite: the sparse checkpoint (0: skip)")
    parser.add_argument(
        "--tensor-counts",
        type=int,
        nargs="*",
        default=[10_000, 30_000, 100_000],
        help="--suite: the planning series' tensor counts (none: skip); with --baseline, both checkouts",
    )
    parser.add_argument("--bf16-gb", type=float, default=0.5, help="--suite: block-FP8 weights for --to bf16 (0: skip)")
    parser.add_argument(
        "--peer-python", type=Path, help="--suite: a Python with compressed-tensors, for its FP8BlockDequantizer row"
    )
    parser.add_argument("--no-busy", dest="busy", action="store_false", help="--suite: skip the busy-machine group")
    parser.add_argument(
        "--before-after", type=Path, metavar="FILE", help="print the before/after table of a saved --suite run"
    )
    parser.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shard-gb", type=float, default=0.5, help=argparse.SUPPRESS)
    parser.add_argument("--codes", default="normal", choices=["normal", "random"], help="realistic or random codes")
    parser.add_argument("--jobs", type=int, default=None, help="fp8fix --jobs")
    parser.add_argument("--per-shard", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.baseline = args.baseline.resolve() if args.baseline else None
    if args.before_after:
        print("\n".join(before_after(args.before_after.read_text().splitlines())))
        return
    if args.build_only:
        build_checkpoint(args.build_only, args.size_gb, args.shard_gb, args.codes, args.per_shard)
        return

    compile_sources(Path(__file__).resolve().parent.parent, *([args.baseline] if args.baseline else []))
    work = Path(tempfile.mkdtemp(prefix="fp8fix-bench-", dir=args.workdir))
    try:
        if args.suite:
            suite(args, work)
            return
        src = work / "src"
        build = [sys.executable, __file__, "--build-only", str(src), "--size-gb", str(args.size_gb)]
        build += ["--codes", args.codes]
        subprocess.run(build, check=True)
        fp8fix = [sys.executable, "-m", "fp8fix", "convert", str(src), str(work / "out"), "-q"]
        if args.layout:
            fp8fix += ["--layout", args.layout]
        if args.to:
            fp8fix += ["--to", args.to]
        if args.jobs:
            fp8fix += ["--jobs", str(args.jobs)]
        contenders = {"fp8fix convert": fp8fix, "cp -r": ["cp", "-r", str(src), str(work / "out")]}
        envs: dict[str, dict[str, str]] = {}
        if args.baseline:  # the same command, importing fp8fix from the other checkout first
            contenders["fp8fix convert (baseline)"] = fp8fix
            envs["fp8fix convert (baseline)"] = {**BASE_ENV, "PYTHONPATH": str(args.baseline)}
            CHECKOUT_OF["fp8fix convert (baseline)"] = args.baseline
        if not args.skip_naive:
            contenders["naive load_file/save_file"] = [sys.executable, "-c", NAIVE, str(src), str(work / "out")]
        print(f"fp8fix args: {' '.join(fp8fix[3:])}")
        print("\n".join(HEADER + run_group("synthetic Phi-3", src, work, contenders, args.repeats, envs)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
